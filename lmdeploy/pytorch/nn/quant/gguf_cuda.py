"""GGUF Q6_K and Q8_0 layers on CUDA: the file's blocks retiled once at load for the Triton GEMMs of
``kernels/cuda/gguf_linear.py``, which dequantize each weight tile in registers (no dequantized copy, none made
per call). A tied token table (:class:`TritonBlocks`) is one such copy for the LM head's GEMM and the embedding's
lookups, Q4_K's as its 4-bit grid for the W4A16 GEMM."""
from __future__ import annotations

from abc import abstractmethod

import torch

from lmdeploy.pytorch.kernels.cuda.gguf_linear import Q6KExperts, Q8Experts, q6k_linear, q8_0_linear
from lmdeploy.pytorch.nn.quant.base import LinearKernel
from lmdeploy.pytorch.nn.quant.gguf_blocks import BLOCKS, q4_k_grid, q6_k_parts, q8_0_weight
from lmdeploy.pytorch.nn.quant.gguf_table import BlockTable
from lmdeploy.pytorch.nn.quant.w4a16 import Int4Grid
from lmdeploy.pytorch.nn.quant.w4a16_cuda import TritonW4A16Kernel, pack_inputs

PACK_ROWS = 4096  # rows retiled at a time: the intermediate codes take 4 bytes a weight


def pack_fields(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """``fields [..., F]`` (each below ``2 ** bits``, ``F * bits == 32``) as one int32 each row, field ``i`` at bit
    ``i * bits``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=fields.device)
    return (fields.to(torch.int32) << shifts).sum(dim=-1, dtype=torch.int32)


def unpack_fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_fields` undone: ``words [...]`` as their ``32 / bits`` fields ``[..., F]`` (int32)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return (words[..., None] >> shifts) & ((1 << bits) - 1)


def pack_q6k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, K / 256, 210]`` Q6_K blocks as ``q6k_linear`` reads them: ``ql int32 [N, K / 8]`` (per block, word
    ``j`` field ``i`` the low nibble of input ``32 i + j``), ``qh int32 [N, K / 16]`` (word ``j`` field ``r`` the
    top two bits of input ``16 r + j``), ``sc int8 [N, K / 16]`` and ``d fp16 [N, K / 256]``: the file's bits."""
    parts = [_pack_q6k_rows(rows) for rows in blocks.split(PACK_ROWS)]
    return tuple(torch.cat(part) for part in zip(*parts))


def _pack_q6k_rows(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, sc, d = q6_k_parts(blocks)
    n, num_blocks = d.shape
    per_block = codes.view(n, num_blocks, 256)
    ql = pack_fields((per_block & 15).view(n, num_blocks, 8, 32).transpose(2, 3), 4)
    qh = pack_fields((per_block >> 4).view(n, num_blocks, 16, 16).transpose(2, 3), 2)
    return ql.reshape(n, -1), qh.reshape(n, -1), sc.contiguous(), d.contiguous()


def pack_q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K / 32, 34]`` Q8_0 blocks as ``q8_0_linear`` reads them: int8 ``codes [N, K]``, fp16 ``d [N, K / 32]``."""
    codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(blocks.shape[0], -1)
    return codes, blocks[..., :2].contiguous().view(torch.float16)[..., 0]


class TritonBlocksKernel(LinearKernel):
    """A layer's GGUF blocks retiled once for a Triton GEMM, which also gives back rows of the weight."""

    @abstractmethod
    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids [n]`` of the weight, ``[n, K]`` in fp32: the file's weights exactly."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The tensors held."""


class TritonQ6KKernel(TritonBlocksKernel):
    """A Q6_K layer on the Triton Q6_K GEMM (0.82 bytes a weight, the file's weights exactly)."""

    def __init__(self, blocks: torch.Tensor):
        self.ql, self.qh, self.sc, self.d = pack_q6k(blocks)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = q6k_linear(x, self.ql, self.qh, self.sc, self.d)
        return out if bias is None else out + bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        d = self.d[ids]
        n, num_blocks = d.shape
        low = unpack_fields(self.ql[ids].view(n, num_blocks, 32), 4).transpose(2, 3)  # [n, blocks, 8, 32]
        high = unpack_fields(self.qh[ids].view(n, num_blocks, 16), 2).transpose(2, 3)  # [n, blocks, 16, 16]
        codes = (low.reshape(n, -1) | (high.reshape(n, -1) << 4)) - 32
        scales = d.float().repeat_interleave(16, dim=1) * self.sc[ids].float()
        return q8_0_weight(codes, scales)

    def tensors(self) -> list[torch.Tensor]:
        return [self.ql, self.qh, self.sc, self.d]


class TritonQ8Kernel(TritonBlocksKernel):
    """A Q8_0 layer on the Triton Q8_0 GEMM (1.06 bytes a weight, the file's weights exactly)."""

    def __init__(self, blocks: torch.Tensor):
        self.codes, self.d = pack_q8_0(blocks)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = q8_0_linear(x, self.codes, self.d)
        return out if bias is None else out + bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return q8_0_weight(self.codes[ids], self.d[ids].float())

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.d]


class TritonQ4KKernel(TritonW4A16Kernel, TritonBlocksKernel):
    """Q4_K blocks as their exact 4-bit grid (groups of 32) on the Triton W4A16 GEMM, as Q4_K layers run on CUDA:
    0.75 bytes a weight (the codes packed along the inputs, fp32 scales and offsets), retiled a slice at a time."""

    def __init__(self, blocks: torch.Tensor):
        grids = [q4_k_grid(rows) for rows in blocks.split(PACK_ROWS)]
        parts = [(pack_inputs(grid.codes), grid.scales, grid.offsets) for grid in grids]
        qweight, scales, offsets = (torch.cat(part, dim=1) for part in zip(*parts))
        super().__init__(qweight, scales, offsets, grids[0].group_size, None)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        codes = unpack_fields(self.qweight[:, ids].T, 4).reshape(ids.shape[0], -1)
        return Int4Grid(codes, self.scales[:, ids], self.offsets[:, ids], self.group_size).dequantize(torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        return [self.qweight, self.scales, self.offsets]


TRITON_KERNELS = {'Q6_K': TritonQ6KKernel, 'Q8_0': TritonQ8Kernel}
TABLE_KERNELS: dict[str, type[TritonBlocksKernel]] = {**TRITON_KERNELS, 'Q4_K': TritonQ4KKernel}


class TritonBlocks(BlockTable):
    """A token table where the Triton kernels run (CUDA; CPU tensors within
    :func:`~lmdeploy.pytorch.kernels.triton_on_cpu`): the blocks retiled once for their type's Triton GEMM (Q8_0,
    Q6_K; Q4_K's grid on the W4A16 GEMM), one copy for the LM head's logits at every step and the embedding's
    lookups, which dequantize the looked-up rows from it in fp32 (the file's weights exactly)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str):
        super().__init__(blocks.shape[0], blocks.shape[1] * BLOCKS[ggml_type][0])
        self.kernel = TABLE_KERNELS[ggml_type](blocks)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.kernel.rows(ids).to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.kernel(hidden, None)
        return logits.float() if hidden.device.type == 'cpu' else logits

    def tensors(self) -> list[torch.Tensor]:
        return self.kernel.tensors()


def stacked_block_experts(ggml_type: str, blocks: list[torch.Tensor]) -> Q6KExperts | Q8Experts:
    """Every expert's Q6_K or Q8_0 blocks of one projection, retiled (one expert at a time) and stacked."""
    if ggml_type == 'Q6_K':
        return Q6KExperts(*(torch.stack(part) for part in zip(*(pack_q6k(b) for b in blocks))))
    return Q8Experts(*(torch.stack(part) for part in zip(*(pack_q8_0(b) for b in blocks))))
