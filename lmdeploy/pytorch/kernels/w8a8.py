"""W8A8 linear layers: int8 weights with one fp32 scale per output channel, activations quantized per
token when they arrive. The torch version here is the reference of the native CPU kernel
(``kernels/cpu/linear_int8.cpp``) and of the Triton kernel (``kernels/cuda/w8a8.py``)."""
from __future__ import annotations

import torch


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as int8 rows and their fp32 scales ``[M, 1]``: ``x ≈ q * scale``, ``scale = amax / 127``
    (symmetric; an all-zero row gets scale 0)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # a true division (``127 / amax`` is ``amax.reciprocal() * 127`` in torch, rounded twice), as the kernels do
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div_(amax), torch.zeros_like(amax))
    q = (xf * inv).round_().clamp_(-127, 127).to(torch.int8)
    return q, amax / 127


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as int8 with one symmetric fp32 scale per output channel, ``[N, 1]``."""
    wf = weight.float()
    scale = (wf.abs().amax(-1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return (wf / scale).round_().clamp_(-127, 127).to(torch.int8), scale


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` in ``x.dtype`` with ``W = weight * scale`` (int8 ``[N, K]``, fp32 ``[N, 1]``) and
    ``x`` quantized per token; the int8 products are summed exactly (int32)."""
    shape = x.shape
    q, x_scale = quantize_per_token(x.reshape(-1, shape[-1]))
    acc = torch._int_mm(q, weight.t())
    out = acc.float() * x_scale * scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*shape[:-1], weight.shape[0])
