"""GPTQ checkpoints (``quant_method: gptq``): ``qweight int32 [K / 8, N]`` holds eight inputs' 4-bit codes
per int32, ``qzeros int32 [K / G, N / 8]`` eight outputs' zero points, ``scales [K / G, N]``, and
``g_idx [K]`` the group of each input (act-order, ``desc_act``, checkpoints put inputs in any group).
AutoGPTQ's format (``checkpoint_format: gptq``, the default) stores each zero point minus one (so zero points
run from 1 to 16)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmdeploy.pytorch.nn.quant.base import Layout, new_parameter, register_format
from lmdeploy.pytorch.nn.quant.w4a16 import Int4GroupFormat, Int4Grid, unpack_int32

if TYPE_CHECKING:
    from lmdeploy.pytorch.nn.linear import Linear


@register_format('gptq')
class GptqFormat(Int4GroupFormat):
    """4-bit GPTQ, with or without act-order."""

    def __init__(self, group_size: int, desc_act: bool, zero_offset: int):
        super().__init__(group_size)
        self.desc_act, self.zero_offset = desc_act, zero_offset

    @classmethod
    def from_config(cls, config: dict) -> GptqFormat:
        bits, group_size = config.get('bits'), int(config.get('group_size', 128))
        checkpoint_format = config.get('checkpoint_format', 'gptq')
        if bits != 4 or group_size <= 0 or checkpoint_format not in ('gptq', 'gptq_v2'):
            raise ValueError(f'GPTQ checkpoints of 4 bits in groups, format gptq or gptq_v2, are supported, not '
                             f'bits={bits} group_size={group_size} checkpoint_format={checkpoint_format}')
        return cls(group_size, bool(config.get('desc_act')), 1 if checkpoint_format == 'gptq' else 0)

    def params(self) -> tuple[str, ...]:
        return super().params() + (('g_idx',) if self.desc_act else ())

    def create_weights(self, layer: Linear) -> None:
        self.check_shape(layer)
        k, n, g = layer.in_features, layer.out_features, self.group_size
        if self.desc_act and getattr(getattr(layer, 'tp', None), 'world_size', 1) > 1:
            raise ValueError('GPTQ act-order (desc_act) checkpoints cannot split a layer\'s inputs over '
                             'tensor-parallel ranks')
        layer.qweight = new_parameter((k // 8, n), Layout(1, 0, 1, 8), torch.int32)
        layer.qzeros = new_parameter((k // g, n // 8), Layout(1, 0, 8, g), torch.int32)
        layer.scales = new_parameter((k // g, n), Layout(1, 0, 1, g))
        if self.desc_act:
            layer.g_idx = new_parameter((k,), Layout(None, 0), torch.int32)

    def unpack(self, layer: Linear) -> Int4Grid:
        zeros = unpack_int32(layer.qzeros, 1) + self.zero_offset
        return Int4Grid.of_zeros(unpack_int32(layer.qweight, 0).T, zeros, layer.scales, self.group_size,
                                 layer.g_idx if self.desc_act else None)
