"""Weights in the model's dtype, as most checkpoints hold them; on the CPU laid out for the bf16 GEMMs or the
fixed-order fp32 GEMM, and with a 4-bit copy for small steps when asked."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu, fused_moe, triton_runs_on
from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
from lmdeploy.pytorch.nn.quant.base import (ExpertKernel, Layout, LinearKernel, LinearOptions, WeightFormat,
                                            new_parameter)
from lmdeploy.pytorch.nn.quant.cpu_bf16 import NativeBf16Kernel, native_bf16_kernel, packed_cpu_kernel
from lmdeploy.pytorch.nn.quant.cpu_fp32 import NativeFp32Kernel, native_fp32_kernel
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
from lmdeploy.pytorch.nn.quant.w4a16 import PerExpertKernel

if TYPE_CHECKING:
    from lmdeploy.pytorch.nn.linear import Linear
    from lmdeploy.pytorch.nn.moe import FusedExperts


class DenseKernel(LinearKernel):
    """``F.linear`` on the layer's ``weight`` parameter as it is at each call."""

    def __init__(self, layer: Linear):
        self.layer = layer

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.layer.weight, bias)


class DenseExpertKernel(ExpertKernel):
    """The fused-MoE kernel on the experts' ``gate_up`` and ``down`` parameters as they are at each call."""

    def __init__(self, experts: FusedExperts):
        self.experts = experts

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                 activation: ClampedSwiGLU | None) -> torch.Tensor:
        return fused_moe(x, self.experts.gate_up, self.experts.down, topk_weights, topk_ids, gate_up_bias, down_bias,
                         activation)

    def native_experts(self, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                       small_step: bool = False) -> dict[str, object] | None:
        return dict(gate_up=self.experts.gate_up, down=self.experts.down, gate_up_bias=gate_up_bias,
                    down_bias=down_bias)


class DenseFormat(WeightFormat):
    """``weight [out_features, in_features]`` in the model's dtype."""

    def create_weights(self, layer: Linear) -> None:
        layer.weight = new_parameter((layer.out_features, layer.in_features), Layout(0, 1))

    def make_kernel(self, layer: Linear, options: LinearOptions) -> LinearKernel:
        small = SmallStepInt4Kernel.of(layer.weight, layer.gate_up_panels) if options.small_step_int4 else None
        kernel = None
        if options.pack_cpu:
            kernel = packed_cpu_kernel(layer.weight, layer.gate_up_panels) or native_fp32_kernel(layer.weight)
        if kernel is None:
            kernel = DenseKernel(layer)
        else:
            layer.weight = None
        return kernel if small is None else small.over(kernel)

    def make_expert_kernel(self, experts: FusedExperts, options: LinearOptions) -> ExpertKernel:
        """The fused-MoE kernel on the stacked weights; CPU experts to be packed (``options.pack_cpu``) each on the
        native GEMM where it runs (:func:`native_bf16_experts`, :func:`native_fp32_experts`), unless the
        Triton kernels serve CPU tensors (:func:`triton_on_cpu`: the fused MoE then runs in Triton's interpreter)."""
        kernels = None
        if options.pack_cpu and experts.gate_up is not None and not triton_runs_on(experts.gate_up):
            kernels = native_bf16_experts(experts) or native_fp32_experts(experts)
        if kernels is None:
            return DenseExpertKernel(experts)
        experts.release()
        return PerExpertKernel(experts.num_experts, lambda proj, expert: kernels[proj][expert])


def native_bf16_experts(experts: FusedExperts) -> dict[str, list[NativeBf16Kernel]] | None:
    """Each expert's ``gate_up`` and ``down`` on the native bf16 GEMM (gate and up panels alternating for its
    SiLU-and-mul epilogue, unless the experts have another activation), whatever their shapes; None where that GEMM
    does not run. Its rows do not depend on how many share a call, where torch's bf16 GEMM rounds a one-row call
    (its GEMV) apart from more rows: a token's expert output then depends on the other tokens routed to that
    expert, which the batch decides. 2-3x faster than torch's at a few rows (docs/batch_invariance.md)."""
    if (experts.gate_up is None or experts.gate_up.dtype != torch.bfloat16 or experts.gate_up.device.type != 'cpu'
            or cpu.bf16_gemm() is None):
        return None
    fused = experts.activation is None
    return {'gate_up': [native_bf16_kernel(w, fused) for w in experts.gate_up],
            'down': [native_bf16_kernel(w) for w in experts.down]}


def native_fp32_experts(experts: FusedExperts) -> dict[str, list[NativeFp32Kernel]] | None:
    """Each expert's ``gate_up`` and ``down`` (fp32, on the CPU) on the native fixed-order fp32 GEMM, whose rows do
    not depend on how many reach the expert (torch's fp32 GEMM picks its kernel by it); None where it is not built."""
    if (experts.gate_up is None or experts.gate_up.dtype != torch.float32 or experts.gate_up.device.type != 'cpu'
            or cpu.fp32_gemm() is None):
        return None
    return {'gate_up': [native_fp32_kernel(w) for w in experts.gate_up],
            'down': [native_fp32_kernel(w) for w in experts.down]}
