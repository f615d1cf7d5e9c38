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
