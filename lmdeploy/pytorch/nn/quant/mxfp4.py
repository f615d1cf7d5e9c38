"""MXFP4 checkpoints (gpt-oss): the experts' weights in OCP microscaling FP4, kept so in memory.

A weight ``W [..., out, in]`` is stored as ``W_blocks [..., out, in / 32, 16]`` (uint8, two FP4 e2m1
codes a byte, the low nibble first) and ``W_scales [..., out, in / 32]`` (uint8 e8m0: each block of 32
is scaled by ``2 ** (scale - 127)``): 0.53 bytes a weight. Every other layer of such a checkpoint is dense.
GGUF files of gpt-oss (experts of ggml type MXFP4) are converted to this layout (``weights/gguf.py``).

The experts hold each projection's blocks and scales stacked over the experts (``gate_up_blocks``,
``gate_up_scales``, ``down_blocks``, ``down_scales``) and run, chosen at load (:class:`Mxfp4Format`):

- on CUDA, the Triton fused MoE, which dequantizes each weight tile in registers (``kernels/cuda/fused_moe.py``);
- elsewhere each routed expert in turn (:class:`Mxfp4Kernel`): its decode rows (small steps, see
  ``step_context.small_step``; outside an engine step, up to ``MXFP4_NATIVE_MAX_ROWS`` rows) on the native GEMV
  (``kernels/cpu/linear_mxfp4.cpp``, fp32 or bf16 activations as they are), its prefill rows on the projection
  dequantized for that call (``mxfp4_dequantized_linear``: bf16 into the native bf16 GEMM's panels in cache on CPUs
  with AVX512-BF16 and no AMX, else the whole weight and ``F.linear``); in the native decoder stack the same two
  paths, the GEMV in the stack of small steps (``Mxfp4Kernel.expert_projection``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import (ExpertKernel, Layout, LinearKernel, LinearOptions, WeightFormat,
                                            new_parameter, register_format)
from lmdeploy.pytorch.nn.quant.cpu_fp32 import native_fp32_kernel
from lmdeploy.pytorch.nn.quant.dense import DenseFormat
from lmdeploy.pytorch.nn.quant.w4a16 import PerExpertKernel
from lmdeploy.pytorch.step_context import small_step

if TYPE_CHECKING:
    from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
    from lmdeploy.pytorch.nn.linear import Linear
    from lmdeploy.pytorch.nn.moe import ExpertProjection, FusedExperts

# the values of the 16 e2m1 codes: sign bit, two exponent bits, one mantissa bit
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32
# Outside an engine step, an expert's share of a step up to this many rows runs on the GEMV, a larger one
# dequantized for F.linear: gpt-oss-20b's gate-and-up, 1 thread, 8.6 against 12.5 ms at 16 rows, 17.0 against
# 12.9 at 32 (``benchmark/moe_w4_cpu.py --mxfp4``).
MXFP4_NATIVE_MAX_ROWS = 16


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks [..., G, 16]`` and ``scales [..., G]`` -> ``[..., G * 32]`` in ``dtype`` (exact for bf16 and
    fp32), one leading index at a time to bound the temporaries."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f'MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}')
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=dtype, device=blocks.device)
    flat_blocks, flat_scales, flat_out = blocks.flatten(0, -3), scales.flatten(0, -2), out.flatten(0, -2)
    for i in range(flat_out.shape[0]):
        codes = torch.stack((flat_blocks[i] & 0xF, flat_blocks[i] >> 4), dim=-1).flatten(-2).long()
        exponents = flat_scales[i].to(torch.int32)[:, None] - 127
        flat_out[i] = torch.ldexp(lut[codes], exponents).flatten().to(dtype)
    return out


class Mxfp4Kernel(LinearKernel):
    """``x @ W.T`` on one projection's ``blocks [N, K / 32, 16]`` and ``scales [N, K / 32]``: small steps (see
    :func:`~lmdeploy.pytorch.step_context.small_step`) on the native GEMV where it is built (its fp32 sums rounded
    to ``x``'s dtype), larger ones dequantized for the call (``mxfp4_dequantized_linear``: in bf16 into the native
    bf16 GEMM's panels where that GEMM is the CPU's; fp32 packed for the fixed-order fp32 GEMM,
    ``native_fp32_kernel``), else ``F.linear`` on the weight dequantized to ``x``'s dtype."""

    small_step_rows = MXFP4_NATIVE_MAX_ROWS

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor):
        self.blocks, self.scales = blocks, scales

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """``W [N, K]`` in ``dtype`` (exact in fp32 and bf16)."""
        native = cpu.mxfp4_gemv() if self.blocks.device.type == 'cpu' else None
        if native is not None and dtype in (torch.float32, torch.bfloat16):
            return native.mxfp4_dequantize(self.blocks, self.scales, dtype)
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        native = cpu.mxfp4_gemv() if x.device.type == 'cpu' else None
        if native is None or x.dtype not in (torch.float32, torch.bfloat16):
            return F.linear(x, self.dequantize(x.dtype), bias)
        if not small_step(rows, MXFP4_NATIVE_MAX_ROWS):
            # fp32: torch's GEMM rounds 1 to 3 rows apart from more, the packed kernel's rows do not depend on it
            packed = native_fp32_kernel(self.dequantize(x.dtype)) if x.dtype == torch.float32 else None
            return native.mxfp4_dequantized_linear(x, self.blocks, self.scales, bias) if packed is None \
                else packed(x, bias)
        out = native.mxfp4_linear(x, self.blocks, self.scales).to(x.dtype)
        return out if bias is None else out + bias

    def expert_projection(self, bias: torch.Tensor | None, small_step: bool) -> object | None:
        """A path of :meth:`__call__` as a ``Projection`` of the native stack (``small_step``: the GEMV, else the
        dequantized weight); None where the native MXFP4 kernels are not built."""
        if cpu.mxfp4_gemv() is None or self.blocks.device.type != 'cpu':
            return None
        kind = 'mxfp4' if small_step else 'mxfp4_dequantized'
        return cpu.native().Projection(kind=kind, weight=self.blocks, scale=self.scales, bias=bias)


class Mxfp4Weights(WeightFormat):
    """One projection's weight as MXFP4 ``blocks`` and ``scales`` (the experts' projections of an MXFP4
    checkpoint)."""

    split_granule = MXFP4_BLOCK

    def create_weights(self, layer: Linear | ExpertProjection) -> None:
        if layer.in_features % MXFP4_BLOCK:
            raise ValueError(f'MXFP4 weights need inputs in blocks of {MXFP4_BLOCK}, not {layer.in_features} '
                             '(under tensor parallelism: each rank\'s share of the intermediate size)')
        groups = layer.in_features // MXFP4_BLOCK
        layout = Layout(0, 1, 1, MXFP4_BLOCK)
        layer.blocks = new_parameter((layer.out_features, groups, 16), layout, torch.uint8)
        layer.scales = new_parameter((layer.out_features, groups), layout, torch.uint8)

    def make_kernel(self, layer: Linear | ExpertProjection, options: LinearOptions) -> LinearKernel:
        return Mxfp4Kernel(layer.blocks, layer.scales)


@register_format('mxfp4')
class Mxfp4Format(DenseFormat):
    """Dense linear layers and MXFP4 experts (:class:`Mxfp4Weights`), run by :meth:`make_expert_kernel`'s
    kernel."""

    def __init__(self):
        self.experts_format = Mxfp4Weights()

    @classmethod
    def from_config(cls, quantization_config: dict) -> Mxfp4Format:
        return cls()

    def expert_format(self, proj: str) -> WeightFormat:
        return self.experts_format

    def make_expert_kernel(self, experts: FusedExperts, options: LinearOptions) -> ExpertKernel:
        """On CUDA with the model's dtype known, the Triton fused MoE on the blocks; otherwise each routed
        expert's projections on :class:`Mxfp4Kernel` (reading the parameters as they are at each call)."""
        if options.dtype is not None and experts.gate_up_blocks.device.type == 'cuda':
            return TritonMxfp4ExpertKernel(experts)
        return PerExpertKernel(experts.num_experts, lambda proj, expert: Mxfp4Kernel(
            getattr(experts, f'{proj}_blocks')[expert], getattr(experts, f'{proj}_scales')[expert]))


class TritonMxfp4ExpertKernel(ExpertKernel):
    """The Triton fused MoE on the experts' MXFP4 blocks (``Mxfp4Experts``), each weight tile dequantized in
    registers."""

    def __init__(self, experts: FusedExperts):
        from lmdeploy.pytorch.kernels.cuda.fused_moe import Mxfp4Experts
        self.gate_up, self.down = (Mxfp4Experts(getattr(experts, f'{proj}_blocks'), getattr(experts, f'{proj}_scales'))
                                   for proj in ('gate_up', 'down'))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                 activation: ClampedSwiGLU | None) -> torch.Tensor:
        from lmdeploy.pytorch.kernels.cuda.fused_moe import fused_moe
        return fused_moe(x, self.gate_up, self.down, topk_weights, topk_ids, gate_up_bias, down_bias, activation)
