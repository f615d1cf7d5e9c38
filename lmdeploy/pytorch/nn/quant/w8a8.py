"""W8A8 checkpoints (``lmdeploy lite smooth_quant``; ``quant_method: smooth_quant``, LMDeploy's name): each
linear layer's ``weight`` in int8 with one fp32 ``scale [out, 1]`` per output channel, symmetric;
activations are quantized per token when they arrive. On the CPU the weight is packed for the native
AVX512-VNNI GEMM, which quantizes the activations in the same call; elsewhere (CUDA: Triton; CPUs without
VNNI: torch) the kernel reads the parameters as they are. On the CPU the LM head of such a model runs on int8
rows of its table too (quantized at load, as the projections are; the embedding keeps its own table)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lmdeploy.pytorch.kernels import cpu, w8a8_linear
from lmdeploy.pytorch.kernels.w8a8 import quantize_weight
from lmdeploy.pytorch.nn.quant.base import (Layout, LinearKernel, LinearOptions, WeightFormat, new_parameter,
                                            register_format)

if TYPE_CHECKING:
    from lmdeploy.pytorch.nn.linear import Linear


@dataclass
class Int8Rows:
    """int8 ``weight [N, K]`` and fp32 ``scale [N, 1]`` held outside a linear layer (an LM head's table)."""

    weight: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, table: torch.Tensor, rows_at_once: int = 4096) -> Int8Rows:
        """``table`` quantized as a checkpoint's projections are (:func:`quantize_weight`), a slice at a time:
        an fp32 copy of a whole vocabulary would be large."""
        parts = [quantize_weight(rows) for rows in table.split(rows_at_once)]
        return cls(torch.cat([w for w, _ in parts]), torch.cat([s for _, s in parts]))


class W8A8Kernel(LinearKernel):
    """:func:`~lmdeploy.pytorch.kernels.w8a8_linear` on the layer's ``weight`` and ``scale`` as they are
    at each call."""

    def __init__(self, layer: Linear | Int8Rows):
        self.layer = layer

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return w8a8_linear(x, self.layer.weight, self.layer.scale, bias)

    def router_projection(self, bias: torch.Tensor | None) -> object | None:
        native = cpu.native()
        if native is None:
            return None
        return native.Projection(kind='w8a8_torch', weight=self.layer.weight, scale=self.layer.scale, bias=bias)


class NativeW8A8Kernel(LinearKernel):
    """The native AVX512-VNNI GEMM on its packed weight; ``compensation`` is ``128 * sum_k W[n, k]`` (the
    kernel multiplies activations offset by 128 into unsigned bytes). With ``gate_up`` (gate then up rows)
    the panels alternate gate and up, so that SiLU-and-mul runs in the GEMM's epilogue."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, gate_up: bool = False):
        gemm = cpu.int8_gemm()
        self.packed = (gemm.pack_int8_gate_up if gate_up else gemm.pack_int8_weight)(weight)
        self.compensation = 128 * weight.sum(1, dtype=torch.int32)
        self.scale = scale.reshape(-1).float().contiguous()
        self.gate_up = gate_up

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gate_up:
            raise ValueError('a gate-and-up weight runs only as gate_up_silu')
        return cpu.native().int8_linear(x, self.packed, self.compensation, self.scale, bias)

    def gate_up_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        if not self.gate_up:
            return None
        return cpu.native().int8_gate_up_silu(x, self.packed, self.compensation, self.scale, bias)

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return cpu.native().Projection(kind='w8a8', weight=self.packed, compensation=self.compensation,
                                       scale=self.scale, bias=bias)


class FloatLogitsKernel(LinearKernel):
    """An LM head's W8A8 kernel, its activations widened to fp32 first (exact from bf16 or fp16, so the same
    codes) so that the logits come out in fp32."""

    def __init__(self, kernel: LinearKernel):
        self.kernel = kernel

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(x.float(), bias)


def _runs_native(weight: torch.Tensor, gate_up: bool = False) -> bool:
    return (weight.device.type == 'cpu' and cpu.int8_gemm() is not None
            and weight.shape[0] % (32 if gate_up else 16) == 0 and weight.shape[1] % 4 == 0)


@register_format('smooth_quant')
class W8A8Format(WeightFormat):
    """int8 ``weight [out, in]`` and fp32 ``scale [out, 1]``: ``W = weight * scale``."""

    @classmethod
    def from_config(cls, quantization_config: dict) -> W8A8Format:
        quant_dtype = quantization_config.get('quant_dtype', 'int8')
        if quant_dtype != 'int8':
            raise ValueError(f'smooth_quant checkpoints in {quant_dtype!r} are not supported (int8 only)')
        return cls()

    def create_weights(self, layer: Linear) -> None:
        layer.weight = new_parameter((layer.out_features, layer.in_features), Layout(0, 1), dtype=torch.int8)
        layer.scale = new_parameter((layer.out_features, 1), Layout(0, None), dtype=torch.float32)

    def make_kernel(self, layer: Linear, options: LinearOptions) -> LinearKernel:
        if not (options.pack_cpu and _runs_native(layer.weight, layer.gate_up_panels)):
            return W8A8Kernel(layer)
        kernel = NativeW8A8Kernel(layer.weight, layer.scale, layer.gate_up_panels)
        layer.weight = layer.scale = None
        return kernel

    def lm_head_kernel(self, table: torch.Tensor) -> LinearKernel | None:
        """On the CPU per-vocabulary-row int8 weights and per-token int8 activations, as in the projections: the
        LM head reads half the bytes of bf16 and runs on the int8 GEMM (native where it runs the projections,
        else the torch version, so that a CPU without VNNI gives the same tokens); elsewhere None."""
        if table.device.type != 'cpu':
            return None
        rows = Int8Rows.of(table)
        kernel = NativeW8A8Kernel(rows.weight, rows.scale) if _runs_native(rows.weight) else W8A8Kernel(rows)
        return FloatLogitsKernel(kernel)
