"""Decode step time of ERNIE 4.5 dense at ERNIE-4.5-0.3B's shape (hidden 1024, 18 layers, 16 query and 2 KV heads
of 128, MLP 3072, rotary over neighbouring pairs; a 1024-word vocabulary) on the CPU with its layers in the native
decoder stack against their Python forward, in the same run, random bf16 weights, one thread. The step time is the
calling thread's CPU time of the model's forward (``time.thread_time``: other jobs on a shared machine take time
slices but not figures), the best and the median over rounds in which the two paths alternate. On a CPU with AMX,
whose bf16 layers run on oneDNN (where the stack does not run), the layers run on the native bf16 GEMM here, as the
tests of the stack run them.

    python benchmark/ernie_stack.py [--layers 18] [--batches 1,16] [--steps 8] [--rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, Ernie4_5Config
from workload import save_word_tokenizer

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu

VOCAB = 1024


def save_model(path: str, layers: int) -> None:
    """A random bf16 ERNIE 4.5 of ERNIE-4.5-0.3B's shape with ``layers`` layers."""
    config = Ernie4_5Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=128, vocab_size=VOCAB,
                            max_position_embeddings=4096, tie_word_embeddings=True, use_bias=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path, VOCAB)
    with open(os.path.join(path, 'generation_config.json'), 'w') as f:
        json.dump({}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--layers', type=int, default=18)
    parser.add_argument('--batches', default='1,16')
    parser.add_argument('--steps', type=int, default=8, help='decode steps per round')
    parser.add_argument('--rounds', type=int, default=4)
    args = parser.parse_args()
    if cpu.bf16_gemm() is None and cpu.native() is not None and cpu.native().bf16_gemm_available():
        cpu.bf16_gemm = cpu.native  # AMX CPUs prefer oneDNN: use the native GEMM, on which the stack runs
    with tempfile.TemporaryDirectory() as path:
        save_model(path, args.layers)
        engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_threads=1, num_gpu_blocks=256, block_size=16,
                                                  max_batch_size=16, enable_prefix_caching=False), show_progress=False)
    model = engine.runner.model
    stack, forward = model.native_stack, model.forward
    if stack is None:
        raise SystemExit('the model does not run in the native stack on this CPU (it needs AVX512-BF16)')
    times: dict[str, list[float]] = {}

    def timed(input_ids, kv_caches, ctx):
        start = time.thread_time()
        out = forward(input_ids, kv_caches, ctx)
        if ctx.num_prefill_tokens == 0:
            times.setdefault(mode, []).append((time.thread_time() - start) * 1e3)
        return out

    model.forward = timed
    gen = GenerationConfig(max_new_tokens=args.steps + 1, ignore_eos=True)
    print(f'ERNIE 4.5 at 0.3B shape, {args.layers} layers, bf16, 1 thread; ms per decode step (thread CPU time of '
          'the forward)')
    print('| batch | stack best | stack median | layers best | layers median | layers / stack (best) |')
    print('| --- | --- | --- | --- | --- | --- |')
    g = torch.Generator().manual_seed(1)
    for batch in map(int, args.batches.split(',')):
        times.clear()
        prompts = [torch.randint(3, VOCAB, (16,), generator=g).tolist() for _ in range(batch)]
        for _ in range(args.rounds):
            for mode in ('stack', 'layers'):
                model.native_stack = stack if mode == 'stack' else None
                for prompt in prompts:
                    engine.add_request(prompt, gen)
                while engine.has_unfinished():
                    engine.step()
        best = {m: min(t) for m, t in times.items()}
        median = {m: statistics.median(t) for m, t in times.items()}
        print(f'| {batch} | {best["stack"]:.1f} | {median["stack"]:.1f} | {best["layers"]:.1f} | '
              f'{median["layers"]:.1f} | {best["layers"] / best["stack"]:.3f} |', flush=True)


if __name__ == '__main__':
    main()
