"""Single-thread CPU time of the native prefill and decode attention, causal and with an attention chunk (Llama 4's
chunked layers: a query sees only its own chunk of positions), rounds alternating.

    python benchmark/chunked_attention_cpu.py

A 2,048-token bf16 prompt in blocks of 64, 8 query and 4 KV heads of 128 (the AVX512-BF16 GEMM prefill path), the
decode of 4 such sequences (the AVX-512 row path), and a prefill chunk of 256 tokens ending a 16,384-token context
(chunked prefill of a long prompt: the GEMM path packs only the keys from the chunk's first query's bound); chunks of
256 and 1,024 positions.
"""
from __future__ import annotations

import torch
from key_limit_cpu import cpu_ms

from lmdeploy.pytorch.kernels import cpu

TOKENS, BLOCK, HEAD_DIM, SEQS, ROUNDS = 2048, 64, 128, 4, 3
LONG_CONTEXT, LONG_CHUNK = 16384, 256
CHUNKS = [None, 256, 1024]


def case():
    """Prefill arguments of one prompt and decode arguments of ``SEQS`` sequences over the same-sized caches."""
    g = torch.Generator().manual_seed(0)
    blocks = TOKENS // BLOCK * SEQS
    cache = [torch.randn(blocks, 4, BLOCK, HEAD_DIM, generator=g).bfloat16() for _ in range(2)]
    table = torch.randperm(blocks, generator=g).view(SEQS, -1)
    q = torch.randn(TOKENS, 8, HEAD_DIM, generator=g).bfloat16()
    fresh = torch.empty(TOKENS, 4, HEAD_DIM, dtype=torch.bfloat16)  # the chunk is read from the cache
    prefill = (q, fresh, fresh, *cache, table[:1], torch.tensor([0]), torch.tensor([TOKENS]), torch.tensor([TOKENS]),
               TOKENS, HEAD_DIM**-0.5)
    decode = (q[:SEQS], *cache, table, torch.full((SEQS,), TOKENS), HEAD_DIM**-0.5)
    return prefill, decode


def long_prefix_case():
    """Prefill arguments of the last ``LONG_CHUNK`` tokens of a ``LONG_CONTEXT``-token prompt."""
    g = torch.Generator().manual_seed(1)
    blocks = LONG_CONTEXT // BLOCK
    cache = [torch.randn(blocks, 4, BLOCK, HEAD_DIM, generator=g).bfloat16() for _ in range(2)]
    table = torch.randperm(blocks, generator=g).view(1, -1)
    q = torch.randn(LONG_CHUNK, 8, HEAD_DIM, generator=g).bfloat16()
    fresh = torch.empty(LONG_CHUNK, 4, HEAD_DIM, dtype=torch.bfloat16)
    return (q, fresh, fresh, *cache, table, torch.tensor([0]), torch.tensor([LONG_CHUNK]),
            torch.tensor([LONG_CONTEXT]), LONG_CHUNK, HEAD_DIM**-0.5)


def main() -> None:
    torch.set_num_threads(1)
    native = cpu.native()
    prefill, decode = case()
    long_prefix = long_prefix_case()
    times = {(kind, chunk): [] for kind in ('prefill', 'decode', 'long-prefix') for chunk in CHUNKS}
    for _ in range(ROUNDS):
        for chunk in CHUNKS:
            times['long-prefix', chunk].append(
                cpu_ms(lambda: native.paged_prefill_attention(*long_prefix, attention_chunk=chunk), 2))
            times['prefill', chunk].append(cpu_ms(lambda: native.paged_prefill_attention(*prefill,
                                                                                         attention_chunk=chunk), 2))
            times['decode', chunk].append(cpu_ms(lambda: native.paged_decode_attention(*decode,
                                                                                       attention_chunk=chunk), 50))
    for (kind, chunk), values in times.items():
        print(f'{kind} chunk {chunk}: {min(values):.2f} ms (best of {ROUNDS} alternating rounds; all: '
              f'{[round(x, 2) for x in values]})', flush=True)


if __name__ == '__main__':
    main()
