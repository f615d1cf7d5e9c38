"""An 8-bit copy of a one-row step's LM head (``kernels/cpu/linear_q8.cpp``): groups of 32 inputs with an
fp16 scale each, as GGUF's Q8_0, so it reads half the bytes of an fp16 copy. Taken only where it gives the
weights back to within bf16's precision: a table loaded from a Q8_0 file (the default model's), not one
that 8 bits would round. The copy (or the finding that there is none) is kept in the derived-weight cache,
``weights/derived_cache.py``."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.weights.derived_cache import cached_derivation

Q8_GROUP, Q8_TILE = 32, 16


def q8_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as int8 codes ``[N, K]`` (-127..127) and fp16 ``scale [N, K / 32]``, each group's
    scale its largest magnitude over 127 (Q8_0's)."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // Q8_GROUP, Q8_GROUP)
    scale = (groups.abs().amax(-1) / 127).half()
    safe = scale.float().clamp_min(torch.finfo(torch.float16).tiny)[..., None]
    codes = (groups / safe).round_().clamp_(-127, 127).to(torch.int8)
    return codes.view(out_features, in_features), scale


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales in ``q8_linear``'s layout: ``[N/16, K/32, 32, 16]`` int8, ``[N/16, K/32, 16]`` fp16."""
    out_features, in_features = codes.shape
    tiles, groups = out_features // Q8_TILE, in_features // Q8_GROUP
    packed = codes.view(tiles, Q8_TILE, groups, Q8_GROUP).permute(0, 2, 3, 1).contiguous()
    return packed, scale.view(tiles, Q8_TILE, groups).transpose(1, 2).contiguous()


def packed_q8_copy(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[()]:
    """:func:`pack_q8` of ``weight [N, K]``'s 8-bit grid, or ``()`` where the grid does not give every weight
    back within 2^-7 of its magnitude."""
    parts = []
    for rows in weight.split(4096):  # a slice at a time: fp32 copies of the whole table would be large
        codes, scale = q8_grid(rows)
        back = codes.float().view(scale.shape + (Q8_GROUP, )) * scale.float()[..., None]
        target = rows.float()
        if ((back.view_as(target) - target).abs() > target.abs() * 2**-7).any():
            return ()
        parts.append((codes, scale))
    return pack_q8(torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts]))


class Q8Gemv:
    """``x @ W.T`` in fp32 on the packed 8-bit copy."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor):
        self.packed, self.scales = packed, scales

    @classmethod
    def of(cls, weight: torch.Tensor) -> Q8Gemv | None:
        """The copy of a bf16 CPU ``weight`` when the native GEMV was built and the copy reproduces it to
        bf16's precision (every weight within 2^-7 of its magnitude: a
        Q8_0 table loaded in bf16 comes back within 2^-8 and a bit); else None."""
        if (weight.dtype != torch.bfloat16 or weight.device.type != 'cpu' or cpu.q8_gemv() is None
                or weight.shape[0] % Q8_TILE or weight.shape[1] % Q8_GROUP):
            return None
        packed = cached_derivation('q8 gemv', weight, __file__, lambda: packed_q8_copy(weight))
        return cls(*packed) if packed else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu.native().q8_linear(x, self.packed, self.scales)
