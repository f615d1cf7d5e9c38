"""bf16 weights packed for the CPU GEMMs: the native AVX512-BF16 kernel's panels where that beats oneDNN
(no AMX), else oneDNN's blocked layout, which saves oneDNN's per-call reorder (15-45% faster for
decode-sized batches). A gate-and-up layer's native panels alternate gate and up, so that SiLU-and-mul
runs in the GEMM's epilogue and the ``[T, 2 * I]`` product is never written out nor read back."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel


class NativeBf16Kernel(LinearKernel):
    """The native AVX512-BF16 GEMM on its packed panels; ``padding`` zero rows were added to fill the last panel
    (an LM head's vocabulary), whose outputs are cut off."""

    def __init__(self, panels: torch.Tensor, gate_up: bool, padding: int = 0):
        self.panels, self.gate_up, self.padding = panels, gate_up, padding

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.padding:
            return cpu.native().bf16_linear(x, self.panels, bias)
        bias = None if bias is None else F.pad(bias, (0, self.padding))
        return cpu.native().bf16_linear(x, self.panels, bias)[..., :-self.padding].contiguous()

    def gate_up_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return cpu.native().bf16_gate_up_silu(x, self.panels, bias) if self.gate_up else None

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return None if self.padding else cpu.native().Projection(kind='bf16', weight=self.panels, bias=bias)


class OneDnnKernel(LinearKernel):
    """oneDNN's GEMM on its blocked weight layout."""

    def __init__(self, blocked: torch.Tensor):
        self.blocked = blocked

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.blocked, bias, 'none', [], '')

    def router_projection(self, bias: torch.Tensor | None) -> object | None:
        native = cpu.native()
        return None if native is None else native.Projection(kind='onednn', weight=self.blocked, bias=bias)


def packed_cpu_kernel(weight: torch.Tensor, gate_up: bool = False, pad_rows: bool = False) -> LinearKernel | None:
    """``weight [N, K]`` packed for this CPU's fastest bf16 GEMM; None unless it is a bf16 CPU weight.
    With ``gate_up`` (gate then up rows) the native GEMM's panels alternate gate and up; with ``pad_rows`` an N
    that does not fill whole panels is padded for them (an LM head: oneDNN rounds a one-row call apart from more
    rows, so a prompt's logprobs would depend on its batch)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != 'cpu':
        return None
    native = native_bf16_kernel(weight, gate_up, pad_rows)
    if native is not None or not torch.backends.mkldnn.is_available():
        return native
    return OneDnnKernel(torch.ops.mkldnn._reorder_linear_weight(weight))


def native_bf16_kernel(weight: torch.Tensor, gate_up: bool = False,
                       pad_rows: bool = False) -> NativeBf16Kernel | None:
    """``weight [N, K]`` (bf16, on the CPU) packed for the native GEMM (``gate_up``, ``pad_rows``: see
    :func:`packed_cpu_kernel`); None where that GEMM is not the CPU's (not built, or AMX) or the shape does not fit
    its panels."""
    gemm = cpu.bf16_gemm()
    padding = -weight.shape[0] % 16 if pad_rows and not gate_up else 0
    if gemm is None or (weight.shape[0] + padding) % (32 if gate_up else 16) or weight.shape[1] % 2:
        return None
    pack = gemm.pack_bf16_gate_up if gate_up else gemm.pack_bf16_weight
    return NativeBf16Kernel(pack(F.pad(weight, (0, 0, 0, padding)) if padding else weight), gate_up, padding)
