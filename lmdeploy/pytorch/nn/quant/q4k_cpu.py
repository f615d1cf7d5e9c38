"""GGUF Q4_K weights on the native int4 GEMV's codes with the file's own scales (``q4k_linear`` in
``kernels/cpu/linear_int4.cpp``): per block of 256 inputs an fp16 ``d`` and ``dmin`` and the 12 bytes packing
eight 6-bit ``sc`` and ``m``, ``W = q * d * sc - dmin * m`` per group of 32 inputs, exactly the file's weights
at 0.5625 bytes a weight, as in the file. A layer's or an expert's decode rows run on the GEMV; its prefill rows
dequantize the same copy for one bf16 GEMM (``kquant_dequantized_linear``; no other copy is kept), in the native
decoder stack too."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant import int4_cpu, q6k_cpu
from lmdeploy.pytorch.nn.quant.int4_cpu import INT4_TILE, NativeInt4Kernel, SmallStepInt4Kernel
from lmdeploy.pytorch.nn.quant.q6k_cpu import decode_rows_on_gemv, nibble_pairs
from lmdeploy.pytorch.weights.derived_cache import cached_derivation

Q4K_BLOCK, Q4K_BLOCK_BYTES = 256, 144


def k_scale_mins(d: torch.Tensor, dmin: torch.Tensor, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``d * sc`` and ``dmin * m`` ``[..., 8]`` of blocks from their fp16 ``d``, ``dmin`` ``[...]`` and the 12
    bytes packing eight 6-bit ``sc`` and ``m`` ``[..., 12]`` (Q4_K's and Q5_K's, as llama.cpp's get_scale_min_k4)."""
    packed = packed.long()
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat((low & 63, (extra & 15) | ((low >> 2) & 48)), dim=-1)
    m = torch.cat((high & 63, (extra >> 4) | ((high >> 2) & 48)), dim=-1)
    return d.float()[..., None] * sc, dmin.float()[..., None] * m


def pack_q4k(blocks: torch.Tensor, gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K ``blocks [..., N, K / 256, 144]`` (leading dimensions: experts) in ``q4k_linear``'s layout: the int4
    GEMV's ``packed [..., N/16, K/32, 8, 32]`` codes (byte ``2 * row + b`` of chunk ``c`` holds inputs ``2c + b``
    and ``16 + 2c + b`` of the group) and ``scales [..., N/16, K/256, 256]`` uint8, per tile of 16 rows and block:
    their 16 ``d`` (fp16), 16 ``dmin``, then the block's scale bytes 4..15, byte by byte, 16 rows each. With
    ``gate_up`` (gate then up rows) the tiles alternate gate and up. The codes are moved as 64-bit words and pairs of
    bytes, never one by one."""
    *lead, rows, num_blocks, _ = blocks.shape
    tiles = rows // INT4_TILE
    # a block's 256 codes: 4 chunks of 32 bytes, byte i holding inputs 64 c + i (low nibble) and 64 c + 32 + i;
    # each group of 32 inputs pairs bytes i and i + 16 of its chunk, 8 bytes (one word) at a time
    words = blocks.view(torch.int64)[..., 2:].unflatten(-1, (4, 2, 2))
    pairs = torch.stack(nibble_pairs(words[..., 0, :], words[..., 1, :]), dim=-2)  # [..., N, blocks, 4, 2, 2]
    # [..., tile, row, group, chunk] pairs of bytes, moved to [..., tile, group, chunk, row]
    pairs = pairs.view(torch.int16).view(*lead, tiles, INT4_TILE, num_blocks * 8, 8).movedim(-3, -1)
    head = blocks[..., :16].view(*lead, tiles, INT4_TILE, num_blocks, 16).transpose(-3, -2)
    fp16 = head.view(torch.int16)[..., :2].transpose(-1, -2)  # [..., tile, block, d / dmin, row]
    scale_bytes = head[..., 4:].transpose(-1, -2)  # [..., tile, block, byte, row]
    if gate_up:  # gate's and up's tiles alternate
        pairs, fp16, scale_bytes = (part.unflatten(len(lead), (2, tiles // 2)).transpose(len(lead), len(lead) + 1)
                                    for part in (pairs, fp16, scale_bytes))
    packed = pairs.contiguous().view(torch.uint8).view(*lead, tiles, num_blocks * 8, 8, 2 * INT4_TILE)
    scales = torch.cat((fp16.contiguous().view(torch.uint8).reshape(*lead, tiles, num_blocks, 64),
                        scale_bytes.reshape(*lead, tiles, num_blocks, 192)), dim=-1)
    return packed, scales


class Q4KGemv(NativeInt4Kernel):
    """The native GEMV on a Q4_K layer's codes and the file's scales (:func:`pack_q4k`) at every step size; a
    gate-and-up layer's tiles alternate gate and up rows, so that SiLU-and-mul runs in its epilogue."""

    kind = 'q4k'

    @classmethod
    def of_blocks(cls, blocks: torch.Tensor, gate_up: bool = False) -> Q4KGemv | None:
        """The kernel for CPU blocks where the GEMV was built and the rows fill its tiles; else None."""
        rows = 2 * INT4_TILE if gate_up else INT4_TILE
        if blocks.device.type != 'cpu' or cpu.int4_gemv() is None or blocks.shape[0] % rows:
            return None
        sources = (__file__, q6k_cpu.__file__, int4_cpu.__file__)  # pack_q4k's, nibble_pairs', INT4_TILE's
        return cls(*cached_derivation(f'q4k gemv gate_up={gate_up}', blocks, sources,
                                      lambda: pack_q4k(blocks, gate_up)), gate_up)

    def layer_kernel(self) -> SmallStepInt4Kernel:
        """A layer's or an expert's kernel on this copy (see
        :func:`~lmdeploy.pytorch.nn.quant.q6k_cpu.decode_rows_on_gemv`)."""
        return decode_rows_on_gemv('q4k', self, self.packed, self.scales, self.gate_up)
