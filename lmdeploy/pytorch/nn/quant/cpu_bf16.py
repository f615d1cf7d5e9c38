"""bf16 weights packed for the CPU GEMMs: the native AVX512-BF16 kernel's panels where that beats oneDNN
(no AMX), whatever the number of rows, else oneDNN's blocked layout, which saves oneDNN's per-call reorder (15-45%
faster for decode-sized batches). A gate-and-up layer's native panels alternate gate and up, so that SiLU-and-mul
runs in the GEMM's epilogue and the ``[T, 2 * I]`` product is never written out nor read back. The native panels
are kept in the derived-weight cache (``weights/derived_cache.py``): reading them back costs less than a third
of packing them, the weight's hash shared with its 4-bit grid's entry."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel
from lmdeploy.pytorch.weights.derived_cache import cached_derivation

# the code that lays the panels out: an edit of any of them repacks
_PACKING_SOURCES = (__file__, str(Path(cpu.__file__).parent / 'linear_bf16.cpp'),
                    str(Path(cpu.__file__).parent / 'common.h'))


class NativeBf16Kernel(LinearKernel):
    """The native AVX512-BF16 GEMM on its packed panels of a weight of ``out_features`` rows, which zero rows pad
    to whole panels where they do not fill them (a router of 8 experts, a one-output gate, an LM head's vocabulary;
    with ``gate_up`` the gate and the up each), and a zero column to an even number of inputs; the GEMM writes the
    first ``out_features`` outputs only (with ``gate_up``: half of them of each)."""

    def __init__(self, panels: torch.Tensor, gate_up: bool, out_features: int):
        self.panels, self.gate_up, self.out_features = panels, gate_up, out_features

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu.native().bf16_linear(x, self.panels, bias, self.out_features)

    def gate_up_silu(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        return cpu.native().bf16_gate_up_silu(x, self.panels, bias, self.out_features) if self.gate_up else None

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return cpu.native().Projection(kind='bf16', weight=self.panels, bias=bias, outputs=self.out_features)


class OneDnnKernel(LinearKernel):
    """oneDNN's GEMM on its blocked weight layout."""

    def __init__(self, blocked: torch.Tensor):
        self.blocked = blocked

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.blocked, bias, 'none', [], '')


def packed_cpu_kernel(weight: torch.Tensor, gate_up: bool = False) -> LinearKernel | None:
    """``weight [N, K]`` packed for this CPU's fastest bf16 GEMM; None unless it is a bf16 CPU weight.
    With ``gate_up`` (gate then up rows) the native GEMM's panels alternate gate and up."""
    if weight.dtype != torch.bfloat16 or weight.device.type != 'cpu':
        return None
    native = native_bf16_kernel(weight, gate_up)
    if native is not None or not torch.backends.mkldnn.is_available():
        return native
    return OneDnnKernel(torch.ops.mkldnn._reorder_linear_weight(weight))


def native_bf16_kernel(weight: torch.Tensor, gate_up: bool = False) -> NativeBf16Kernel | None:
    """``weight [N, K]`` (bf16, on the CPU) packed for the native GEMM, zero rows padding it to whole panels (with
    ``gate_up``, gate then up rows, the gate and the up each, their panels alternating for the SiLU-and-mul
    epilogue) and a zero column to an even K (the GEMM pads x's rows to match). Every shape runs it: oneDNN, the
    other GEMM, rounds some rows of a call apart from the row alone (a token's router logits, or its logprobs,
    would depend on its batch). None where that GEMM is not the CPU's (not built, or AMX)."""
    gemm = cpu.bf16_gemm()
    if gemm is None:
        return None
    rows, inputs = weight.shape

    def pack() -> tuple[torch.Tensor]:
        if gate_up:
            halves = F.pad(weight.reshape(2, rows // 2, inputs), (0, inputs % 2, 0, -(rows // 2) % 16))
            return (gemm.pack_bf16_gate_up(halves.reshape(-1, halves.shape[-1])), )
        padded = F.pad(weight, (0, inputs % 2, 0, -rows % 16)) if rows % 16 or inputs % 2 else weight
        return (gemm.pack_bf16_weight(padded), )

    panels, = cached_derivation(f'bf16 panels gate_up={gate_up}', weight, _PACKING_SOURCES, pack)
    return NativeBf16Kernel(panels, gate_up, rows)
