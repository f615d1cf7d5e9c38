"""RMSNorm with an optional fused residual add."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(norm(x + residual), x + residual)``; the sum is the next residual.

    The statistics are computed in fp32, as transformers does.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype), x
