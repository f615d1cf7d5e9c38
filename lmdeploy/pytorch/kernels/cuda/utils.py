"""Small helpers shared by the Triton kernels."""
import torch


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full fp32 for fp32 models (Triton's default would be TF32)."""
    return 'ieee' if dtype == torch.float32 else 'tf32'
