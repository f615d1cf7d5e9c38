"""GGUF Q5_K weights on the native GEMV (``kernels/cpu/linear_q5k.cpp``) as the file holds them: per block of 256
inputs an fp16 ``d`` and ``dmin``, eight 6-bit ``sc`` and ``m`` (as Q4_K's) and 5-bit codes ``u``,
``W = u * d * sc - dmin * m`` per group of 32 inputs, 0.69 bytes a weight. Q5_K_M files and Qwen3.5's Q4_K_M
``attn_qkv`` run their decode rows (a layer's or an expert's) on it, the file's weights exactly; prefill rows
dequantize the same copy for one bf16 GEMM (no bf16 copy is kept), in the native decoder stack too."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
from lmdeploy.pytorch.nn.quant.q4k_cpu import k_scale_mins
from lmdeploy.pytorch.nn.quant.q6k_cpu import decode_rows_on_gemv

Q5K_TILE, Q5K_GROUP, Q5K_BLOCK = 16, 32, 256
# per tile of 16 rows and group of 32 inputs: 8 chunks of 32 nibble bytes, then 32 uint16 of fifth bits
_NIBBLE_BYTES, _CODE_BYTES = 256, 320


def q5k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """``[N, K / 256, 176]`` Q5_K blocks' codes ``u [N, K]`` (uint8, 0..31): input ``32 g + l`` of a block has its
    low 4 bits in ``qs`` (byte ``32 (g // 2) + l``, high nibble for odd ``g``), its fifth in bit ``g`` of ``qh[l]``."""
    n, num_blocks = blocks.shape[:2]
    qs = blocks[..., 48:].view(n, num_blocks, 4, 1, 32)
    low = torch.cat((qs & 15, qs >> 4), dim=3).view(n, num_blocks, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(8, 1)
    fifth = (blocks[..., 16:48].view(n, num_blocks, 1, 32) >> shifts) & 1
    return (low | (fifth << 4)).view(n, -1)


def q5k_weight(blocks: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` in fp32 (exact) from ``[N, K / 256, 176]`` Q5_K blocks."""
    n = blocks.shape[0]
    d, dmin = (blocks[..., start:start + 2].contiguous().view(torch.float16)[..., 0] for start in (0, 2))
    scales, mins = k_scale_mins(d, dmin, blocks[..., 4:16])
    codes = q5k_codes(blocks).view(n, -1, Q5K_GROUP).float()
    return (codes * scales.view(n, -1, 1) - mins.view(n, -1, 1)).view(n, -1)


def pack_q5k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_K ``blocks [N, K / 256, 176]`` in ``q5k_linear``'s layout (see ``linear_q5k.cpp``): codes
    ``[N/16, K/32, 320]`` and scales ``[N/16, K/256, 256]`` (per tile and block the 16 rows' ``d``, their ``dmin``,
    then the block's 12 scale bytes, 16 rows each), both uint8."""
    rows, num_blocks = blocks.shape[:2]
    tiles, groups = rows // Q5K_TILE, num_blocks * Q5K_BLOCK // Q5K_GROUP
    # [tile, group, chunk c, half h, 2 * row + input of the pair]: input 16 h + 2 c + p
    lanes = q5k_codes(blocks).view(tiles, Q5K_TILE, groups, 2, 8, 2).permute(0, 2, 4, 3, 1, 5)
    lanes = lanes.reshape(tiles, groups, 8, 2, 2 * Q5K_TILE)
    nibbles = (lanes[:, :, :, 0] & 15) | ((lanes[:, :, :, 1] & 15) << 4)
    bits = torch.arange(8, device=blocks.device).view(8, 1, 1) + torch.tensor([0, 8], device=blocks.device).view(2, 1)
    fifths = ((lanes >> 4).int() << bits).sum((2, 3), dtype=torch.int32).to(torch.int16)
    codes = torch.cat((nibbles.reshape(tiles, groups, _NIBBLE_BYTES), fifths.view(torch.uint8)), dim=-1)
    by_tile = blocks.view(tiles, Q5K_TILE, num_blocks, -1).transpose(1, 2)
    d, dmin = (by_tile[..., start:start + 2].flatten(-2) for start in (0, 2))
    scales = torch.cat((d, dmin, by_tile[..., 4:16].transpose(-1, -2).flatten(-2)), dim=-1)
    return codes.contiguous(), scales.contiguous()


def unpack_q5k(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` in fp32 (exact) from :func:`pack_q5k`'s codes and scales."""
    tiles, groups = codes.shape[:2]
    nibbles = codes[..., :_NIBBLE_BYTES].view(tiles, groups, 8, 1, 2 * Q5K_TILE)
    fifths = codes[..., _NIBBLE_BYTES:].contiguous().view(torch.int16).int().view(tiles, groups, 1, 1, 2 * Q5K_TILE)
    bits = torch.arange(8, device=codes.device).view(8, 1, 1) + torch.tensor([0, 8], device=codes.device).view(2, 1)
    low = torch.cat((nibbles & 15, nibbles >> 4), dim=3)
    lanes = low | (((fifths >> bits) & 1) << 4).to(torch.uint8)
    u = lanes.view(tiles, groups, 8, 2, Q5K_TILE, 2).permute(0, 4, 1, 3, 2, 5).reshape(tiles * Q5K_TILE, -1)
    num_blocks = scales.shape[1]
    d, dmin = (scales[..., start:start + 2 * Q5K_TILE].contiguous().view(torch.float16) for start in (0, 32))
    packed = scales[..., 64:].view(tiles, num_blocks, 12, Q5K_TILE).permute(0, 3, 1, 2)
    group_scales, mins = k_scale_mins(d.transpose(1, 2), dmin.transpose(1, 2), packed)
    n = tiles * Q5K_TILE
    weight = u.view(n, -1, Q5K_GROUP).float() * group_scales.reshape(n, -1, 1) - mins.reshape(n, -1, 1)
    return weight.view(n, -1)


class Q5KGemv(LinearKernel):
    """The native Q5_K GEMV on Q5_K blocks retiled (:func:`pack_q5k`) at every step size, its fp32 result rounded to
    the activations' dtype."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        self.codes, self.scales = codes, scales

    @classmethod
    def of(cls, blocks: torch.Tensor) -> Q5KGemv | None:
        """The kernel for CPU blocks where the GEMV was built and the rows fill its tiles; else None."""
        if blocks.device.type != 'cpu' or cpu.q5k_gemv() is None or blocks.shape[0] % Q5K_TILE:
            return None
        return cls(*pack_q5k(blocks))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = cpu.native().q5k_linear(x, self.codes, self.scales).to(x.dtype)
        return out if bias is None else out + bias

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return cpu.native().Projection(kind='q5k', weight=self.codes, scale=self.scales, bias=bias)

    def layer_kernel(self) -> SmallStepInt4Kernel:
        """A layer's or an expert's kernel on this copy (see
        :func:`~lmdeploy.pytorch.nn.quant.q6k_cpu.decode_rows_on_gemv`)."""
        return decode_rows_on_gemv('q5k', self, self.codes, self.scales)
