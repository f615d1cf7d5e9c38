"""Where one batch-1 decode step of a served MoE GGUF model goes: a folder converted by ``benchmark/gguf_moe_rss.py``
(e.g. 4 or 8 layers of ``benchmark/make_big_moe_gguf.py``'s Qwen3-30B-A3B shape) loaded in bf16 on the CPU.

Each part of an engine step is timed around its call (wall time and the process's CPU time, every thread's): the
token embedding, the native decoder stack (all layers in one call), the final norm, the LM head, the sampler, and
the rest of ``Engine.step`` (scheduling, inputs, outputs: the engine's Python). Then each layer's MoE block alone
(router, top-8 experts) on a random row, so that attention is the stack's time less the MoE blocks'. A copy of a
1 GiB tensor gives the memory bandwidth the parts' bytes are compared with.

    python benchmark/moe_decode_breakdown.py /tmp/moedecode_4/served [--threads 2] [--steps 32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu

PROMPT = 'The printing press changed how books were made in Europe because'


class PartTimer:
    """Sums wall and process CPU time of the wrapped calls, per part."""

    def __init__(self):
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            wall, cpu_time = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - wall
                self.cpu[name] += time.process_time() - cpu_time
        return timed

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()


def bandwidth_gbs(threads: int, gib: float = 1.0) -> float:
    """GB/s of a ``torch`` copy of ``gib`` GiB (bytes read plus written), the best of 5."""
    torch.set_num_threads(threads)
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best / 1e9


def timed(fn: Callable) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def instrument(engine: Engine, timer: PartTimer) -> None:
    model = engine.runner.model
    inner = model
    if inner.native_stack is None:
        raise SystemExit('the model runs no native decoder stack')
    stack = inner.native_stack
    stack_call = type(stack).__call__  # instances do not look up dunders: wrap the class's
    type(stack).__call__ = lambda self, *a, **k: timer.wrap('decoder stack', stack_call)(self, *a, **k)
    for name, module in (('embedding', inner.embed_tokens), ('final norm', inner.norm),
                         ('LM head', inner.lm_head)):
        module.forward = timer.wrap(name, module.forward)
    engine.step = timer.wrap('engine step (all)', engine.step)
    from lmdeploy.pytorch.engine import engine as engine_module
    if hasattr(engine_module, 'launch_sample'):
        engine_module.launch_sample = timer.wrap('sampler', engine_module.launch_sample)


def decode(engine: Engine, prompt: list[int], steps: int) -> tuple[list[int], float]:
    """Greedy tokens of ``prompt`` (the prefill's, then ``steps`` decode steps') and the decode steps' wall time."""
    engine.add_request(prompt, GenerationConfig(max_new_tokens=steps + 1, ignore_eos=True, do_sample=False))
    tokens: list[int] = []
    start = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
        if start is None and tokens:
            start = time.perf_counter()
    return tokens, time.perf_counter() - start


def layer_parts_ms(engine: Engine, repeats: int = 10) -> dict[str, list[float]]:
    """Each layer's parts alone on a random bf16 row: the MoE block (router and experts) and the attention's
    projections (qkv, o), ms of process CPU time (median of ``repeats`` passes over all the layers, so that each
    call reads its weights from memory, not from a cache, as a step does)."""
    model = engine.runner.model
    hidden = model.layers[0].mlp.experts.hidden_size
    x = torch.randn(1, hidden, dtype=torch.bfloat16) * 0.1
    attn_out = torch.randn(1, model.layers[0].self_attn.o_proj.in_features, dtype=torch.bfloat16) * 0.1
    cpu.bind_worker_threads()
    calls = []
    for layer in model.layers:
        block = layer.mlp.native_moe(small_step=True)
        calls += [('MoE block', lambda block=block: block(x)),
                  ('qkv_proj', lambda layer=layer: layer.self_attn.qkv_proj(x)),
                  ('o_proj', lambda layer=layer: layer.self_attn.o_proj(attn_out))]
    times: dict[str, list[list[float]]] = defaultdict(list)
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            for i, (name, fn) in enumerate(calls):
                elapsed = 1e3 * cpu_timed(fn)
                if repeat:
                    times[name].append(elapsed)
    layers = len(model.layers)
    return {name: [statistics.median(t[i::layers]) for i in range(layers)] for name, t in times.items()}


def cpu_timed(fn: Callable) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('folder')
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--steps', type=int, default=32)
    parser.add_argument('--rounds', type=int, default=3)
    args = parser.parse_args()
    for threads in sorted({1, args.threads}):
        print(f'copy bandwidth, {threads} thread(s): {bandwidth_gbs(threads):.1f} GB/s (read + write)', flush=True)
    engine = Engine(args.folder, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=16, block_size=16,
                                                     num_threads=args.threads, enable_prefix_caching=False),
                    show_progress=False)
    try:
        timer = PartTimer()
        instrument(engine, timer)
        prompt = engine.tokenizer.encode(PROMPT)
        decode(engine, prompt, 4)
        for _ in range(args.rounds):
            timer.reset()
            tokens, elapsed = decode(engine, prompt, args.steps)
            steps = len(tokens)
            parts = ['embedding', 'decoder stack', 'final norm', 'LM head', 'sampler']
            other = timer.wall['engine step (all)'] - sum(timer.wall[p] for p in parts)
            print(f'decode {args.steps} tokens at batch 1, {args.threads} thread(s): {args.steps / elapsed:.2f} tok/s; '
                  f'ms a step over {steps} steps (the first a prefill), wall (process CPU):', flush=True)
            for part in parts + ['engine step (all)']:
                print(f'  {part:20s} {1e3 * timer.wall[part] / steps:8.2f} ({1e3 * timer.cpu[part] / steps:8.2f})')
            print(f'  {"rest of the step":20s} {1e3 * other / steps:8.2f}', flush=True)
        print(f'tokens {tokens}', flush=True)
        for name, times in layer_parts_ms(engine).items():
            print(f'{name} alone, ms of CPU per layer: ' + ' '.join(f'{t:.2f}' for t in times)
                  + f' (sum {sum(times):.2f})', flush=True)
    finally:
        engine.close()


if __name__ == '__main__':
    main()
