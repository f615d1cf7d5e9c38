"""Small helpers shared by the Triton kernels."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 for fp32 models (Triton's default would be TF32)."""
    return 'ieee' if dtype == torch.float32 else 'tf32'


def key_bound(sliding_window: int | None, attention_chunk: int | None) -> tuple[int, int]:
    """The ``(bound, BOUND)`` arguments of :func:`first_key` for a layer's sliding window or attention chunk."""
    if sliding_window and attention_chunk:
        raise ValueError('attention takes a sliding window or an attention chunk, not both')
    if sliding_window:
        return sliding_window, 1
    return (attention_chunk, 2) if attention_chunk else (0, 0)


@triton.jit
def first_key(pos, bound, BOUND: tl.constexpr):
    """The first key position a query at ``pos`` attends to: with ``BOUND`` 1 the start of its sliding window of
    ``bound`` keys (not below 0), with 2 the start of its attention chunk of ``bound`` positions (0 for the
    position -1 of an empty sequence)."""
    if BOUND == 1:
        lo = tl.maximum(pos - bound + 1, 0)
    else:
        lo = tl.maximum(pos, 0) // bound * bound
    return lo


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)``, tanh from one exp (saturating to +-1 where exp overflows or vanishes)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def online_softmax_update(s, v, m, l, acc, PRECISION: tl.constexpr):
    """Folds one block of scores ``s [M, N]`` (``-inf`` where masked) and values ``v [N, D]`` into the running
    row max ``m``, denominator ``l`` and output ``acc``; returns them. Rows with no score yet stay empty."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float('-inf'), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@triton.jit
def prefill_rows(q_start_ptr, q_len_ptr, ctx_len_ptr, BLOCK_M: tl.constexpr):
    """A prefill program's place: program ``(m, seq, head)`` takes rows ``m * BLOCK_M + [0, BLOCK_M)`` of sequence
    ``seq``'s chunk of ``q_len`` rows, packed from row ``q_start`` after ``prefix`` cached tokens. Returns ``seq``,
    ``q_start``, ``q_len``, ``prefix``, the rows and, as ``seen``, the chunk rows up to the program's last one."""
    mblock = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    q_len = tl.load(q_len_ptr + seq).to(tl.int32)  # int32 positions: int64 score masks would cost registers
    q_start = tl.load(q_start_ptr + seq).to(tl.int64)
    prefix = tl.load(ctx_len_ptr + seq).to(tl.int32) - q_len
    rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    return seq, q_start, q_len, prefix, rows, tl.minimum(q_len, (mblock + 1) * BLOCK_M)


@triton.jit
def store_normalized_rows(row_ptrs, rmask, cols, cmask, acc, l):
    """``acc / l`` (zero rows where nothing was summed) into ``row_ptrs[:, None] + cols[None, :]``, where both
    masks allow."""
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(row_ptrs[:, None] + cols[None, :], out.to(row_ptrs.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])
