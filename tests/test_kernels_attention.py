"""Triton paged decode and varlen prefill attention against their torch twins (interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, DTYPES

from lmdeploy.pytorch.kernels import attention
from lmdeploy.pytorch.kernels import cuda as triton_kernels

pytestmark = pytest.mark.triton
TOL = {torch.float32: 2e-3 if DEVICE == 'cuda' else 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
BLOCK_SIZE = 16


def paged_cache(lengths: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """Random K/V caches and a block table giving each sequence scattered blocks for ``lengths`` tokens."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table, used = [], 0
    for w in widths:
        table.append(perm[used:used + w] + [0] * (max(widths) - w))
        used += w
    shape = (num_blocks, num_kv_heads, BLOCK_SIZE, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(DEVICE, dtype) for _ in range(2))
    return k_cache, v_cache, torch.tensor(table, device=DEVICE)


def rand(*shape, dtype, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def assert_close(out, ref, dtype):
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('lengths,num_heads,num_kv_heads', [
    ([1, 37, 16, 90], 6, 2),  # ragged, GQA group of 3, partial last blocks: one block per split
    ([1100, 17, 250], 4, 4),  # 69 blocks in 44 splits: two blocks per split, empty splits
])
def test_decode_attention(dtype, lengths, num_heads, num_kv_heads):
    head_dim = 32
    k_cache, v_cache, table = paged_cache(lengths, num_kv_heads, head_dim, dtype)
    q = rand(len(lengths), num_heads, head_dim, dtype=dtype)
    kv_lens = torch.tensor(lengths, device=DEVICE)
    out = triton_kernels.decode_attention(q, k_cache, v_cache, table, kv_lens, 0.2)
    ref = attention.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, kv_lens, 0.2)
    assert_close(out, ref, dtype)


def test_decode_splits_cover_long_contexts():
    from lmdeploy.pytorch.kernels.cuda.decode_attention import _num_splits
    assert _num_splits(1, 8, 512) == 64 and _num_splits(64, 8, 512) == 2 and _num_splits(2, 2, 3) == 3


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('chunks', [
    [(5, 5), (20, 45), (1, 17), (16, 32)],  # (q_len, ctx_len): fresh, unaligned prefix, one token, aligned prefix
    [(70, 70), (3, 100)],  # a chunk longer than BLOCK_M
])
def test_prefill_attention(dtype, chunks):
    num_heads, num_kv_heads, head_dim = 4, 2, 24
    ctx_lens = [c for _, c in chunks]
    k_cache, v_cache, table = paged_cache(ctx_lens, num_kv_heads, head_dim, dtype, seed=2)
    q_lens = [n for n, _ in chunks]
    q_start = [sum(q_lens[:i]) for i in range(len(q_lens))]
    k = torch.empty(sum(q_lens), num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = torch.empty_like(k)
    for row, (start, n, c) in enumerate(zip(q_start, q_lens, ctx_lens)):
        blocks = table[row, :-(-c // BLOCK_SIZE)]
        k[start:start + n] = attention._gather_context(k_cache, blocks, c)[:, c - n:].transpose(0, 1)
        v[start:start + n] = attention._gather_context(v_cache, blocks, c)[:, c - n:].transpose(0, 1)
    q = rand(sum(q_lens), num_heads, head_dim, dtype=dtype, seed=3)
    args = [torch.tensor(x, device=DEVICE) for x in (q_start, q_lens, ctx_lens)]
    out = triton_kernels.prefill_attention(q, k, v, k_cache, v_cache, table, *args, max(q_lens), 0.3)
    ref = attention.prefill_attention(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), table,
                                      *args, max(q_lens), 0.3)
    assert_close(out, ref, dtype)
