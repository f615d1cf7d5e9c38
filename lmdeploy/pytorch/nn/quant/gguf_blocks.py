"""llama.cpp's block types as the engine reads them: Q8_0, Q4_K, Q5_K and Q6_K blocks (``uint8 [N, K / B, bytes]``)
unpacked to codes and scales, dequantized, and the CPU kernels that run them as they are (see
:mod:`lmdeploy.pytorch.nn.quant.gguf` for the formats that hold them)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel
from lmdeploy.pytorch.nn.quant.cpu_bf16 import packed_cpu_kernel
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
from lmdeploy.pytorch.nn.quant.q4k_cpu import k_scale_mins
from lmdeploy.pytorch.nn.quant.q5k_cpu import q5k_weight
from lmdeploy.pytorch.nn.quant.q6k_cpu import Q6K_TILE, Q6KGemv, decode_rows_on_gemv
from lmdeploy.pytorch.nn.quant.q8_cpu import Q8_TILE, pack_q8
from lmdeploy.pytorch.nn.quant.w4a16 import Int4Grid

# inputs and bytes per block
BLOCKS = {'Q8_0': (32, 34), 'Q4_K': (256, 144), 'Q5_K': (256, 176), 'Q6_K': (256, 210)}
# A Q6_K output layer's larger steps run on the bf16 GEMM of the LM head's table (kept), not dequantized per call.
Q6K_LM_HEAD_GEMV_MAX_ROWS = 16


def fp16_at(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of each block, as fp32."""
    return blocks[..., start:start + 2].contiguous().view(torch.float16)[..., 0].float()


def q8_0_unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K / 32, 34]`` Q8_0 blocks as int8 codes ``[N, K]`` and fp32 scales ``[N, K / 32]``."""
    codes = blocks[..., 2:].contiguous().view(torch.int8)
    return codes.reshape(blocks.shape[0], -1), fp16_at(blocks, 0)


def q6_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K / 256, 210]`` Q6_K blocks as codes ``u [N, K]`` (uint8, 0..63), ``sc [N, K / 16]`` (int8) and
    ``d [N, K / 256]`` (fp16): ``W = (u - 32) * d * sc``."""
    n, num_blocks = blocks.shape[:2]
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device)
    low = blocks[..., :128].view(n, num_blocks, 2, 1, 64) >> shifts[::2].view(2, 1)
    high = blocks[..., 128:192].view(n, num_blocks, 2, 1, 32) >> shifts.view(4, 1)
    codes = (low & 15).view(n, num_blocks, 8, 32) | ((high & 3).view(n, num_blocks, 8, 32) << 4)
    sc = blocks[..., 192:208].contiguous().view(torch.int8)
    d = blocks[..., 208:210].contiguous().view(torch.float16)[..., 0]
    return codes.view(n, -1), sc.reshape(n, -1), d


def q6_k_unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K / 256, 210]`` Q6_K blocks as int8 codes ``[N, K]`` (-32..31) and fp32 scales ``d * sc``
    ``[N, K / 16]`` (exact: an fp16 times an int8)."""
    codes, sc, d = q6_k_parts(blocks)
    scales = d.float().repeat_interleave(16, dim=1) * sc.float()
    return (codes.to(torch.int8) - 32), scales


def q8_0_weight(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` in fp32 (exact) from 8-bit codes ``[N, K]`` and their groups' scales ``[N, K / G]``
    (Q8_0's, Q6_K's)."""
    n = codes.shape[0]
    return codes.view(n, scales.shape[1], -1).float().mul_(scales[..., None]).view(n, -1)


def q4_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """``[N, K / 256, 144]`` Q4_K blocks' codes ``[N, K]`` (uint8, 0..15)."""
    n, num_blocks = blocks.shape[:2]
    qs = blocks[..., 16:].view(n, num_blocks, 4, 1, 32)
    return torch.cat((qs & 15, qs >> 4), dim=3).reshape(n, -1)


def q4_k_grid(blocks: torch.Tensor) -> Int4Grid:
    """``[N, K / 256, 144]`` Q4_K blocks as a 4-bit grid of groups of 32 inputs."""
    n = blocks.shape[0]
    scales, offsets = k_scale_mins(fp16_at(blocks, 0), fp16_at(blocks, 2), blocks[..., 4:16])
    scales, offsets = scales.view(n, -1), offsets.view(n, -1)
    return Int4Grid(q4_k_codes(blocks), scales.T.contiguous(), offsets.T.contiguous(), 32)


def dequantize_blocks(blocks: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """``W [N, K]`` in fp32 (exact) from ``[N, K / B, bytes]`` blocks of ``ggml_type``."""
    if ggml_type == 'Q4_K':
        return q4_k_grid(blocks).dequantize(torch.float32)
    if ggml_type == 'Q5_K':
        return q5k_weight(blocks)
    return q8_0_weight(*int8_unpack(blocks, ggml_type))


def int8_unpack(blocks: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 or Q6_K blocks as int8 codes ``[N, K]`` and fp32 scales per group (32 inputs, 16)."""
    return q8_0_unpack(blocks) if ggml_type == 'Q8_0' else q6_k_unpack(blocks)


class Q8Kernel(LinearKernel):
    """Q8_0 codes dequantized on each call to the activations' dtype for ``F.linear``."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        self.codes, self.scales = codes, scales

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, q8_0_weight(self.codes, self.scales).to(x.dtype), bias)


class Q8_0Gemv(LinearKernel):
    """The native 8-bit GEMV on Q8_0 blocks in its layout (:func:`pack_q8`) at every step size, its fp32 result
    rounded to the activations' dtype."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor):
        self.packed, self.scales = packed, scales

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = cpu.native().q8_linear(x, self.packed, self.scales).to(x.dtype)
        return out if bias is None else out + bias

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return cpu.native().Projection(kind='q8', weight=self.packed, scale=self.scales, bias=bias)

    @classmethod
    def of(cls, codes: torch.Tensor, scales: torch.Tensor) -> Q8_0Gemv | None:
        """The kernel for CPU codes and scales (:func:`int8_unpack`'s) where the GEMV was built and the rows fill its
        tiles; else None."""
        if codes.device.type != 'cpu' or cpu.q8_gemv() is None or codes.shape[0] % Q8_TILE:
            return None
        return cls(*pack_q8(codes, scales.half()))

    def layer_kernel(self) -> SmallStepInt4Kernel:
        """A layer's or an expert's kernel on this copy (see
        :func:`~lmdeploy.pytorch.nn.quant.q6k_cpu.decode_rows_on_gemv`)."""
        return decode_rows_on_gemv('q8_0', self, self.packed, self.scales)


def q6_k_lm_head_kernel(blocks: torch.Tensor, table: torch.Tensor) -> SmallStepInt4Kernel | None:
    """A Q6_K output layer in bf16 on the CPU: steps of up to ``Q6K_LM_HEAD_GEMV_MAX_ROWS`` tokens on the Q6_K GEMV over
    its blocks (the file's weights exactly, fp32 logits), larger ones on the bf16 GEMM of the LM head's ``table``;
    None where either is not built. Rows beyond a multiple of the GEMV's tiles are padded with zero weights (the
    LM head drops their logits)."""
    pad = -blocks.shape[0] % Q6K_TILE
    large = packed_cpu_kernel(table)
    small = Q6KGemv.of(F.pad(blocks, (0, 0, 0, 0, 0, pad)) if pad else blocks, fp32_out=True)
    return None if large is None or small is None else SmallStepInt4Kernel(small, Q6K_LM_HEAD_GEMV_MAX_ROWS, large)
