"""Paged decode attention in Triton: split-K partial softmax per (sequence, KV head, split), then a reduce.

Each program of the first kernel handles all query heads of one KV head (GQA) over one split of its
sequence's pages, ``PAGES`` pages per loop step. The launch grid depends only on shapes (batch, KV
heads, block-table width), so decode steps can be captured in CUDA graphs: each program derives its
split's pages from its own sequence's ``kv_len``, so a short sequence in a wide block table still
spreads over every split, and a split left without pages writes an empty partial (lse ``-inf``).
With a sliding window or an attention chunk the splits cover only the pages from the query's first key on;
soft-capping applies to each score, and the sinks join the denominator in the reduce.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.cuda.kv_quant import load_dequantized
from lmdeploy.pytorch.kernels.cuda.utils import dot_precision, first_key, key_bound, online_softmax_update, soft_cap


class DecodeConfig(NamedTuple):
    """Launch shape of the split kernel: ``splits`` per (sequence, KV head), ``pages`` per loop step."""
    splits: int
    pages: int
    num_warps: int
    num_stages: int


# (rows = batch * KV heads at most, target programs, split cap, pages per step, num_warps, num_stages);
# the last row takes every larger batch. Few rows are latency-bound: 8 programs per SM of a 132-SM GPU,
# up to 128 splits. Many rows stream long splits: 4 programs per SM, the earlier kernel's split policy
# (82-89% of HBM at batch 16-128, wall clock).
_DECODE_TABLE = (
    (64, 1056, 128, 1, 4, 3),
    (1 << 62, 528, 64, 1, 4, 3),
)
_REDUCE_SPLITS = 64  # splits the reduce kernel merges per step at head dims up to 128, fewer at wider ones


@triton.jit
def store_split_partial(part_out_ptr, part_lse_ptr, row, hmask, d, m, l, acc, BLOCK_D: tl.constexpr):
    """Writes the ``row``s of a split's partial output (``acc / l``) and log-sum-exp, as the reduce reads them;
    a row without scores gets lse ``-inf``."""
    has = l > 0
    l_safe = tl.where(has, l, 1.0)
    tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], acc / l_safe[:, None], mask=hmask[:, None])
    tl.store(part_lse_ptr + row, tl.where(has, m + tl.log(l_safe), float('-inf')), mask=hmask)


@triton.jit(do_not_specialize=['num_splits', 'stride_tb'])
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
                         scale, bound, softcap, num_heads, group, num_splits,
                         stride_qb, stride_qh, stride_cb, stride_ch, stride_cs, stride_tb,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
                         PRECISION: tl.constexpr, BITS: tl.constexpr, BOUND: tl.constexpr,
                         SOFTCAP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(lens_ptr + b)
    num_pages = tl.cdiv(kv_len, BLOCK_SIZE)
    lo = 0  # the first position attended
    if BOUND:
        lo = first_key(kv_len - 1, bound, BOUND)
    per_split = tl.cdiv(num_pages - lo // BLOCK_SIZE, num_splits)
    first = lo // BLOCK_SIZE + split * per_split
    last = tl.minimum(first + per_split, num_pages)
    g = tl.arange(0, BLOCK_H)
    heads = kvh * group + g
    hmask = g < group
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    t = tl.arange(0, PAGES * BLOCK_SIZE)
    m = tl.full([BLOCK_H], float('-inf'), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for i in tl.range(first, last, PAGES, num_stages=NUM_STAGES):
        page = i + t // BLOCK_SIZE
        # The step's first page is always below `last` and holds a position from `lo` on, so every row of
        # `s` keeps a finite score.
        valid = (page < last) & (i * BLOCK_SIZE + t < kv_len) & (i * BLOCK_SIZE + t >= lo)
        block = tl.load(table_ptr + b * stride_tb + page, mask=page < last, other=0).to(tl.int64)
        rows = block * stride_cb + kvh * stride_ch + (t % BLOCK_SIZE) * stride_cs
        if BITS == 0:
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(vc_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        else:
            slots = (rows // stride_cs)[:, None]
            k = load_dequantized(kc_ptr, ksz_ptr, rows[:, None], slots, valid[:, None], d[None, :], dmask[None, :],
                                 HEAD_DIM, BITS).to(q.dtype)
            v = load_dequantized(vc_ptr, vsz_ptr, rows[:, None], slots, valid[:, None], d[None, :], dmask[None, :],
                                 HEAD_DIM, BITS).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if SOFTCAP:
            s = soft_cap(s, softcap)
        m, l, acc = online_softmax_update(tl.where(valid[None, :], s, float('-inf')), v, m, l, acc, PRECISION)
    store_split_partial(part_out_ptr, part_lse_ptr, (b * num_heads + heads) * num_splits + split, hmask, d, m, l, acc,
                        BLOCK_D)


@triton.jit(do_not_specialize=['num_splits'])
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, num_splits, stride_ob, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                          SINKS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    first_row = (b * tl.num_programs(1) + h) * num_splits
    d = tl.arange(0, BLOCK_D)
    m = tl.full([], float('-inf'), tl.float32)
    l = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < num_splits
        lse = tl.load(part_lse_ptr + first_row + s, mask=smask, other=float('-inf'))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        # A sequence with no tokens (a padded graph batch) has only empty splits: output zeros, not NaN.
        m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)
        w = tl.exp(lse - m_safe)
        alpha = tl.exp(m - m_safe)
        parts = tl.load(part_out_ptr + (first_row + s)[:, None] * BLOCK_D + d[None, :], mask=smask[:, None],
                        other=0.0)
        acc = acc * alpha + tl.sum(parts * w[:, None], axis=0)
        l = l * alpha + tl.sum(w, axis=0)
        m = m_new
    if SINKS:
        sink = tl.load(sinks_ptr + h)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        acc = acc * alpha
        l = l * alpha + tl.exp(sink - m_new)
    out = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def split_partials(batch: int, num_heads: int, splits: int, block_d: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty fp32 partial outputs ``[B, H, splits, block_d]`` and log-sum-exps ``[B, H, splits]``."""
    return (torch.empty(batch, num_heads, splits, block_d, dtype=torch.float32, device=device),
            torch.empty(batch, num_heads, splits, dtype=torch.float32, device=device))


def reduce_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merges the split partials into ``out [B, H, D]`` (the ``sinks [H]`` joining each denominator)."""
    batch, num_heads, splits, block_d = part_out.shape
    sinks = None if sinks is None else sinks.float().contiguous()
    block_s = _REDUCE_SPLITS * 128 // max(block_d, 128)  # a step's [splits, block_d] fp32 partials: 64 registers
    _decode_reduce_kernel[(batch, num_heads)](part_out, part_lse, sinks, out, splits, out.stride(0), out.stride(1),
                                              HEAD_DIM=out.shape[2], BLOCK_S=block_s, BLOCK_D=block_d,
                                              SINKS=sinks is not None)
    return out


def decode_config(batch: int, num_kv_heads: int, table_width: int, head_dim: int = 128) -> DecodeConfig:
    """The table's row for ``batch * num_kv_heads``: enough splits for the target program count,
    at most the row's cap and never more than the block table is wide. Head dims over 128 take twice the
    warps (at 256 a page's K/V tiles, dequantized from int8, spilled registers with 4)."""
    rows = batch * num_kv_heads
    _, target, cap, pages, num_warps, num_stages = next(r for r in _DECODE_TABLE if rows <= r[0])
    splits = max(1, min(triton.cdiv(target, rows), cap, table_width))
    return DecodeConfig(splits, pages, num_warps * 2 if head_dim > 128 else num_warps, num_stages)


def decode_attention_with(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                          kv_lens: torch.Tensor, scale: float, config: DecodeConfig,
                          k_scales_zeros: torch.Tensor | None = None, v_scales_zeros: torch.Tensor | None = None,
                          quant_policy: int = 0, sliding_window: int | None = None,
                          logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
                          attention_chunk: int | None = None) -> torch.Tensor:
    """``decode_attention`` with an explicit launch config (benchmarks and tests)."""
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    splits = config.splits
    block_d = triton.next_power_of_2(head_dim)
    part_out, part_lse = split_partials(batch, num_heads, splits, block_d, q.device)
    bound, bound_kind = key_bound(sliding_window, attention_chunk)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, k_scales_zeros, v_scales_zeros, block_table, kv_lens, part_out, part_lse, scale,
        bound, logit_softcap or 0.0, num_heads, num_heads // num_kv_heads, splits, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, PAGES=config.pages,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads // num_kv_heads)), BLOCK_D=block_d,
        NUM_STAGES=config.num_stages, PRECISION=dot_precision(q.dtype), BITS=quant_policy,
        BOUND=bound_kind, SOFTCAP=bool(logit_softcap), num_warps=config.num_warps)
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    return reduce_splits(part_out, part_lse, out, sinks)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     kv_lens: torch.Tensor, scale: float, k_scales_zeros: torch.Tensor | None = None,
                     v_scales_zeros: torch.Tensor | None = None, quant_policy: int = 0,
                     sliding_window: int | None = None, logit_softcap: float | None = None,
                     sinks: torch.Tensor | None = None, attention_chunk: int | None = None) -> torch.Tensor:
    """One new token per sequence: ``q [B, H, D]`` over ``kv_lens [B]`` tokens in ``block_table [B, N]``;
    an int8/int4 cache's rows are dequantized to ``q``'s dtype as they are loaded. The features are the
    torch twin's (``kernels/attention.py``)."""
    config = decode_config(q.shape[0], k_cache.shape[1], block_table.shape[1], q.shape[2])
    return decode_attention_with(q, k_cache, v_cache, block_table, kv_lens, scale, config, k_scales_zeros,
                                 v_scales_zeros, quant_policy, sliding_window, logit_softcap, sinks, attention_chunk)
