"""Paged decode attention in Triton: split-K partial softmax per (sequence, KV head, split), then a reduce.

Each program of the first kernel handles all query heads of one KV head (GQA), walking its split of
the sequence's blocks through the block table one page at a time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.cuda.utils import dot_precision

_TARGET_PROGRAMS = 528  # about 4 waves on a 132-SM GPU
_MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr, scale,
                         num_heads, group, head_dim, blocks_per_split,
                         stride_qb, stride_qh, stride_cb, stride_ch, stride_cs, stride_tb,
                         NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(lens_ptr + b)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(kv_len, BLOCK_SIZE))
    g = tl.arange(0, BLOCK_H)
    heads = kvh * group + g
    hmask = g < group
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    t = tl.arange(0, BLOCK_SIZE)
    m = tl.full([BLOCK_H], float('-inf'), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in range(first, last):
        block = tl.load(table_ptr + b * stride_tb + i).to(tl.int64)
        base = block * stride_cb + kvh * stride_ch
        k = tl.load(kc_ptr + base + t[None, :] * stride_cs + d[:, None], mask=dmask[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * scale
        s = tl.where((i * BLOCK_SIZE + t)[None, :] < kv_len, s, float('-inf'))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(vc_ptr + base + t[:, None] * stride_cs + d[None, :], mask=dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    has = l > 0
    l_safe = tl.where(has, l, 1.0)
    row = (b * num_heads + heads) * NUM_SPLITS + split
    tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], acc / l_safe[:, None],
             mask=hmask[:, None] & dmask[None, :])
    tl.store(part_lse_ptr + row, tl.where(has, m + tl.log(l_safe), float('-inf')), mask=hmask)


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, head_dim, stride_ob, stride_oh,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b * num_heads + h) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + row, mask=s < NUM_SPLITS, other=float('-inf'))
    w = tl.exp(lse - tl.max(lse, axis=0))
    parts = tl.load(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], mask=(s < NUM_SPLITS)[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


def _num_splits(batch: int, num_kv_heads: int, max_blocks: int) -> int:
    """Enough splits to fill the GPU, never more than there are blocks."""
    return max(1, min(triton.cdiv(_TARGET_PROGRAMS, batch * num_kv_heads), max_blocks, _MAX_SPLITS))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     kv_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One new token per sequence: ``q [B, H, D]`` over ``kv_lens [B]`` tokens in ``block_table [B, N]``."""
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    max_blocks = block_table.shape[1]
    group = num_heads // num_kv_heads
    splits = _num_splits(batch, num_kv_heads, max_blocks)
    block_d = triton.next_power_of_2(head_dim)
    part_out = torch.empty(batch, num_heads, splits, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_table, kv_lens, part_out, part_lse, scale, num_heads, group, head_dim,
        triton.cdiv(max_blocks, splits), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_table.stride(0), NUM_SPLITS=splits, BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, PRECISION=dot_precision(q.dtype))
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    _decode_reduce_kernel[(batch, num_heads)](part_out, part_lse, out, head_dim, out.stride(0), out.stride(1),
                                              NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
                                              BLOCK_D=block_d)
    return out
