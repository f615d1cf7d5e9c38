"""A GGUF file's token table (``token_embd``) of Q4_K, Q6_K or Q8_0 blocks, one copy for the embedding's lookups
and, in a tied file, the LM head's logits; laid out by the model's dtype and device (:func:`block_table`):

- :class:`~lmdeploy.pytorch.nn.quant.gguf_cuda.TritonBlocks`: where the Triton kernels run (CUDA; CPU tensors
  within :func:`~lmdeploy.pytorch.kernels.triton_on_cpu`), the blocks retiled once for their type's Triton GEMM
  (Q8_0, Q6_K; Q4_K's grid on the W4A16 GEMM): logits run it at every step, looked-up rows are dequantized from it.
- :class:`FileBlocks`: the file's blocks as they are, ``uint8 [rows, hidden / B, bytes]``. Rows are dequantized in
  fp32 as they are looked up (exactly the file's weights); logits dequantize a slice of rows at a time
  (``TABLE_SLICE_WEIGHTS``) for ``F.linear``, so that no whole dense table is ever made. bf16 on CPUs without the
  native GEMVs; an untied embedding's lookups.
- :class:`DenseTable`: fp32 on the CPU, the blocks dequantized once at load, as every GGUF layer of an fp32 model
  (the LM head would otherwise dequantize the whole table at every step: 160 ms instead of 60 for Gemma 3's
  262,144 x 640 Q8_0 table, one thread), packed for the fixed-order fp32 GEMM where it is built (one copy: lookups
  read the packed rows).
- :class:`NativeBlocks`: in bf16 on the CPU, the blocks retiled once for their type's native GEMV (tiles of 16 rows,
  the file's weights exactly; the retiled tiles are kept in the derived-weight cache, ``weights/derived_cache.py``,
  so later starts read them). Small steps (:func:`~lmdeploy.pytorch.step_context.small_step`: an engine step's
  decode rows, else up to ``gemv_max_rows`` rows) run on the GEMV, the others take a slice of tiles at a time
  through ``kquant_dequantized_linear`` (dequantized into the native bf16 GEMM's panels in cache; with AMX into the
  thread's reused scratch for oneDNN's GEMM); looked-up rows
  are dequantized from their tiles (the native dequantization, bf16).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels import cpu, triton_runs_on
from lmdeploy.pytorch.nn.quant import gguf_blocks, int4_cpu, q4k_cpu, q6k_cpu, q8_cpu
from lmdeploy.pytorch.nn.quant.cpu_fp32 import native_fp32_kernel
from lmdeploy.pytorch.nn.quant.gguf_blocks import BLOCKS, dequantize_blocks, q8_0_unpack
from lmdeploy.pytorch.nn.quant.int4_cpu import INT4_TILE
from lmdeploy.pytorch.nn.quant.q4k_cpu import pack_q4k
from lmdeploy.pytorch.nn.quant.q6k_cpu import Q6K_PACK_ROWS, Q6K_TILE, gemv_max_rows, pack_q6k
from lmdeploy.pytorch.nn.quant.q8_cpu import Q8_TILE, pack_q8
from lmdeploy.pytorch.step_context import small_step
from lmdeploy.pytorch.weights.derived_cache import cached_derivation

TILE_ROWS = Q8_TILE  # rows per tile of the Q8_0, Q6_K and Q4_K GEMVs alike
assert TILE_ROWS == Q6K_TILE == INT4_TILE

# weights of the table dequantized at a time for the logits of many rows (16 MiB in fp32, 8 MiB in bf16)
TABLE_SLICE_WEIGHTS = 1 << 22
# looked-up tokens whose tiles are dequantized at a time (a prompt's tokens: 16 rows each)
LOOKUP_SLICE_TOKENS = 256


class BlockTable(ABC):
    """A table of ``rows`` rows of ``hidden`` weights from a GGUF type's blocks, in one of the layouts above."""

    def __init__(self, rows: int, hidden: int):
        self.rows, self.hidden = rows, hidden

    @abstractmethod
    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids [n]`` as ``[n, hidden]`` in ``dtype``."""

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, hidden] @ table.T``: ``[T, rows]``, fp32 on the CPU."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The tensors held."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


class FileBlocks(BlockTable):
    """The file's blocks as they are, ``uint8 [rows, hidden / B, bytes]`` (see the module's docstring)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str):
        super().__init__(blocks.shape[0], blocks.shape[1] * BLOCKS[ggml_type][0])
        self.blocks, self.ggml_type = blocks, ggml_type

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_blocks(self.blocks[ids], self.ggml_type).to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        slice_rows = max(1, TABLE_SLICE_WEIGHTS // self.hidden)
        logits = torch.cat([F.linear(hidden, dequantize_blocks(rows, self.ggml_type).to(hidden.dtype))
                            for rows in self.blocks.split(slice_rows)], dim=-1)
        return logits.float() if hidden.device.type == 'cpu' else logits

    def tensors(self) -> list[torch.Tensor]:
        return [self.blocks]


class DenseTable(BlockTable):
    """The blocks dequantized once to fp32: the fixed-order fp32 GEMM's packed tiles where it is built (lookups read
    their rows), else a ``weight [rows, hidden]`` (see the module's docstring)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str):
        super().__init__(blocks.shape[0], blocks.shape[1] * BLOCKS[ggml_type][0])
        self.weight = torch.empty(self.rows, self.hidden)
        slice_rows = max(1, TABLE_SLICE_WEIGHTS // self.hidden)
        for rows, out in zip(blocks.split(slice_rows), self.weight.split(slice_rows)):
            out.copy_(dequantize_blocks(rows, ggml_type))
        self.kernel = native_fp32_kernel(self.weight)
        if self.kernel is not None:
            self.weight = None

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.weight_rows(ids).to(dtype)
        return F.embedding(ids, self.weight).to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(hidden.float(), None)
        return F.linear(hidden.float(), self.weight)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight] if self.kernel is None else [self.kernel.packed]


class NativeType(NamedTuple):
    """A block type's native kernels."""

    kind: str  # their name for it (``kquant_dequantized_linear``'s ``kind``)
    pack: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # blocks retiled in tiles of 16 rows
    gemv: str  # the GEMV on the retiled blocks
    dequantize: str  # whole tiles to bf16
    built: Callable[[], object]  # whether the GEMV was built for this CPU (None if not)
    sources: tuple[str, ...]  # the modules that hold ``pack``'s code, beside this one (the derived cache's key)


NATIVE_TYPES = {
    'Q8_0': NativeType('q8_0', lambda blocks: pack_q8(*_q8_0_codes_scales(blocks)), 'q8_linear', 'q8_dequantize',
                       cpu.q8_gemv, (gguf_blocks.__file__, q8_cpu.__file__)),
    'Q6_K': NativeType('q6k', pack_q6k, 'q6k_linear', 'q6k_dequantize', cpu.q6k_gemv, (q6k_cpu.__file__, )),
    'Q4_K': NativeType('q4k', pack_q4k, 'q4k_linear', 'q4k_dequantize', cpu.int4_gemv,
                       (q4k_cpu.__file__, q6k_cpu.__file__, int4_cpu.__file__)),
}


def retile(blocks: torch.Tensor, pack: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``blocks [rows, hidden / B, bytes]`` as ``pack`` lays them out in tiles of 16 rows (rows beyond a multiple of
    the tiles: zero blocks)."""
    parts = []
    for rows in blocks.split(Q6K_PACK_ROWS):  # a slice at a time: the retiling's temporaries stay small
        pad = -rows.shape[0] % TILE_ROWS
        parts.append(pack(F.pad(rows, (0, 0, 0, 0, 0, pad)) if pad else rows))
    packed, scales = (torch.cat(part) for part in zip(*parts))
    return packed, scales


def _q8_0_codes_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = q8_0_unpack(blocks)
    return codes, scales.half()  # the file's fp16 scales, exactly


class NativeBlocks(BlockTable):
    """In bf16 on the CPU: the blocks retiled for their type's native GEMV (see the module's docstring). Rows beyond
    a multiple of the tiles are zero weights whose logits are dropped."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str):
        super().__init__(blocks.shape[0], blocks.shape[1] * BLOCKS[ggml_type][0])
        native_type = NATIVE_TYPES[ggml_type]
        native = cpu.native()
        self.kind = native_type.kind
        self.gemv, self.dequantize = getattr(native, native_type.gemv), getattr(native, native_type.dequantize)
        self.packed, self.scales = cached_derivation(f'native table {ggml_type}', blocks,
                                                     (__file__, ) + native_type.sources,
                                                     lambda: retile(blocks, native_type.pack))
        self.max_gemv_rows = gemv_max_rows(self.kind)

    @classmethod
    def of(cls, blocks: torch.Tensor, ggml_type: str) -> NativeBlocks | None:
        """The table of CPU blocks where its type's GEMV was built; else None."""
        if blocks.device.type != 'cpu' or ggml_type not in NATIVE_TYPES or NATIVE_TYPES[ggml_type].built() is None:
            return None
        return cls(blocks, ggml_type)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = []
        for part in ids.split(LOOKUP_SLICE_TOKENS):
            weight = self.dequantize(self.packed[part // TILE_ROWS], self.scales[part // TILE_ROWS])
            rows = weight.view(part.shape[0], TILE_ROWS, self.hidden)
            out.append(rows[torch.arange(part.shape[0]), part % TILE_ROWS])
        return torch.cat(out).to(dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.to(torch.bfloat16).contiguous()
        if small_step(x.shape[0], self.max_gemv_rows):
            logits = self.gemv(x, self.packed, self.scales)
        else:
            tiles = max(1, TABLE_SLICE_WEIGHTS // (TILE_ROWS * self.hidden))
            native = cpu.native()
            logits = torch.cat([native.kquant_dequantized_linear(x, self.kind, packed, scales, None)
                                for packed, scales in zip(self.packed.split(tiles), self.scales.split(tiles))],
                               dim=-1)
        return logits[:, :self.rows].float()

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales]


def block_table(blocks: torch.Tensor, ggml_type: str, dtype: torch.dtype) -> BlockTable:
    """The table of ``blocks`` for a model of ``dtype``: retiled for the Triton GEMMs where they run (CUDA; CPU
    tensors within ``triton_on_cpu``), retiled for the native GEMV in bf16 on the CPU where it was built, dequantized
    once in fp32 on the CPU, else the blocks as they are."""
    if triton_runs_on(blocks):
        from lmdeploy.pytorch.nn.quant.gguf_cuda import TritonBlocks
        return TritonBlocks(blocks, ggml_type)
    if dtype == torch.float32 and blocks.device.type == 'cpu':
        return DenseTable(blocks, ggml_type)
    native = NativeBlocks.of(blocks, ggml_type) if dtype == torch.bfloat16 else None
    return native if native is not None else FileBlocks(blocks, ggml_type)
