"""A 4-bit checkpoint's grids on CUDA: a linear layer's for the Triton W4A16 GEMM (``kernels/cuda/w4a16.py``),
the experts' for the Triton fused MoE (``kernels/cuda/fused_moe.py``)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
from lmdeploy.pytorch.kernels.cuda.fused_moe import Int4Experts, fused_moe
from lmdeploy.pytorch.kernels.cuda.gguf_linear import Q6KExperts, Q8Experts
from lmdeploy.pytorch.nn.quant.base import ExpertKernel, LinearKernel

if TYPE_CHECKING:
    from lmdeploy.pytorch.nn.moe import FusedExperts
    from lmdeploy.pytorch.nn.quant.w4a16 import Int4GroupFormat, Int4Grid


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


def stacked_experts(grids: Iterable[Int4Grid]) -> Int4Experts:
    """Every expert's grid of one projection (each unpacked in turn), its codes packed along the inputs."""
    parts = [(pack_inputs(grid.codes), grid.scales, grid.offsets, grid.g_idx, grid.group_size) for grid in grids]
    qweight, scales, offsets, g_idx, group_sizes = zip(*parts)
    return Int4Experts(torch.stack(qweight), torch.stack(scales), torch.stack(offsets).contiguous(), group_sizes[0],
                       None if g_idx[0] is None else torch.stack(g_idx).to(torch.int32))


class TritonInt4ExpertKernel(ExpertKernel):
    """The Triton fused MoE on the experts' 4-bit grids, dequantizing each weight tile in registers (either
    projection may instead be a GGUF layer's Q6_K or Q8_0 blocks, or dense, ``[E, N, K]`` in the model's dtype)."""

    def __init__(self, gate_up: Int4Experts | Q6KExperts | Q8Experts | torch.Tensor,
                 down: Int4Experts | Q6KExperts | Q8Experts | torch.Tensor):
        self.gate_up, self.down = gate_up, down

    @classmethod
    def of(cls, weight_format: Int4GroupFormat, experts: FusedExperts) -> TritonInt4ExpertKernel:
        return cls(*(stacked_experts(weight_format.unpack(experts.projection(proj, e))
                                     for e in range(experts.num_experts)) for proj in ('gate_up', 'down')))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                 activation: ClampedSwiGLU | None) -> torch.Tensor:
        return fused_moe(x, self.gate_up, self.down, topk_weights, topk_ids, gate_up_bias, down_bias, activation)
