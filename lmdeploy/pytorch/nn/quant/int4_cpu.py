"""torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``) for steps too small to keep a bf16 GEMM
busy: it reads a quarter of the bytes, which is what a batch-1 decode step is bound by. It runs on a 4-bit
copy of a bf16 weight (``decode_int4``), and on the grid of a 4-bit checkpoint (AWQ, GPTQ) as it is."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel

if TYPE_CHECKING:
    from lmdeploy.pytorch.nn.quant.w4a16 import Int4Grid

INT4_GROUP = 32
# Steps of more tokens run faster on bf16 weights: with the native GEMM, or with oneDNN's.
INT4_MAX_TOKENS_NATIVE_GEMM = 2
INT4_MAX_TOKENS_ONEDNN = 8


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as 4-bit codes on each group of 32 inputs' min/max grid (``(q - 8) * scale + zero``):
    the packed codes and ``scales_and_zeros [K / 32, N, 2]`` (bf16) of torch's int4 CPU kernel.

    A GGUF Q4_1 block spans exactly its min and max in 16 steps, so its grid comes back exactly.
    """
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((groups - low[..., None]) / scale[..., None]).round_().clamp_(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(out_features, in_features), 2)
    scales_and_zeros = torch.stack((scale.T, (low + 8 * scale).T), dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros


def grid_packed(grid: Int4Grid, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's grid (inputs in group order) as the int4 kernel's packed codes and
    ``scales_and_zeros [K / G, N, 2]`` in ``dtype`` (the activations'): ``q * s - o = (q - 8) * s + (8 * s - o)``."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(grid.codes.to(torch.int32).contiguous(), 2)
    scales = grid.scales.float()
    scales_and_zeros = torch.stack((scales, 8 * scales - grid.offsets), dim=-1).to(dtype)
    return packed, scales_and_zeros.contiguous()


class SmallStepInt4Kernel(LinearKernel):
    """Steps of at most ``small_step_rows`` tokens on the int4 kernel, larger ones on ``large`` (all steps
    without one). With ``order``, the weight's inputs are in that order (act-order checkpoints), and so
    are ``x``'s first."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, small_step_rows: int,
                 large: LinearKernel | None = None, group_size: int = INT4_GROUP, order: torch.Tensor | None = None):
        self.packed, self.scales_and_zeros = packed, scales_and_zeros
        self.small_step_rows = small_step_rows
        self.large, self.group_size, self.order = large, group_size, order

    @classmethod
    def of(cls, weight: torch.Tensor) -> SmallStepInt4Kernel | None:
        """The 4-bit copy of a bf16 CPU weight (without its kernel for larger steps); None for others."""
        if weight.dtype != torch.bfloat16 or weight.device.type != 'cpu' or weight.shape[1] % INT4_GROUP:
            return None
        rows = INT4_MAX_TOKENS_NATIVE_GEMM if cpu.bf16_gemm() else INT4_MAX_TOKENS_ONEDNN
        return cls(*int4_groups(weight), rows)

    @classmethod
    def of_grid(cls, grid: Int4Grid, dtype: torch.dtype) -> SmallStepInt4Kernel:
        """A checkpoint's 4-bit grid as it is, for activations in ``dtype`` (bf16), for steps of any size:
        dequantizing it on each call for a bf16 GEMM is slower at every size measured
        (``benchmark/w4_cpu.py``)."""
        grid, order = grid.in_group_order()
        return cls(*grid_packed(grid, dtype), 0, None, grid.group_size, order)

    def over(self, large: LinearKernel) -> SmallStepInt4Kernel:
        """This copy for small steps with ``large`` for the others."""
        return SmallStepInt4Kernel(self.packed, self.scales_and_zeros, self.small_step_rows, large,
                                   self.group_size, self.order)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.order is not None:
            x = x[:, self.order]
        if self.large is not None and x.shape[0] > self.small_step_rows:
            return self.large(x, bias)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return out if bias is None else out + bias

    def gate_up_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if self.large is None or x.shape[0] <= self.small_step_rows:
            return None
        return self.large.gate_up_silu(x, bias)

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return None if self.large is None else self.large.native_projection(bias)
