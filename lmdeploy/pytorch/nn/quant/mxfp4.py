"""MXFP4 checkpoints (gpt-oss): the experts' weights are OCP microscaling FP4, dequantized as they load.

A weight ``W [..., out, in]`` is stored as ``W_blocks [..., out, in / 32, 16]`` (uint8, two FP4 e2m1
codes a byte, the low nibble first) and ``W_scales [..., out, in / 32]`` (uint8 e8m0: each block of 32
is scaled by ``2 ** (scale - 127)``). Every other layer of such a checkpoint is dense.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from lmdeploy.pytorch.nn.quant.base import register_format
from lmdeploy.pytorch.nn.quant.dense import DenseFormat

if TYPE_CHECKING:
    from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

# the values of the 16 e2m1 codes: sign bit, two exponent bits, one mantissa bit
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SUFFIXES = ('_blocks', '_scales')


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks [..., G, 16]`` and ``scales [..., G]`` -> ``[..., G * 32]`` in ``dtype`` (exact for bf16 and
    fp32), one leading index at a time to bound the temporaries."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f'MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}')
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=dtype)
    flat_blocks, flat_scales, flat_out = blocks.flatten(0, -3), scales.flatten(0, -2), out.flatten(0, -2)
    for i in range(flat_out.shape[0]):
        codes = torch.stack((flat_blocks[i] & 0xF, flat_blocks[i] >> 4), dim=-1).flatten(-2).long()
        exponents = flat_scales[i].to(torch.int32)[:, None] - 127
        flat_out[i] = torch.ldexp(lut[codes], exponents).flatten().to(dtype)
    return out


@register_format('mxfp4')
class Mxfp4Format(DenseFormat):
    """Dense linear layers; the checkpoint's ``*_blocks``/``*_scales`` pairs (the experts) load as the dense
    tensor of the same name without the suffix, in the ``[..., in, out]`` layout of transformers' dense
    gpt-oss checkpoints."""

    @classmethod
    def from_config(cls, quantization_config: dict) -> Mxfp4Format:
        return cls()

    def convert_checkpoint(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            if not name.endswith(SUFFIXES):
                yield name, tensor
                continue
            stem, suffix = name[:-len(SUFFIXES[0])], name[-len(SUFFIXES[0]):]
            parts = pending.setdefault(stem, {})
            parts[suffix] = tensor if isinstance(tensor, torch.Tensor) else tensor.read((slice(None),))
            if len(parts) == 2:
                del pending[stem]
                yield stem, dequantize_mxfp4(parts['_blocks'], parts['_scales']).transpose(-1, -2)
        if pending:
            raise ValueError(f'MXFP4 tensors lack their blocks or scales: {sorted(pending)[:5]}')
