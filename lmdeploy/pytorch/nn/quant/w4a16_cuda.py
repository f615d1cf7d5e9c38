"""A 4-bit checkpoint's grid on CUDA, for the Triton W4A16 GEMM (``kernels/cuda/w4a16.py``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmdeploy.pytorch.nn.quant.base import LinearKernel

if TYPE_CHECKING:
    from lmdeploy.pytorch.nn.quant.w4a16 import Int4Grid


def pack_inputs(codes: torch.Tensor) -> torch.Tensor:
    """``codes [N, K]`` as ``[K / 8, N]`` int32, eight consecutive inputs per int32, lowest field first."""
    fields = codes.T.to(torch.int32).reshape(-1, 8, codes.shape[0])
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device).view(1, 8, 1)
    return (fields << shifts).sum(dim=1, dtype=torch.int32)


class TritonW4A16Kernel(LinearKernel):
    """The Triton W4A16 GEMM on the codes packed along the inputs; act-order checkpoints permute ``x``."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                 order: torch.Tensor | None):
        self.qweight, self.scales, self.offsets = qweight, scales, offsets
        self.group_size, self.order = group_size, order

    @classmethod
    def of(cls, grid: Int4Grid) -> TritonW4A16Kernel:
        grid, order = grid.in_group_order()
        return cls(pack_inputs(grid.codes), grid.scales, grid.offsets.contiguous(), grid.group_size, order)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from lmdeploy.pytorch.kernels.cuda.w4a16 import w4a16_linear
        if self.order is not None:
            x = x[:, self.order]
        out = w4a16_linear(x, self.qweight, self.scales, self.offsets, self.group_size)
        return out if bias is None else out + bias
