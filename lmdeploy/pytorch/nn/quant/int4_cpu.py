"""A 4-bit copy of a bf16 CPU weight for steps too small to keep the bf16 GEMM busy: torch's int4
kernel reads a quarter of the bytes, which is what a batch-1 decode step is bound by."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel

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


class SmallStepInt4Kernel(LinearKernel):
    """Steps of at most ``small_step_rows`` tokens on the 4-bit copy, larger ones on ``large``."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, small_step_rows: int,
                 large: LinearKernel | None = None):
        self.packed, self.scales_and_zeros = packed, scales_and_zeros
        self.small_step_rows = small_step_rows
        self.large = large

    @classmethod
    def of(cls, weight: torch.Tensor) -> SmallStepInt4Kernel | None:
        """The 4-bit copy of a bf16 CPU weight (without its kernel for larger steps); None for others."""
        if weight.dtype != torch.bfloat16 or weight.device.type != 'cpu' or weight.shape[1] % INT4_GROUP:
            return None
        rows = INT4_MAX_TOKENS_NATIVE_GEMM if cpu.bf16_gemm() else INT4_MAX_TOKENS_ONEDNN
        return cls(*int4_groups(weight), rows)

    def over(self, large: LinearKernel) -> SmallStepInt4Kernel:
        """This copy for small steps with ``large`` for the others."""
        return SmallStepInt4Kernel(self.packed, self.scales_and_zeros, self.small_step_rows, large)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] > self.small_step_rows:
            return self.large(x, bias)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, INT4_GROUP, self.scales_and_zeros)
        return out if bias is None else out + bias

    def gate_up_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return self.large.gate_up_silu(x, bias) if x.shape[0] > self.small_step_rows else None

    def native_panels(self) -> torch.Tensor | None:
        return self.large.native_panels()
