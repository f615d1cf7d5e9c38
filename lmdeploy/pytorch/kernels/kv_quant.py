"""KV-cache quantization (``quant_policy`` 8 and 4), the reference for the native and Triton kernels.

Each token's row of each KV head (``head_dim`` values) is quantized on its own, asymmetrically:
``scale = (max - min) / (2**bits - 1)`` (at least 1e-8), ``code = floor((x - min) / scale + 0.5)``
clamped to ``[0, 2**bits - 1]``, and ``x ~ code * scale + min``. A layer's cache then holds

- K and V codes, ``uint8 [num_blocks, H_kv, block_size, D]`` for int8 and ``[..., D // 2]`` for int4,
  where byte ``j`` holds dimension ``j`` in its low nibble and dimension ``j + D // 2`` in its high one;
- K and V scales and zero points, ``float32 [num_blocks, H_kv, block_size, 2]``: ``(scale, min)``.
"""
from __future__ import annotations

import torch

MIN_SCALE = 1e-8


def quantize_kv(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> ``(codes uint8 [..., D * bits // 8], scales_zeros float32 [..., 2])``."""
    x = x.float()
    low, high = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((high - low) / ((1 << bits) - 1)).clamp_min(MIN_SCALE)
    codes = torch.floor((x - low) * (1.0 / scale) + 0.5).clamp_(0, (1 << bits) - 1).to(torch.uint8)
    if bits == 4:
        half = codes.shape[-1] // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    return codes, torch.cat((scale, low), dim=-1)


def dequantize_kv(codes: torch.Tensor, scales_zeros: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """The values ``codes`` stand for, ``[..., D]`` in ``dtype`` (fp32 math, one rounding to ``dtype``)."""
    if bits == 4:
        codes = torch.cat((codes & 15, codes >> 4), dim=-1)
    return (codes.float() * scales_zeros[..., :1] + scales_zeros[..., 1:]).to(dtype)
