"""RMSNorm with an optional fused residual add."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(norm(x + residual), x + residual)``; the sum is the next residual."""
    if residual is not None:
        x = x + residual
    return torch.rms_norm(x, weight.shape, weight, eps), x
