"""GGUF Q6_K weights on the native GEMV (``kernels/cpu/linear_q6k.cpp``) as the file holds them: 6-bit codes, an
int8 scale per 16 inputs and an fp16 ``d`` per 256, ``W = d * sc * (u - 32)``, 0.82 bytes a weight. The Q6_K
layers and experts of a Q4_K_M file run their decode rows on it (its output layer its small steps), the file's
weights exactly; their prefill rows dequantize the same copy for one bf16 GEMM (no bf16 copy is kept). Here too what
the K-quant types share: their GEMVs' bounds and :func:`decode_rows_on_gemv`."""
from __future__ import annotations

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.base import LinearKernel
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
from lmdeploy.pytorch.weights.derived_cache import cached_derivation

Q6K_TILE, Q6K_GROUP, Q6K_BLOCK = 16, 16, 256
# The most rows of a step that a GGUF layer runs on its native GEMV, on a CPU with AMX and without: larger steps
# run faster dequantized for one bf16 GEMM (the GEMV's cost grows with the rows, the dequantizing does not).
# ``benchmark/kquant_rows_cpu.py`` (one thread, 2 TinyLlama-sized layers; the AMX Xeon as it is, and with oneDNN
# held to AVX512-BF16): the largest step at which the GEMV was not slower in either of two rounds, GEMV /
# dequantized at the next size measured: Q5_K 1.04-1.06 at 32 rows with AMX; Q6_K 0.78-1.43 at 24 with AMX; Q5_K
# and Q6_K without AMX on a real EPYC: 0.93-0.98 at 64, 1.05-1.11 at 96 (whole 64-token steps agree); Q8_0 without
# AMX (a real EPYC, since large steps dequantize into the native GEMM's panels; TinyLlama's, Gemma 3 270M's and
# Qwen2.5-1.5B's widths, three rounds) 0.90-1.10 at 48, 1.01-1.26 at 96, with AMX not measured since: 16 as Q4_K's,
# whose GEMV and dequantization cost about as much per weight. Q4_K from whole
# prefill steps of a Q4_K_M file (``benchmark/kquant_gguf_cpu.py``) since the dequantized weight goes to a reused
# scratch: with AMX a tie at 16 rows, dequantizing 1.4-1.6x faster at 24; without, a tie at 64, dequantizing
# 1.05-1.14x faster at 96. Q5_K with AMX likewise from a Q5_K_M file: within 4% at 16 rows, dequantizing 1.46-1.6x
# faster at 24. See docs/performance.md, "GGUF K-quant GEMV bounds with and without AMX" and "GGUF K-quant prefill: no
# fresh pages per call".
GEMV_MAX_ROWS = {'q4k': (16, 64), 'q5k': (16, 64), 'q6k': (16, 64), 'q8_0': (16, 32)}


def gemv_max_rows(kind: str) -> int:
    """The most rows of a step that a ``kind`` layer (``q4k``, ``q5k``, ``q6k``, ``q8_0``) runs on its GEMV on this
    CPU (see ``GEMV_MAX_ROWS``): oneDNN's bf16 GEMM, which larger steps run on, is several times faster on AMX."""
    with_amx, without_amx = GEMV_MAX_ROWS[kind]
    return with_amx if cpu.onednn_amx() else without_amx
# rows retiled at a time: a vocabulary-sized output layer's temporaries stay a few MB, not a GB beside the model
Q6K_PACK_ROWS = 4096


# bytes of a 64-bit word: its low nibbles
LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F


def nibble_pairs(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of 64-bit words ``first`` and ``second`` paired nibble by nibble: the low nibbles of ``first`` with those
    of ``second`` above them, and the high nibbles likewise (one byte of codes ``i`` and ``i + 8`` each)."""
    low = (first & LOW_NIBBLES) | ((second & LOW_NIBBLES) << 4)
    high = ((first >> 4) & LOW_NIBBLES) | (second & ~LOW_NIBBLES)
    return low, high


def pack_q6k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K ``blocks [..., N, K / 256, 210]`` (leading dimensions: experts) in ``q6k_linear``'s layout (see
    ``linear_q6k.cpp``): codes ``[..., N/16, K/16, 192]`` and scales ``[..., N/16, K/256, 288]``, both uint8. Per
    tile of 16 rows and group of 16 inputs, pairs ``p`` of inputs ``2p, 2p + 1`` as bytes ``2 * row + b``: the low
    nibbles of pairs ``p`` and ``p + 4`` in one byte (pairs 0..3), then the top two bits of pairs ``4q + s`` at bits
    ``2s`` (``q`` = 0, 1). The codes are moved as 64-bit words and pairs of bytes, never one by one."""
    *lead, rows, num_blocks, _ = blocks.shape
    tiles = rows // Q6K_TILE
    # ql: 2 halves of 64 bytes, byte m holding input 128 h + m (low nibble) and 128 h + 64 + m; a group of 16
    # inputs pairs bytes i and i + 8 of its 16, one word each (blocks of 210 bytes hold no aligned words: copied)
    words = blocks[..., :128].contiguous().view(torch.int64).unflatten(-1, (2, 4, 2))
    # [..., N, blocks, half, low / high nibbles, group of the half's 64 inputs, pair 0..3]
    nibbles = torch.stack(nibble_pairs(words[..., 0], words[..., 1]), dim=-2)[..., None].view(torch.int16)
    # qh: 2 halves of 32 bytes, byte l's bits 2s holding input 128 h + 32 s + l
    top_bits = blocks[..., 128:192].view(torch.int16).unflatten(-1, (2, 1, 2, 2, 4))  # [..., half, 1, 2, q, s]
    shifts = torch.arange(0, 8, 2, dtype=torch.int16, device=blocks.device).view(4, 1, 1, 1)
    top_bits = (top_bits >> shifts) & 0x0303  # [..., half, 32-input part, 16-input group of it, q, s]
    tops = top_bits[..., 0] | (top_bits[..., 1] << 2) | (top_bits[..., 2] << 4) | (top_bits[..., 3] << 6)
    groups = torch.cat((nibbles.flatten(-4, -2), tops.flatten(-4, -2)), dim=-1)  # [..., N, blocks, 16 groups, 6]
    # [..., tile, row, group, pair] pairs of bytes, moved to [..., tile, group, pair, row]
    groups = groups.view(*lead, tiles, Q6K_TILE, num_blocks * 16, 6).movedim(-3, -1)
    packed = groups.contiguous().view(torch.uint8).view(*lead, tiles, num_blocks * 16, 192)
    tiled = blocks.view(*lead, tiles, Q6K_TILE, num_blocks, 210)
    sc = tiled[..., 192:208].permute(*range(len(lead) + 1), -2, -1, -3)  # [..., tile, block, scale, row]
    d = tiled.view(torch.int16)[..., 104].transpose(-1, -2).contiguous().view(torch.uint8)  # [..., tile, block, 32]
    scales = torch.cat((sc.reshape(*lead, tiles, num_blocks, 256), d), dim=-1)
    return packed, scales


def pack_q6k_rows(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_q6k` of ``blocks [N, K / 256, 210]``, :data:`Q6K_PACK_ROWS` rows at a time."""
    packed, scales = zip(*(pack_q6k(rows) for rows in blocks.split(Q6K_PACK_ROWS)))
    return torch.cat(packed), torch.cat(scales)


class Q6KGemv(LinearKernel):
    """``x @ W.T`` on packed Q6_K weights (:func:`pack_q6k`): fp32 with ``fp32_out`` (an LM head's logits),
    else rounded to the activations' dtype, as the native decoder stack's ``q6k`` projection gives it."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, fp32_out: bool = False):
        self.packed, self.scales, self.fp32_out = packed, scales, fp32_out

    @classmethod
    def of(cls, blocks: torch.Tensor, fp32_out: bool = False) -> Q6KGemv | None:
        """The kernel for CPU blocks ``[N, K / 256, 210]`` where the GEMV was built and the rows fill its tiles; else
        None."""
        if blocks.device.type != 'cpu' or cpu.q6k_gemv() is None or blocks.shape[0] % Q6K_TILE:
            return None
        return cls(*cached_derivation('q6k gemv', blocks, __file__, lambda: pack_q6k_rows(blocks)), fp32_out)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = cpu.native().q6k_linear(x, self.packed, self.scales)
        out = out if self.fp32_out else out.to(x.dtype)
        return out if bias is None else out + bias

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return cpu.native().Projection(kind='q6k', weight=self.packed, scale=self.scales, bias=bias)

    def layer_kernel(self) -> SmallStepInt4Kernel:
        """A layer's or an expert's kernel on this copy (see :func:`decode_rows_on_gemv`)."""
        return decode_rows_on_gemv('q6k', self, self.packed, self.scales)


class KQuantDequantized(LinearKernel):
    """A K-quant layer's large steps: its GEMV's copy (``codes``, ``scales``) dequantized to bf16 for the call
    (``kquant_dequantized_linear``, ``kind`` one of ``GEMV_MAX_ROWS``'s: group by group into the native bf16 GEMM's
    panels in cache, every row's bits independent of the row count; with AMX into the thread's reused scratch for
    oneDNN's GEMM); with ``gate_up``, Q4_K's gate and up tiles alternate."""

    def __init__(self, kind: str, codes: torch.Tensor, scales: torch.Tensor, gate_up: bool = False):
        self.kind, self.codes, self.scales, self.gate_up = kind, codes, scales, gate_up

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu.native().kquant_dequantized_linear(x, self.kind, self.codes, self.scales, bias, self.gate_up)

    def native_projection(self, bias: torch.Tensor | None) -> object | None:
        return cpu.native().Projection(kind=f'{PROJECTION_KINDS[self.kind]}_dequantized', weight=self.codes,
                                       scale=self.scales, bias=bias)


# the native decoder stack's projection kind of each GEMV
PROJECTION_KINDS = {'q4k': 'q4k', 'q5k': 'q5k', 'q6k': 'q6k', 'q8_0': 'q8'}


def decode_rows_on_gemv(kind: str, gemv: LinearKernel, codes: torch.Tensor, scales: torch.Tensor,
                        gate_up: bool = False) -> SmallStepInt4Kernel:
    """A K-quant layer or MoE expert's projection: in an engine step its decode rows on ``gemv`` and its prefill rows
    dequantized (:class:`KQuantDequantized`), however many share the step, so that a prompt's output does not
    depend on its batch (the GEMV's rows do not depend on their number); outside one, steps of up to
    ``gemv_max_rows(kind)`` rows on the GEMV (see :func:`~lmdeploy.pytorch.step_context.small_step`). The native
    decoder stack builds its small stack on the GEMV's projections (an expert's: ``expert_projection``), its large
    one on the dequantized."""
    return SmallStepInt4Kernel(gemv, gemv_max_rows(kind), KQuantDequantized(kind, codes, scales, gate_up))
