"""Small helpers shared by the Triton kernels."""
import torch
import triton
import triton.language as tl


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 for fp32 models (Triton's default would be TF32)."""
    return 'ieee' if dtype == torch.float32 else 'tf32'


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
