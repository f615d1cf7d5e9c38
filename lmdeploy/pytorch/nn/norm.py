"""RMSNorm and LayerNorm layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.kernels import rms_norm


class RMSNorm(nn.Module):
    """RMSNorm; given ``residual`` it adds it first and also returns the sum."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, summed = rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, summed)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint's weight ``w`` scales by ``1 + w`` (it starts at zeros)."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        self.weight.data.zero_()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        out, summed = rms_norm(x, self.scale(x.dtype), self.eps, residual)
        return out if residual is None else (out, summed)

    def scale(self, dtype: torch.dtype) -> torch.Tensor:
        """``1 + weight`` in ``dtype``: the weight of a plain RMSNorm that gives the same result."""
        return (self.weight.float() + 1.0).to(dtype)


class LayerNorm(RMSNorm):
    """LayerNorm computed in fp32: ``(x - mean) / std * weight``, plus ``bias`` where it has one (StarCoder2's; not
    Cohere's); given ``residual`` it adds it first and also returns the sum."""

    def __init__(self, size: int, eps: float, bias: bool = False):
        super().__init__(size, eps)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        summed = x if residual is None else x + residual
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(summed.float(), self.weight.shape, self.weight.float(), bias, self.eps).to(x.dtype)
        return out if residual is None else (out, summed)
