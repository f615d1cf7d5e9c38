"""fp32 weights packed for the native fixed-order fp32 GEMM (``fp32_packed_linear``, AVX-512 or AVX2 with FMA): torch's
fp32 GEMM picks its kernel, and its order of summation, by the number of rows, so an fp32 model's logprobs changed in
their last bits with the batch; on the packed weight each output sums its inputs in input order whatever the number
of rows (docs/batch_invariance.md)."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel


PACKED_TILE = 16  # outputs a tile of the packed weight


class NativeFp32Kernel(LinearKernel):
    """The native fixed-order fp32 GEMM on its packed tiles ``[ceil(N / 16), K, 16]`` of a weight ``[N, K]``, on the
    instruction set ``isa`` (``'avx512'`` or ``'avx2'``, chosen at load: :func:`cpu.fp32_gemm_isa`)."""

    def __init__(self, packed: torch.Tensor, out_features: int, isa: str):
        self.packed, self.out_features, self.isa = packed, out_features, isa

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu.native().fp32_packed_linear(x, self.packed, self.out_features, bias, self.isa)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows ``ids`` (1-D), ``[len(ids), K]``, from the tiles: a table's lookups need no other copy."""
        return self.packed[ids // PACKED_TILE, :, ids % PACKED_TILE]


def native_fp32_kernel(weight: torch.Tensor) -> NativeFp32Kernel | None:
    """``weight [N, K]`` (fp32, on the CPU) packed for the native fp32 GEMM; None for another weight or where the
    GEMM is not built (neither AVX-512 nor AVX2 with FMA: torch's ``F.linear`` then, its rows' last bits depending on
    their number)."""
    gemm, isa = cpu.fp32_gemm(), cpu.fp32_gemm_isa()
    if gemm is None or weight.dtype != torch.float32 or weight.device.type != 'cpu' or weight.dim() != 2:
        return None
    return NativeFp32Kernel(gemm.pack_fp32_weight(weight.detach()), weight.shape[0], isa)
