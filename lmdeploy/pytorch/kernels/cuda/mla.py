"""Multi-head latent attention over the paged latent cache in Triton (``kernels/mla.py`` is the reference).

Queries come absorbed into the latent space, so attention is multi-query: every head reads the same
cached rows, the latent ``[:v_dim]`` and the rotary key ``[v_dim:]``, and sums latents as values. Decode
programs take a group of heads of one sequence over one split of its pages (each row read once for the
group), then the split partials are merged by the paged decode attention's reduce kernel. As there, a
sequence's splits depend on nothing but the sequence (``kv_len``, block size, head count), so its output is
batch-invariant to the bit. Prefill programs take ``BLOCK_M`` queries of one head of one sequence and read its
context, the chunk included, from the cache.
An int8/int4 cache (``quant_policy`` 8/4) is filled by a kernel that quantizes each token's latent and rotary
key on its own, and the attention kernels dequantize the rows as they load them (codes to fp32, one fma, then
``q``'s dtype for ``tl.dot``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.cuda.decode_attention import (MAX_SPLITS, grid_splits, reduce_splits, sequence_splits,
                                                            split_partials, store_split_partial)
from lmdeploy.pytorch.kernels.cuda.kv_quant import load_dequantized, quantize_store
from lmdeploy.pytorch.kernels.cuda.utils import (dot_precision, online_softmax_update, prefill_rows,
                                                 store_normalized_rows)
from lmdeploy.pytorch.kernels.mla import fill_latent_cache as _fill_latent_cache_torch

__all__ = ['fill_latent_cache', 'mla_decode_attention', 'mla_prefill_attention']

# decode: tokens per split, per head: every head of a split writes 512 fp32 partials, so a split of 8 tokens a head
# (at least 256) writes about a fifth of the bf16 latent bytes it reads (576 a token), and a 32k context at 128 heads
# takes 32 splits x 8 head groups.
_SPLIT_TOKENS_PER_HEAD, _MIN_SPLIT_TOKENS = 8, 256
# decode: heads per program, cached rows per step, warps, stages. The [heads, 512] fp32 accumulators and a step's
# [rows, 576] cache tiles bound them: 64 heads spilled registers, 64-row steps in 3 stages filled shared memory.
_DECODE_LAUNCH = (16, 32, 4, 2)
# prefill: queries per program (BLOCK_M), cached rows per step, warps, stages; the [32, 512] fp32 accumulators
# over 8 warps: 64 rows spilled registers.
_PREFILL_LAUNCH = (32, 32, 8, 2)
# An int8/int4 cache's rows are dequantized in registers: 4 warps for decode used all 255 registers, and 32
# queries per prefill program spilled 584-632 bytes (sm_90, benchmark/triton_aot.py).
_DECODE_LAUNCH_QUANT = (16, 32, 8, 2)
_PREFILL_LAUNCH_QUANT = (16, 32, 8, 2)


@triton.jit
def _fill_latent_kernel(x_ptr, cache_ptr, sz_ptr, blocks_ptr, offsets_ptr, v_dim, rope_dim, block_size, stride_xt,
                        stride_cb, stride_cs, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BITS: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    block = tl.load(blocks_ptr + tok).to(tl.int64)
    offset = tl.load(offsets_ptr + tok).to(tl.int64)
    row = tl.arange(0, 1)  # quantize_store's rows: this token's one
    dst = (block * stride_cb + offset * stride_cs + row)[:, None]
    sz_dst = (block * block_size + offset) * 4 + row  # scales and zeros: [num_blocks, block_size, 2, 2], contiguous
    x = x_ptr + tok * stride_xt + row[:, None]
    quantize_store(x, cache_ptr, sz_ptr, tl.arange(0, BLOCK_L)[None, :], dst, sz_dst, row < 1, v_dim, BITS)
    quantize_store(x + v_dim, cache_ptr, sz_ptr, tl.arange(0, BLOCK_R)[None, :], dst + v_dim * BITS // 8, sz_dst + 2,
                   row < 1, rope_dim, BITS)


def fill_latent_cache(latent: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                      scales_zeros: torch.Tensor | None = None, quant_policy: int = 0, v_dim: int = 0) -> None:
    """Writes ``latent [T, D]`` (last dim contiguous); token ``i`` goes to ``(blocks[i], offsets[i])``: torch's own
    indexed write, or with ``quant_policy`` 8/4 a kernel that quantizes the latent ``[:v_dim]`` and the rotary key."""
    num_tokens, dim = latent.shape
    if not quant_policy:
        _fill_latent_cache_torch(latent, cache, blocks, offsets)
    elif num_tokens:
        _fill_latent_kernel[(num_tokens,)](latent, cache, scales_zeros, blocks, offsets, v_dim, dim - v_dim,
                                           cache.shape[1], latent.stride(0), cache.stride(0), cache.stride(1),
                                           BLOCK_L=triton.next_power_of_2(v_dim),
                                           BLOCK_R=triton.next_power_of_2(dim - v_dim), BITS=quant_policy)


@triton.jit
def _load_rows(cache_ptr, sz_ptr, rows, slots, valid, lat, rope, v_dim, rope_dim, dtype: tl.constexpr,
               BITS: tl.constexpr):
    """The latents ``[N, BLOCK_L]`` and rotary keys ``[N, BLOCK_R]`` of cache ``rows`` (their element offsets;
    ``slots`` their tokens' indices into the scales and zeros of a quantized cache), in ``dtype``, zero where
    invalid."""
    if BITS == 0:
        kv_lat = tl.load(cache_ptr + rows[:, None] + lat[None, :], mask=valid[:, None] & (lat < v_dim)[None, :],
                         other=0.0)
        kv_rope = tl.load(cache_ptr + rows[:, None] + v_dim + rope[None, :],
                          mask=valid[:, None] & (rope < rope_dim)[None, :], other=0.0)
    else:
        kv_lat = load_dequantized(cache_ptr, sz_ptr, rows[:, None], slots[:, None] * 2, valid[:, None], lat[None, :],
                                  (lat < v_dim)[None, :], v_dim, BITS).to(dtype)
        kv_rope = load_dequantized(cache_ptr, sz_ptr, rows[:, None] + v_dim * BITS // 8, slots[:, None] * 2 + 1,
                                   valid[:, None], rope[None, :], (rope < rope_dim)[None, :], rope_dim, BITS).to(dtype)
    return kv_lat, kv_rope


@triton.jit(do_not_specialize=['grid_splits', 'stride_tb'])
def _mla_decode_split_kernel(q_ptr, cache_ptr, sz_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr, scale,
                             num_heads, grid_splits, v_dim, rope_dim, stride_qb, stride_qh, stride_cb, stride_cs,
                             stride_tb, BLOCK_SIZE: tl.constexpr, SPLIT_PAGES: tl.constexpr,
                             MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                             BITS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    hmask = heads < num_heads
    kv_len = tl.load(lens_ptr + b)
    _, num_pages, per_split, num_splits = sequence_splits(kv_len, 0, 0, BLOCK_SIZE, SPLIT_PAGES, MAX_SPLITS)
    if split >= num_splits:
        return
    first = split * per_split
    last = tl.minimum(first + per_split, num_pages)
    lat = tl.arange(0, BLOCK_L)
    rope = tl.arange(0, BLOCK_R)
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + lat[None, :], mask=hmask[:, None] & (lat < v_dim)[None, :], other=0.0)
    q_rope = tl.load(q_rows + v_dim + rope[None, :], mask=hmask[:, None] & (rope < rope_dim)[None, :], other=0.0)
    n = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_H], float('-inf'), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    end = tl.minimum(last * BLOCK_SIZE, kv_len)
    for start in range(first * BLOCK_SIZE, end, BLOCK_N):  # BLOCK_N divides BLOCK_SIZE: a step stays in a page
        pos = start + n
        valid = pos < end
        block = tl.load(table_ptr + b * stride_tb + start // BLOCK_SIZE).to(tl.int64)
        kv_lat, kv_rope = _load_rows(cache_ptr, sz_ptr, block * stride_cb + (pos % BLOCK_SIZE) * stride_cs,
                                     block * BLOCK_SIZE + pos % BLOCK_SIZE, valid, lat, rope, v_dim, rope_dim,
                                     q_lat.dtype, BITS)
        s = tl.dot(q_lat, tl.trans(kv_lat), input_precision=PRECISION)
        s = (s + tl.dot(q_rope, tl.trans(kv_rope), input_precision=PRECISION)) * scale
        s = tl.where(valid[None, :], s, float('-inf'))
        m, l, acc = online_softmax_update(s, kv_lat, m, l, acc, PRECISION)
    store_split_partial(part_out_ptr, part_lse_ptr, (b * num_heads + heads) * grid_splits + split, hmask, lat, m, l,
                        acc, BLOCK_L)


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, kv_lens: torch.Tensor,
                         scale: float, v_dim: int, scales_zeros: torch.Tensor | None = None,
                         quant_policy: int = 0) -> torch.Tensor:
    """One new token per sequence: ``q [B, H, D]`` over ``kv_lens [B]`` tokens in ``block_table [B, N]``;
    returns ``[B, H, v_dim]``. The launch depends on shapes only (CUDA graphs)."""
    batch, num_heads, dim = q.shape
    block_size = cache.shape[1]
    block_h, block_n, num_warps, num_stages = _DECODE_LAUNCH_QUANT if quant_policy else _DECODE_LAUNCH
    head_groups = triton.cdiv(num_heads, block_h)
    split_pages = mla_split_pages(num_heads, block_size)
    splits = grid_splits(block_table.shape[1], block_size, split_pages)
    block_l = max(16, triton.next_power_of_2(v_dim))
    part_out, part_lse = split_partials(batch, num_heads, splits, block_l, q.device)
    _mla_decode_split_kernel[(batch, head_groups, splits)](
        q, cache, scales_zeros, block_table, kv_lens, part_out, part_lse, scale, num_heads, splits, v_dim, dim - v_dim,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0), BLOCK_SIZE=block_size,
        SPLIT_PAGES=split_pages, MAX_SPLITS=MAX_SPLITS, BLOCK_N=min(block_n, block_size), BLOCK_H=block_h,
        BLOCK_L=block_l, BLOCK_R=max(16, triton.next_power_of_2(dim - v_dim)), PRECISION=dot_precision(q.dtype),
        BITS=quant_policy, num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(batch, num_heads, v_dim, dtype=q.dtype, device=q.device)
    return reduce_splits(part_out, part_lse, out, kv_lens, block_size, split_pages)


def mla_split_pages(num_heads: int, block_size: int) -> int:
    """Pages per decode split: ``_SPLIT_TOKENS_PER_HEAD`` tokens a head, at least ``_MIN_SPLIT_TOKENS``, rounded
    up to a power of two (whole pages)."""
    tokens = triton.next_power_of_2(max(_MIN_SPLIT_TOKENS, _SPLIT_TOKENS_PER_HEAD * num_heads))
    return max(1, tokens // block_size)


@triton.jit
def _mla_prefill_kernel(q_ptr, cache_ptr, sz_ptr, out_ptr, table_ptr, q_start_ptr, q_len_ptr, ctx_len_ptr, scale, v_dim,
                        rope_dim, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_tb,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, BITS: tl.constexpr):
    seq, q_start, q_len, prefix, rows, seen = prefill_rows(q_start_ptr, q_len_ptr, ctx_len_ptr, BLOCK_M)
    if tl.program_id(0) * BLOCK_M >= q_len:
        return
    head = tl.program_id(2)
    rmask = rows < q_len
    lat = tl.arange(0, BLOCK_L)
    rope = tl.arange(0, BLOCK_R)
    q_rows = q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh
    q_lat = tl.load(q_rows + lat[None, :], mask=rmask[:, None] & (lat < v_dim)[None, :], other=0.0)
    q_rope = tl.load(q_rows + v_dim + rope[None, :], mask=rmask[:, None] & (rope < rope_dim)[None, :], other=0.0)
    m = tl.full([BLOCK_M], float('-inf'), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    n = tl.arange(0, BLOCK_N)
    context = prefix + seen  # what the program's last query sees
    for start in range(0, context, BLOCK_N):
        pos = start + n
        valid = pos < context
        block = tl.load(table_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_lat, kv_rope = _load_rows(cache_ptr, sz_ptr, block * stride_cb + (pos % BLOCK_SIZE) * stride_cs,
                                     block * BLOCK_SIZE + pos % BLOCK_SIZE, valid, lat, rope, v_dim, rope_dim,
                                     q_lat.dtype, BITS)
        s = tl.dot(q_lat, tl.trans(kv_lat), input_precision=PRECISION)
        s = (s + tl.dot(q_rope, tl.trans(kv_rope), input_precision=PRECISION)) * scale
        s = tl.where(valid[None, :] & (pos[None, :] <= (prefix + rows)[:, None]), s, float('-inf'))
        m, l, acc = online_softmax_update(s, kv_lat, m, l, acc, PRECISION)
    store_normalized_rows(out_ptr + (q_start + rows) * stride_ot + head * stride_oh, rmask, lat, lat < v_dim, acc, l)


def mla_prefill_attention(q: torch.Tensor, latent: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                          q_start: torch.Tensor, q_len: torch.Tensor, ctx_len: torch.Tensor, max_q_len: int,
                          scale: float, v_dim: int, scales_zeros: torch.Tensor | None = None,
                          quant_policy: int = 0) -> torch.Tensor:
    """Causal attention of the packed chunks ``q [T, H, D]`` over their contexts in the cache (which already
    holds each chunk, so ``latent`` is not read); returns ``[T, H, v_dim]``."""
    num_tokens, num_heads, dim = q.shape
    out = torch.empty(num_tokens, num_heads, v_dim, dtype=q.dtype, device=q.device)
    block_m, block_n, num_warps, num_stages = _PREFILL_LAUNCH_QUANT if quant_policy else _PREFILL_LAUNCH
    grid = (triton.cdiv(max_q_len, block_m), q_len.shape[0], num_heads)
    _mla_prefill_kernel[grid](
        q, cache, scales_zeros, out, block_table, q_start, q_len, ctx_len, scale, v_dim, dim - v_dim, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1), block_table.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=cache.shape[1], BLOCK_L=max(16, triton.next_power_of_2(v_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(dim - v_dim)), PRECISION=dot_precision(q.dtype), BITS=quant_policy,
        num_warps=num_warps, num_stages=num_stages)
    return out
