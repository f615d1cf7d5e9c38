"""Shared by the native decoder stack's benchmarks (moe_stack.py, ernie_stack.py, query_scale_cpu.py): an engine
whose bf16 layers run in the stack, and its decode steps timed as the calling thread's CPU time of the model's
forward (``time.thread_time``: other jobs on a shared machine take time slices but not figures)."""
from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu


def stack_engine(save_model: Callable[[str], None]) -> Engine:
    """A one-thread bf16 engine on the checkpoint ``save_model`` writes, its layers in the native stack. On a CPU
    with AMX, whose bf16 layers prefer oneDNN (where the stack does not run), they take the native bf16 GEMM, as the
    stack's tests run them."""
    if cpu.bf16_gemm() is None and cpu.native() is not None and cpu.native().bf16_gemm_available():
        cpu.bf16_gemm = cpu.native
    with tempfile.TemporaryDirectory() as path:
        save_model(path)
        engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_threads=1, num_gpu_blocks=256, block_size=16,
                                                  max_batch_size=16, enable_prefix_caching=False), show_progress=False)
    if engine.runner.model.native_stack is None:
        raise SystemExit('the model does not run in the native stack on this CPU (it needs AVX512-BF16)')
    return engine


class DecodeStepTimer:
    """Wraps the engine's model forward: the milliseconds of each decode step, under the current ``label``."""

    def __init__(self, engine: Engine):
        self.model = engine.runner.model
        self.times: dict[str, list[float]] = {}
        self.label = ''
        forward = self.model.forward

        def timed(input_ids, kv_caches, ctx):
            start = time.thread_time()
            out = forward(input_ids, kv_caches, ctx)
            if ctx.num_prefill_tokens == 0:
                self.times.setdefault(self.label, []).append((time.thread_time() - start) * 1e3)
            return out

        self.model.forward = timed


def run_requests(engine: Engine, prompts: list[list[int]], steps: int) -> None:
    """Runs ``prompts`` together for ``steps`` decode steps each."""
    gen = GenerationConfig(max_new_tokens=steps + 1, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, gen)
    while engine.has_unfinished():
        engine.step()


def print_stack_against_layers(engine: Engine, vocab: int, batches: str, steps: int, rounds: int) -> None:
    """One table row per batch size: decode step times with the layers in the stack and through their Python
    forward, the two alternating round by round."""
    timer = DecodeStepTimer(engine)
    stack = timer.model.native_stack
    print('| batch | stack best | stack median | layers best | layers median | layers / stack (best) |')
    print('| --- | --- | --- | --- | --- | --- |')
    g = torch.Generator().manual_seed(1)
    for batch in map(int, batches.split(',')):
        timer.times.clear()
        prompts = [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(batch)]
        for _ in range(rounds):
            for timer.label in ('stack', 'layers'):
                timer.model.native_stack = stack if timer.label == 'stack' else None
                run_requests(engine, prompts, steps)
        best = {m: min(t) for m, t in timer.times.items()}
        median = {m: statistics.median(t) for m, t in timer.times.items()}
        print(f'| {batch} | {best["stack"]:.1f} | {median["stack"]:.1f} | {best["layers"]:.1f} | '
              f'{median["layers"]:.1f} | {best["layers"] / best["stack"]:.3f} |', flush=True)
    timer.model.native_stack = stack
