"""Varlen causal prefill attention in Triton: one launch for every prefill chunk of a step.

A program handles ``BLOCK_M`` queries of one sequence and one head. It first attends over the
sequence's cached prefix (``BLOCK_N`` keys of a page at a time, through its block-table row), then
causally over the chunk's fresh K/V, so chunked prefill and prefix-cache hits need no gather. With an
int8/int4 cache the chunk is read back from the cache too (dequantized, causally masked), so that a prompt attends
over the same values however its prefix was computed. With a sliding window or an attention chunk a program
starts at the first key its first query row sees (``first_key``); soft-capping applies to each score, and the
sinks join the denominator at the end. With key limits each row's keys end at its limit instead of its position, and a
program reads the chunk up to its rows' last limit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lmdeploy.pytorch.kernels.cuda.kv_quant import load_dequantized
from lmdeploy.pytorch.kernels.cuda.utils import (dot_precision, first_key, key_bound, online_softmax_update,
                                                 prefill_rows, soft_cap, store_normalized_rows)


@triton.jit
def _online_softmax_step(q, k, v, s_mask, m, l, acc, scale, softcap, PRECISION: tl.constexpr,
                         SOFTCAP: tl.constexpr):
    s = tl.dot(q, k, input_precision=PRECISION) * scale
    if SOFTCAP:
        s = soft_cap(s, softcap)
    return online_softmax_update(tl.where(s_mask, s, float('-inf')), v, m, l, acc, PRECISION)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, ksz_ptr, vsz_ptr, out_ptr, table_ptr, q_start_ptr,
                    q_len_ptr, ctx_len_ptr, sinks_ptr, key_limit_ptr, scale, bound, softcap, group, head_dim,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                    stride_cb, stride_ch, stride_cs, stride_tb,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                    PRECISION: tl.constexpr, BITS: tl.constexpr, BOUND: tl.constexpr, SOFTCAP: tl.constexpr,
                    SINKS: tl.constexpr, KEY_LIMIT: tl.constexpr):
    seq, q_start, q_len, prefix, rows, seen = prefill_rows(q_start_ptr, q_len_ptr, ctx_len_ptr, BLOCK_M)
    if tl.program_id(0) * BLOCK_M >= q_len:
        return
    head = tl.program_id(2)
    kvh = head // group
    rmask = rows < q_len
    last = rows  # each row's last key, as a chunk row
    if KEY_LIMIT:
        last = tl.load(key_limit_ptr + q_start + rows, mask=rmask, other=0).to(tl.int32) - prefix
        seen = tl.maximum(seen, tl.max(tl.where(rmask, last + 1, 0), axis=0))
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([BLOCK_M], float('-inf'), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    # the cached keys this program reads: the prefix, and with a quantized cache its chunk's keys up to its last row
    cached = prefix if BITS == 0 else prefix + seen
    lo = 0  # the first position the program's first row sees
    if BOUND:
        lo = first_key(prefix + tl.program_id(0) * BLOCK_M, bound, BOUND)
        row_first = first_key(prefix + rows, bound, BOUND)[:, None]  # each row's first key
    for i in range(lo // BLOCK_N, tl.cdiv(cached, BLOCK_N)):  # BLOCK_N divides BLOCK_SIZE: a step stays in a page
        block = tl.load(table_ptr + seq * stride_tb + i * BLOCK_N // BLOCK_SIZE).to(tl.int64)
        base = block * stride_cb + kvh * stride_ch
        t = i * BLOCK_N % BLOCK_SIZE + n  # the step's slots in its page
        pos = i * BLOCK_N + n
        if BITS == 0:
            k = tl.load(kc_ptr + base + t[None, :] * stride_cs + d[:, None], mask=dmask[:, None], other=0.0)
            v = tl.load(vc_ptr + base + t[:, None] * stride_cs + d[None, :], mask=dmask[None, :], other=0.0)
        else:
            kv_rows = base + t * stride_cs
            slots = kv_rows // stride_cs
            k = load_dequantized(kc_ptr, ksz_ptr, kv_rows[None, :], slots[None, :], (pos < cached)[None, :], d[:, None],
                                 dmask[:, None], head_dim, BITS).to(q.dtype)
            v = load_dequantized(vc_ptr, vsz_ptr, kv_rows[:, None], slots[:, None], (pos < cached)[:, None], d[None, :],
                                 dmask[None, :], head_dim, BITS).to(q.dtype)
        s_mask = rmask[:, None] & (pos < cached)[None, :] & (pos[None, :] <= prefix + last[:, None])
        if BOUND:
            s_mask &= pos[None, :] >= row_first
        m, l, acc = _online_softmax_step(q, k, v, s_mask, m, l, acc, scale, softcap, PRECISION, SOFTCAP)
    first_col = tl.maximum(lo - prefix, 0) // BLOCK_N * BLOCK_N
    for j in range(first_col, seen if BITS == 0 else 0, BLOCK_N):
        cols = j + n
        cmask = cols < q_len
        k = tl.load(k_ptr + (q_start + cols)[None, :] * stride_kt + kvh * stride_kh + d[:, None],
                    mask=cmask[None, :] & dmask[:, None], other=0.0)
        v = tl.load(v_ptr + (q_start + cols)[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                    mask=cmask[:, None] & dmask[None, :], other=0.0)
        s_mask = rmask[:, None] & cmask[None, :] & (cols[None, :] <= last[:, None])
        if BOUND:
            s_mask &= prefix + cols[None, :] >= row_first
        m, l, acc = _online_softmax_step(q, k, v, s_mask, m, l, acc, scale, softcap, PRECISION, SOFTCAP)
    if SINKS:
        sink = tl.load(sinks_ptr + head)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        acc = acc * alpha[:, None]
        l = l * alpha + tl.exp(sink - m_new)
    store_normalized_rows(out_ptr + (q_start + rows) * stride_ot + head * stride_oh, rmask, d, dmask, acc, l)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_table: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                      ctx_len: torch.Tensor, max_q_len: int, scale: float, k_scales_zeros: torch.Tensor | None = None,
                      v_scales_zeros: torch.Tensor | None = None, quant_policy: int = 0,
                      sliding_window: int | None = None, logit_softcap: float | None = None,
                      sinks: torch.Tensor | None = None, key_limit: torch.Tensor | None = None,
                      attention_chunk: int | None = None) -> torch.Tensor:
    """Causal attention of the packed chunks ``q [T, H, D]`` over their contexts; returns ``[T, H, D]``.

    Sequence ``s`` owns rows ``q_start[s]:q_start[s] + q_len[s]`` of ``q`` and of the fresh ``k, v``;
    its first ``ctx_len[s] - q_len[s]`` context tokens are cached in the blocks of ``block_table[s]``
    (all ``ctx_len[s]`` of them with an int8/int4 cache, which is read dequantized to ``q``'s dtype).
    The features are the torch twin's (``kernels/attention.py``).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m = 64 if max_q_len > 32 else 16
    # Gemma's 256: steps of 32 keys, 8 warps and 2 stages (64 keys in 3 stages took 224 KB of shared memory
    # and spilled registers at sm_90)
    wide = head_dim > 128
    block_n = min(32 if wide else 64, block_size)
    grid = (triton.cdiv(max_q_len, block_m), q_len.shape[0], num_heads)
    bound, bound_kind = key_bound(sliding_window, attention_chunk)
    _prefill_kernel[grid](q, k, v, k_cache, v_cache, k_scales_zeros, v_scales_zeros, out, block_table, q_start,
                          q_len, ctx_len, None if sinks is None else sinks.float().contiguous(),
                          None if key_limit is None else key_limit.contiguous(), scale,
                          bound, logit_softcap or 0.0, num_heads // num_kv_heads, head_dim, q.stride(0),
                          q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                          k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size,
                          BLOCK_D=triton.next_power_of_2(head_dim), PRECISION=dot_precision(q.dtype),
                          BITS=quant_policy, BOUND=bound_kind, SOFTCAP=bool(logit_softcap),
                          SINKS=sinks is not None, KEY_LIMIT=key_limit is not None, num_warps=8 if wide else 4, num_stages=2 if wide else 3)
    return out
