"""Single-thread CPU time of the native prefill attention with and without key limits (Gemma 3's images: a
prompt's image tokens attend to their whole image), rounds alternating.

    python benchmark/key_limit_cpu.py

One 1,024-token prompt of bf16 K/V in blocks of 64 holding two 256-token images, 8 query and 4 KV heads of
128 (the AVX512-BF16 GEMM path) and of 256 (Gemma 3's heads: the AVX-512 row path).
"""
from __future__ import annotations

import time

import torch

from lmdeploy.pytorch.kernels import cpu

TOKENS, BLOCK, SPANS, ROUNDS = 1024, 64, [(100, 356), (500, 756)], 3


def case(head_dim: int):
    g = torch.Generator().manual_seed(0)
    blocks = TOKENS // BLOCK
    cache = [torch.randn(blocks, 4, BLOCK, head_dim, generator=g).bfloat16() for _ in range(2)]
    q = torch.randn(TOKENS, 8, head_dim, generator=g).bfloat16()
    fresh = torch.empty(TOKENS, 4, head_dim, dtype=torch.bfloat16)  # the chunk is read from the cache
    table = torch.randperm(blocks, generator=g).view(1, -1)
    args = (q, fresh, fresh, *cache, table, torch.tensor([0]), torch.tensor([TOKENS]), torch.tensor([TOKENS]),
            TOKENS, head_dim**-0.5)
    limits = torch.arange(TOKENS)
    for start, end in SPANS:
        limits[start:end] = end - 1
    return args, limits


def cpu_ms(call, repeats: int = 5) -> float:
    start = time.process_time()
    for _ in range(repeats):
        call()
    return (time.process_time() - start) / repeats * 1e3


def main() -> None:
    torch.set_num_threads(1)
    native = cpu.native()
    for head_dim in (128, 256):
        args, limits = case(head_dim)
        causal, limited = [], []
        for _ in range(ROUNDS):
            causal.append(cpu_ms(lambda: native.paged_prefill_attention(*args)))
            limited.append(cpu_ms(lambda: native.paged_prefill_attention(*args, key_limit=limits)))
        print(f'head_dim {head_dim}: causal {min(causal):.1f} ms, with key limits {min(limited):.1f} ms '
              f'(best of {ROUNDS} alternating rounds; all: {[round(x, 1) for x in causal]} / '
              f'{[round(x, 1) for x in limited]})', flush=True)


if __name__ == '__main__':
    main()
