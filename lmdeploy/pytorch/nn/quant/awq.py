"""AWQ checkpoints (``quant_method: awq``, GEMM layout): ``qweight int32 [K, N / 8]`` and
``qzeros int32 [K / G, N / 8]`` hold eight outputs' 4-bit codes per int32 in AWQ's interleaved order,
``scales [K / G, N]``; ``W[n, k] = (q - zero) * scale``."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmdeploy.pytorch.nn.quant.base import Layout, new_parameter, register_format
from lmdeploy.pytorch.nn.quant.w4a16 import Int4GroupFormat, Int4Grid, unpack_int32

if TYPE_CHECKING:
    from lmdeploy.pytorch.nn.linear import Linear

# Output j of each group of eight sits in the int32's field AWQ_FIELD[j].
AWQ_FIELD = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """``[rows, N / 8]`` AWQ-packed int32 as ``[rows, N]`` codes."""
    fields = unpack_int32(packed, 1).view(packed.shape[0], -1, 8)
    return fields[..., AWQ_FIELD.to(packed.device)].reshape(packed.shape[0], -1)


@register_format('awq')
class AwqFormat(Int4GroupFormat):
    """4-bit AWQ, GEMM layout, with zero points."""

    @classmethod
    def from_config(cls, config: dict) -> AwqFormat:
        bits, version = config.get('bits', config.get('w_bit')), str(config.get('version', 'gemm')).lower()
        if bits != 4 or version != 'gemm' or not config.get('zero_point', True):
            raise ValueError(f'AWQ checkpoints of 4 bits, GEMM layout, with zero points are supported, not '
                             f'bits={bits} version={version} zero_point={config.get("zero_point")}')
        return cls(int(config.get('group_size', config.get('q_group_size', 128))))

    def create_weights(self, layer: Linear) -> None:
        self.check_shape(layer)
        k, n, g = layer.in_features, layer.out_features, self.group_size
        layer.qweight = new_parameter((k, n // 8), Layout(1, 0, 8, 1), torch.int32)
        layer.qzeros = new_parameter((k // g, n // 8), Layout(1, 0, 8, g), torch.int32)
        layer.scales = new_parameter((k // g, n), Layout(1, 0, 1, g))

    def unpack(self, layer: Linear) -> Int4Grid:
        return Int4Grid.of_zeros(unpack_awq(layer.qweight).T, unpack_awq(layer.qzeros), layer.scales, self.group_size)
