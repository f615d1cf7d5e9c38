"""Paged decode attention in Triton: split-K partial softmax per (sequence, KV head, split), then a reduce.

Each program of the first kernel handles all query heads of one KV head (GQA) over one split of its
sequence's pages, ``PAGES`` pages per loop step. A sequence's splits depend on nothing but the sequence
(its ``kv_len``, its window or chunk, the block size and head dim): ``split_pages`` pages each from the
first attended page, more only past ``MAX_SPLITS`` splits. So its partials, and the order the reduce merges
them in, are the same in any batch: the output is batch-invariant to the bit. The launch grid depends only
on shapes (batch, KV heads, block-table width), so decode steps can be captured in CUDA graphs; a program
past its sequence's last split returns at once and the reduce reads only the sequence's own splits.
Soft-capping applies to each score, and the sinks join the denominator in the reduce.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.cuda.kv_quant import load_dequantized
from lmdeploy.pytorch.kernels.cuda.utils import dot_precision, first_key, key_bound, online_softmax_update, soft_cap


class DecodeConfig(NamedTuple):
    """Launch of the split kernel: ``split_pages`` pages per split, ``pages`` per loop step."""
    split_pages: int
    pages: int
    num_warps: int
    num_stages: int


# Tokens per split: at batch 1 and 32k context, 128 splits x 8 KV heads (8 programs per SM of a 132-SM GPU); at
# any batch a split's partials (4 query heads x 128 fp32 values and an lse) are 1.6% of the bf16 K/V it reads.
SPLIT_TOKENS = 256
# Past this many splits a sequence's splits grow instead (past 32k tokens at 256 a split): bounds the grid and
# the partial buffers of wide block tables.
MAX_SPLITS = 128
_REDUCE_SPLITS = 64  # splits the reduce kernel merges per step at head dims up to 128, fewer at wider ones


@triton.jit
def sequence_splits(kv_len, bound, BOUND: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT_PAGES: tl.constexpr,
                    MAX_SPLITS: tl.constexpr):
    """A sequence's splits, from its own ``kv_len`` and bound only: the first attended position ``lo``, the page
    count, pages per split (``SPLIT_PAGES``, more past ``MAX_SPLITS`` splits) and the split count (0 for an
    empty sequence). Split ``i`` takes pages ``lo // BLOCK_SIZE + i * per_split`` on."""
    lo = 0
    if BOUND:
        lo = first_key(kv_len - 1, bound, BOUND)
    num_pages = tl.cdiv(kv_len, BLOCK_SIZE)
    attended = num_pages - lo // BLOCK_SIZE
    per_split = tl.maximum(tl.cdiv(attended, MAX_SPLITS), SPLIT_PAGES)
    return lo, num_pages, per_split, tl.cdiv(attended, per_split)


@triton.jit
def store_split_partial(part_out_ptr, part_lse_ptr, row, hmask, d, m, l, acc, BLOCK_D: tl.constexpr):
    """Writes the ``row``s of a split's partial output (``acc / l``) and log-sum-exp, as the reduce reads them;
    a row without scores gets lse ``-inf``."""
    has = l > 0
    l_safe = tl.where(has, l, 1.0)
    tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], acc / l_safe[:, None], mask=hmask[:, None])
    tl.store(part_lse_ptr + row, tl.where(has, m + tl.log(l_safe), float('-inf')), mask=hmask)


@triton.jit(do_not_specialize=['grid_splits', 'stride_tb'])
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
                         scale, bound, softcap, num_heads, group, grid_splits,
                         stride_qb, stride_qh, stride_cb, stride_ch, stride_cs, stride_tb,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
                         SPLIT_PAGES: tl.constexpr, MAX_SPLITS: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
                         PRECISION: tl.constexpr, BITS: tl.constexpr, BOUND: tl.constexpr,
                         SOFTCAP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(lens_ptr + b)
    lo, num_pages, per_split, num_splits = sequence_splits(kv_len, bound, BOUND, BLOCK_SIZE, SPLIT_PAGES,
                                                           MAX_SPLITS)
    if split >= num_splits:
        return
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
    store_split_partial(part_out_ptr, part_lse_ptr, (b * num_heads + heads) * grid_splits + split, hmask, d, m, l,
                        acc, BLOCK_D)


@triton.jit(do_not_specialize=['grid_splits'])
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, lens_ptr, sinks_ptr, out_ptr, bound, grid_splits, stride_ob,
                          stride_oh, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT_PAGES: tl.constexpr,
                          MAX_SPLITS: tl.constexpr, BOUND: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    _, _, _, num_splits = sequence_splits(tl.load(lens_ptr + b), bound, BOUND, BLOCK_SIZE, SPLIT_PAGES, MAX_SPLITS)
    first_row = (b * tl.num_programs(1) + h) * grid_splits
    d = tl.arange(0, BLOCK_D)
    m = tl.full([], float('-inf'), tl.float32)
    l = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    # The sequence's own splits in steps of BLOCK_S, a step's tail masked to weight 0: the same sums in any grid.
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < num_splits
        lse = tl.load(part_lse_ptr + first_row + s, mask=smask, other=float('-inf'))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        w = tl.exp(lse - m_new)
        alpha = tl.exp(m - m_new)
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
    # A sequence with no tokens (a padded graph batch) has no splits: zeros, not NaN.
    out = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def grid_splits(table_width: int, block_size: int, split_pages: int, bound: int = 0, bound_kind: int = 0) -> int:
    """The launch grid's splits per (sequence, head): enough for the longest sequence the block table (or the
    window or chunk ``bound``) allows, at most ``MAX_SPLITS``."""
    pages = table_width if not bound_kind else min(table_width, triton.cdiv(bound, block_size) + 1)
    return max(1, min(triton.cdiv(pages, split_pages), MAX_SPLITS))


def split_partials(batch: int, num_heads: int, splits: int, block_d: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty fp32 partial outputs ``[B, H, splits, block_d]`` and log-sum-exps ``[B, H, splits]``."""
    return (torch.empty(batch, num_heads, splits, block_d, dtype=torch.float32, device=device),
            torch.empty(batch, num_heads, splits, dtype=torch.float32, device=device))


def reduce_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, kv_lens: torch.Tensor,
                  block_size: int, split_pages: int, bound: int = 0, bound_kind: int = 0,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Merges each sequence's split partials (its splits as ``sequence_splits`` gives them) into ``out [B, H, D]``,
    the ``sinks [H]`` joining each denominator."""
    batch, num_heads, splits, block_d = part_out.shape
    sinks = None if sinks is None else sinks.float().contiguous()
    block_s = _REDUCE_SPLITS * 128 // max(block_d, 128)  # a step's [splits, block_d] fp32 partials: 64 registers
    _decode_reduce_kernel[(batch, num_heads)](part_out, part_lse, kv_lens, sinks, out, bound, splits, out.stride(0),
                                              out.stride(1), HEAD_DIM=out.shape[2], BLOCK_SIZE=block_size,
                                              SPLIT_PAGES=split_pages, MAX_SPLITS=MAX_SPLITS, BOUND=bound_kind,
                                              BLOCK_S=block_s, BLOCK_D=block_d, SINKS=sinks is not None)
    return out


def decode_config(block_size: int, head_dim: int = 128) -> DecodeConfig:
    """``SPLIT_TOKENS`` a split (at least a page), one page a step, 4 warps (8 at head dims over 128: at 256 a
    page's K/V tiles, dequantized from int8, spilled registers with 4), 3 stages. Nothing depends on the batch."""
    return DecodeConfig(max(1, SPLIT_TOKENS // block_size), 1, 8 if head_dim > 128 else 4, 3)


def decode_attention_with(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                          kv_lens: torch.Tensor, scale: float, config: DecodeConfig,
                          k_scales_zeros: torch.Tensor | None = None, v_scales_zeros: torch.Tensor | None = None,
                          quant_policy: int = 0, sliding_window: int | None = None,
                          logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
                          attention_chunk: int | None = None) -> torch.Tensor:
    """``decode_attention`` with an explicit launch config (benchmarks and tests)."""
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    bound, bound_kind = key_bound(sliding_window, attention_chunk)
    splits = grid_splits(block_table.shape[1], block_size, config.split_pages, bound, bound_kind)
    block_d = triton.next_power_of_2(head_dim)
    part_out, part_lse = split_partials(batch, num_heads, splits, block_d, q.device)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, k_scales_zeros, v_scales_zeros, block_table, kv_lens, part_out, part_lse, scale,
        bound, logit_softcap or 0.0, num_heads, num_heads // num_kv_heads, splits, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, PAGES=config.pages, SPLIT_PAGES=config.split_pages, MAX_SPLITS=MAX_SPLITS,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads // num_kv_heads)), BLOCK_D=block_d,
        NUM_STAGES=config.num_stages, PRECISION=dot_precision(q.dtype), BITS=quant_policy,
        BOUND=bound_kind, SOFTCAP=bool(logit_softcap), num_warps=config.num_warps)
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    return reduce_splits(part_out, part_lse, out, kv_lens, block_size, config.split_pages, bound, bound_kind, sinks)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     kv_lens: torch.Tensor, scale: float, k_scales_zeros: torch.Tensor | None = None,
                     v_scales_zeros: torch.Tensor | None = None, quant_policy: int = 0,
                     sliding_window: int | None = None, logit_softcap: float | None = None,
                     sinks: torch.Tensor | None = None, attention_chunk: int | None = None) -> torch.Tensor:
    """One new token per sequence: ``q [B, H, D]`` over ``kv_lens [B]`` tokens in ``block_table [B, N]``;
    an int8/int4 cache's rows are dequantized to ``q``'s dtype as they are loaded. The features are the
    torch twin's (``kernels/attention.py``)."""
    config = decode_config(k_cache.shape[2], q.shape[2])
    return decode_attention_with(q, k_cache, v_cache, block_table, kv_lens, scale, config, k_scales_zeros,
                                 v_scales_zeros, quant_policy, sliding_window, logit_softcap, sinks, attention_chunk)
