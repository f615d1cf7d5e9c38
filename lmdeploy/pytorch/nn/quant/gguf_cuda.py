"""GGUF Q6_K and Q8_0 layers on CUDA: the file's blocks retiled once at load for the Triton GEMMs of
``kernels/cuda/gguf_linear.py``, which dequantize each weight tile in registers (no dequantized copy, none made
per call)."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.kernels.cuda.gguf_linear import Q6KExperts, Q8Experts, q6k_linear, q8_0_linear
from lmdeploy.pytorch.nn.quant.base import LinearKernel
from lmdeploy.pytorch.nn.quant.gguf_blocks import q6_k_parts

PACK_ROWS = 4096  # rows retiled at a time: the intermediate codes take 4 bytes a weight


def pack_fields(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """``fields [..., F]`` (each below ``2 ** bits``, ``F * bits == 32``) as one int32 each row, field ``i`` at bit
    ``i * bits``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=fields.device)
    return (fields.to(torch.int32) << shifts).sum(dim=-1, dtype=torch.int32)


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


class TritonQ6KKernel(LinearKernel):
    """A Q6_K layer on the Triton Q6_K GEMM (0.82 bytes a weight, the file's weights exactly)."""

    def __init__(self, blocks: torch.Tensor):
        self.ql, self.qh, self.sc, self.d = pack_q6k(blocks)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = q6k_linear(x, self.ql, self.qh, self.sc, self.d)
        return out if bias is None else out + bias


class TritonQ8Kernel(LinearKernel):
    """A Q8_0 layer on the Triton Q8_0 GEMM (1.06 bytes a weight, the file's weights exactly)."""

    def __init__(self, blocks: torch.Tensor):
        self.codes, self.d = pack_q8_0(blocks)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = q8_0_linear(x, self.codes, self.d)
        return out if bias is None else out + bias


TRITON_KERNELS = {'Q6_K': TritonQ6KKernel, 'Q8_0': TritonQ8Kernel}


def stacked_block_experts(ggml_type: str, blocks: list[torch.Tensor]) -> Q6KExperts | Q8Experts:
    """Every expert's Q6_K or Q8_0 blocks of one projection, retiled (one expert at a time) and stacked."""
    if ggml_type == 'Q6_K':
        return Q6KExperts(*(torch.stack(part) for part in zip(*(pack_q6k(b) for b in blocks))))
    return Q8Experts(*(torch.stack(part) for part in zip(*(pack_q8_0(b) for b in blocks))))
