"""Token embedding and LM head, vocab-parallel under tensor parallelism.

Each rank holds a contiguous share of the vocabulary's rows (the last share zero-padded when the
vocabulary does not split evenly). The embedding looks up the tokens its rows hold and the ranks'
results are summed; the LM head's logits of each share are gathered on rank 0, the rank that samples.
A GGUF file's token embedding may stay as its blocks, a share of rows as any table's, which a tied LM head reads
too (:mod:`lmdeploy.pytorch.nn.quant.gguf_table`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmdeploy.pytorch.distributed.parallel_state import Shard, TPGroup, current_group
from lmdeploy.pytorch.nn.quant import LinearKernel, current_weight_format
from lmdeploy.pytorch.nn.quant.base import Layout, new_parameter
from lmdeploy.pytorch.nn.quant.cpu_bf16 import packed_cpu_kernel
from lmdeploy.pytorch.nn.quant.cpu_fp32 import native_fp32_kernel
from lmdeploy.pytorch.nn.quant.gguf_blocks import BLOCKS
from lmdeploy.pytorch.nn.quant.gguf_table import BlockTable, FileBlocks, NativeBlocks, block_table
from lmdeploy.pytorch.nn.quant.q8_cpu import Q8Gemv
from lmdeploy.pytorch.step_context import small_step


def vocab_rows(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """``(start, stop, rows)``: the vocabulary rows ``[start, stop)`` this rank holds, in a table of
    ``rows`` rows (the same on every rank)."""
    rows = -(-vocab_size // tp.world_size)
    start = min(tp.rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


class VocabTable(nn.Module):
    """``weight [rows, hidden]``: this rank's share of a table with a row per token (none without
    ``own_weight``)."""

    def __init__(self, vocab_size: int, hidden_size: int, own_weight: bool = True):
        super().__init__()
        self.tp = current_group()
        self.vocab_size = vocab_size
        self.start, self.stop, self.rows = vocab_rows(vocab_size, self.tp)
        if own_weight:
            self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
            self.weight[self.stop - self.start:].zero_()

    def checkpoint_part(self, kind: str, part: int | None = None) -> tuple[torch.Tensor, Shard | None]:
        """The rows of the table (``kind``: ``weight``, or a block table's ``qweight``) this rank holds (see
        :meth:`Linear.checkpoint_part`)."""
        table = getattr(self, kind)
        if self.tp.world_size == 1:
            return table, None
        return table[:self.stop - self.start], Shard(0, self.start, self.stop)


class VocabParallelEmbedding(VocabTable):
    """The token embedding: ``weight`` in the model's dtype, or where the weight format keeps it as blocks
    (:attr:`WeightFormat.embedding_block_type`: a GGUF file's Q4_K, Q6_K or Q8_0 ``token_embd``) ``qweight uint8
    [rows, hidden / B, bytes]``, the looked-up rows' blocks dequantized on each call (in fp32, exactly the file's
    weights, then cast to the model's dtype). A tied LM head takes the blocks over (:meth:`share_blocks`): both then
    read one table, retiled in bf16 on the CPU for the native GEMV (in fp32 dequantized once)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        block_type = current_weight_format().embedding_block_type
        super().__init__(vocab_size, hidden_size, own_weight=block_type is None)
        self.block_type = block_type
        self.shared: BlockTable | None = None
        if self.block_type is None:
            return
        if self.block_type not in BLOCKS:
            raise ValueError(f'token embeddings of types {sorted(BLOCKS)} are kept as blocks, not {self.block_type}')
        block_inputs, block_bytes = BLOCKS[self.block_type]
        if hidden_size % block_inputs:
            raise ValueError(f'a {self.block_type} token embedding needs a hidden size in blocks of {block_inputs}, '
                             f'not {hidden_size}')
        self.qweight = new_parameter((self.rows, hidden_size // block_inputs, block_bytes), Layout(0, None),
                                     torch.uint8)
        self.qweight[self.stop - self.start:].zero_()
        # empty, in the model's dtype (cast and moved with it): the dtype the dequantized rows are given in
        self.register_buffer('model_dtype', torch.empty(0), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.lookup(input_ids)
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        out = self.lookup((input_ids - self.start).masked_fill_(outside, 0))
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """The ``rows`` of this rank's table, ``[*rows.shape, hidden]`` in the model's dtype."""
        if self.block_type is None:
            return F.embedding(rows, self.weight)
        return self.block_table().lookup(rows.reshape(-1), self.model_dtype.dtype).view(*rows.shape, -1)

    def block_table(self) -> BlockTable:
        """The blocks this rank holds: the table shared with a tied LM head, else ``qweight`` as it is."""
        return self.shared if self.shared is not None else FileBlocks(self.qweight, self.block_type)

    def share_blocks(self) -> None:
        """Lays the loaded blocks out as the one table of this embedding and a tied LM head where the model's dtype
        and device have a kernel for them (see :func:`block_table`), releasing ``qweight``."""
        if self.shared is None:
            table = block_table(self.qweight.data, self.block_type, self.model_dtype.dtype)
            if not isinstance(table, FileBlocks):
                self.shared, self.qweight = table, None


class LMHead(VocabTable):
    """Logits ``[T, vocab]`` of hidden states, on rank 0 (None on the other ranks).

    ``tied`` shares the embedding's table instead of holding a weight; an embedding kept as a GGUF file's blocks
    shares them (:meth:`VocabParallelEmbedding.share_blocks`), every step on them. Another table may run on its
    weight format's LM-head kernel (W8A8: int8 rows on the CPU; a GGUF file's Q6_K output layer on its blocks) or, in
    bf16 on the CPU, be kept packed for its GEMM (:meth:`finalize`), and one-row steps may run on an 8-bit or fp16
    copy (:meth:`enable_small_step_copy`).
    """

    def __init__(self, hidden_size: int, vocab_size: int, tied: VocabParallelEmbedding | None = None):
        super().__init__(vocab_size, hidden_size, own_weight=tied is None)
        self.tied_blocks = tied is not None and tied.block_type is not None
        self._tied = [tied] if tied is not None else []  # a list: the embedding is not a submodule here
        self.weight_format = current_weight_format()
        self.fp16: torch.Tensor | None = None
        self.q8: Q8Gemv | None = None
        self.packed: LinearKernel | None = None

    @property
    def table_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied else self.weight

    def finalize(self, pack_cpu: bool) -> None:
        """Lays the loaded table out for its kernel: the weight format's LM-head kernel (see
        :meth:`WeightFormat.lm_head_kernel`), else with ``pack_cpu`` the bf16 GEMM's packing of a bf16 table or the
        fixed-order fp32 GEMM's of an fp32 one (a tied table's beside the embedding's: 113 MB on the default model).
        The kernel runs every step (but one-row steps on a small-step copy), so an untied table it replaces is
        released (Qwen3-30B-A3B's: 0.58 GiB in bf16). An embedding's blocks are shared as they are laid out for it."""
        if self.tied_blocks:
            self._tied[0].share_blocks()
            return
        self.packed = self.weight_format.lm_head_kernel(self.table_weight)
        if pack_cpu:
            self.packed = (self.packed or packed_cpu_kernel(self.table_weight)
                           or native_fp32_kernel(self.table_weight))
        if self.packed is not None and not self._tied:
            self.weight = None

    def enable_small_step_copy(self) -> None:
        """One-row steps use an 8-bit copy where it gives the table back to bf16's precision (a Q8_0 table,
        see :class:`Q8Gemv`), else an fp16 one (a CPU GEMV streams fp16 twice as fast as bf16 here; bf16 to
        fp16 is exact for all but tiny values); both give fp32 logits. None beside an embedding's blocks, whose own
        GEMV runs small steps."""
        if self.tied_blocks:
            return
        self.q8 = Q8Gemv.of(self.table_weight)
        if self.q8 is None:
            self.fp16 = self.table_weight.half()

    @property
    def has_small_step_kernel(self) -> bool:
        """Whether small steps run on a kernel of their own: a one-row copy, or a tied table's GEMV."""
        return (self.q8 is not None or self.fp16 is not None
                or (self.tied_blocks and isinstance(self._tied[0].block_table(), NativeBlocks)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Small steps (decode rows in an engine step, see :func:`small_step`) on the small-step copy."""
        one_row_copy = small_step(hidden.shape[0], 1)
        if self.tied_blocks:
            logits = self._tied[0].block_table().logits(hidden)
        elif self.q8 is not None and one_row_copy:
            logits = self.q8(hidden)
        elif self.fp16 is not None and one_row_copy:
            logits = F.linear(hidden.half(), self.fp16).float()
        elif self.packed is not None:
            logits = self.packed(hidden, None)
        else:
            logits = F.linear(hidden, self.table_weight)
        logits = self.tp.gather(logits, dim=-1)
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return logits[:, :self.vocab_size]
