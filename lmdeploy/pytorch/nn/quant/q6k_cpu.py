"""GGUF Q6_K weights on the native GEMV (``kernels/cpu/linear_q6k.cpp``) as the file holds them: 6-bit codes, an
int8 scale per 16 inputs and an fp16 ``d`` per 256, ``W = d * sc * (u - 32)``, 0.82 bytes a weight. The Q6_K
layers and output layer of a Q4_K_M file run their small steps on it, the file's weights exactly; a layer's larger
steps dequantize the same copy for one bf16 GEMM (no bf16 copy is kept)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel

Q6K_TILE, Q6K_GROUP, Q6K_BLOCK = 16, 16, 256
# The most rows of a step that a GGUF layer runs on its native GEMV, on a CPU with AMX and without: larger steps
# run faster dequantized for one bf16 GEMM (the GEMV's cost grows with the rows, the dequantizing does not).
# ``benchmark/kquant_rows_cpu.py`` (one thread, 2 TinyLlama-sized layers; the AMX Xeon as it is, and with oneDNN
# held to AVX512-BF16): the largest step at which the GEMV was not slower in either of two rounds, GEMV /
# dequantized at the next size measured: Q5_K 1.04-1.06 at 32 rows with AMX, 0.82-1.04 at 64 without; Q6_K
# 0.78-1.43 at 24, 1.01-1.02 at 48; Q8_0 (dequantized by torch) 0.88-1.15 at 96, 1.07-1.10 at 256. Q4_K from whole
# prefill steps of a Q4_K_M file (``benchmark/kquant_gguf_cpu.py``), where they disagreed: with AMX the GEMV
# 1.26-1.28x faster at 24 rows, dequantizing 1.23-1.24x at 48; without, the GEMV 1.08-1.11x faster at 96. See
# docs/engine.md, "GGUF K-quant GEMV bounds with and without AMX".
GEMV_MAX_ROWS = {'q4k': (32, 96), 'q5k': (24, 48), 'q6k': (16, 32), 'q8_0': (64, 192)}


def gemv_max_rows(kind: str) -> int:
    """The most rows of a step that a ``kind`` layer (``q4k``, ``q5k``, ``q6k``, ``q8_0``) runs on its GEMV on this
    CPU (see ``GEMV_MAX_ROWS``): oneDNN's bf16 GEMM, which larger steps run on, is several times faster on AMX."""
    with_amx, without_amx = GEMV_MAX_ROWS[kind]
    return with_amx if cpu.onednn_amx() else without_amx


def pack_q6k(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``u [N, K]`` (0..63), int8 ``sc [N, K / 16]`` and fp16 ``d [N, K / 256]`` in ``q6k_linear``'s layout
    (see ``linear_q6k.cpp``): codes ``[N/16, K/16, 192]`` and scales ``[N/16, K/256, 288]``, both uint8."""
    out_features, in_features = codes.shape
    tiles, groups, blocks = out_features // Q6K_TILE, in_features // Q6K_GROUP, in_features // Q6K_BLOCK
    # [tile, group, pair, 2 * row + input of the pair]
    pairs = codes.view(tiles, Q6K_TILE, groups, 8, 2).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 8, 32)
    low, top = pairs & 15, pairs >> 4
    nibbles = low[:, :, :4] | (low[:, :, 4:] << 4)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8).view(1, 1, 1, 4, 1)
    tops = (top.view(tiles, groups, 2, 4, 32) << shifts).sum(3, dtype=torch.uint8)
    packed = torch.cat((nibbles, tops), dim=2).reshape(tiles, groups, 192).contiguous()
    sc = sc.view(tiles, Q6K_TILE, blocks, 16).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
    d = d.view(tiles, Q6K_TILE, blocks).transpose(1, 2).contiguous().view(torch.uint8)
    scales = torch.cat((sc.reshape(tiles, blocks, 256), d.reshape(tiles, blocks, 32)), dim=-1).contiguous()
    return packed, scales


class Q6KGemv(LinearKernel):
    """``x @ W.T`` on packed Q6_K weights (:func:`pack_q6k`): fp32 with ``fp32_out`` (an LM head's logits),
    else rounded to the activations' dtype, as the native decoder stack's ``q6k`` projection gives it."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, fp32_out: bool = False):
        self.packed, self.scales, self.fp32_out = packed, scales, fp32_out

    @classmethod
    def of(cls, codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor, fp32_out: bool = False) -> Q6KGemv | None:
        """The kernel for CPU weights where the GEMV was built and the rows fill its tiles; else None."""
        if codes.device.type != 'cpu' or cpu.q6k_gemv() is None or codes.shape[0] % Q6K_TILE:
            return None
        return cls(*pack_q6k(codes, sc, d), fp32_out)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = cpu.native().q6k_linear(x, self.packed, self.scales)
        out = out if self.fp32_out else out.to(x.dtype)
        return out if bias is None else out + bias

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return cpu.native().Projection(kind='q6k', weight=self.packed, scale=self.scales, bias=bias)


class Q6KKernel(Q6KGemv):
    """A Q6_K layer: steps of up to ``max_gemv_rows`` tokens (``gemv_max_rows('q6k')``) on the GEMV, larger ones
    dequantized from the same copy for ``F.linear`` (``q6k_dequantize``), 0.82 bytes a weight held."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, fp32_out: bool = False):
        super().__init__(packed, scales, fp32_out)
        self.max_gemv_rows = gemv_max_rows('q6k')

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.reshape(-1, x.shape[-1]).shape[0] > self.max_gemv_rows:
            return F.linear(x, cpu.native().q6k_dequantize(self.packed, self.scales).to(x.dtype), bias)
        return super().__call__(x, bias)

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return gemv_or_dequantized('q6k', self.packed, self.scales, bias, self.max_gemv_rows)


def gemv_or_dequantized(kind: str, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                        max_rows: int) -> object:
    """A K-quant layer as the native decoder stack's ``steps`` projection: up to ``max_rows`` rows on the ``kind``
    GEMV (``q4k``, ``q5k``, ``q6k``), more dequantized for the call (``{kind}_dequantized``), as its kernel runs
    them."""
    native = cpu.native()
    small = native.Projection(kind=kind, weight=codes, scale=scales, bias=bias)
    large = native.Projection(kind=f'{kind}_dequantized', weight=codes, scale=scales, bias=bias)
    return native.Projection(small=small, large=large, small_step_rows=max_rows)
