"""CUDA graphs for decode steps: one graph per padded batch size, replayed over static input buffers.

A decode step's kernels launch grids that depend only on the batch size and the block table's width,
so a graph captured once per padded batch size replays any decode step of that size. Each step's
inputs are written into one pinned host tensor and copied into the graphs' static input buffer with
one asynchronous copy; rows past the real batch are padding that reads and writes only a scratch
KV block that no sequence owns. Prefill and mixed steps run eagerly. A model whose sliding-window layers
have a KV pool of their own has a second KV-block column and block table, in that pool, after the first
table (the blocks the pool gave back read block 0, as in eager steps).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from lmdeploy.pytorch.paging.block_manager import given_back_as_zero
from lmdeploy.pytorch.paging.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from lmdeploy.pytorch.engine.model_runner import InflightTokens
from lmdeploy.pytorch.step_context import StepContext

SMALL_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32)
LARGE_BATCH_STEP = 16
# Columns of the static input buffer before the block table: token id, position, KV block, KV length,
# then the three rotary positions of models with 3-D positions.
TOKEN, POSITION, KV_BLOCK, KV_LEN = range(4)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, 8, 16, 24, 32, then every 16, and the maximum."""
    sizes = [size for size in SMALL_BATCH_SIZES if size < max_batch_size]
    sizes += range(SMALL_BATCH_SIZES[-1] + LARGE_BATCH_STEP, max_batch_size, LARGE_BATCH_STEP)
    return sizes + [max_batch_size]


class Graph(Protocol):
    """What the runner needs of a graph: capture a function's launches once, replay them later."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """A ``torch.cuda.CUDAGraph`` capturing into a memory pool shared by all of a runner's graphs."""

    def __init__(self, pool: tuple):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            return fn()

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphRunner:
    """Runs decode-only steps of up to ``max_batch_size`` sequences as graph replays.

    ``max_blocks`` is the block table's width (the most blocks a sequence can hold); ``scratch_block``
    is a KV block outside the block manager's pool that padding rows use, ``window_scratch_block`` the
    sliding-window pool's (None: the model has no such pool). ``make_graph`` builds the graphs (tests pass
    a recorder that re-runs the function on replay).
    """

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_batch_size: int,
                 max_blocks: int, block_size: int, scratch_block: int,
                 make_graph: Callable[[], Graph] | None = None, window_scratch_block: int | None = None):
        device = kv_caches[0][0].device
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sizes = graph_batch_sizes(max_batch_size)
        self.uses_mrope = getattr(model, 'uses_mrope', False)
        self.first_block_column = KV_LEN + 1 + (3 if self.uses_mrope else 0)
        self.max_blocks = max_blocks
        self.window_scratch_block = window_scratch_block
        # the sliding-window pool's KV-block column, then its block table
        self.window_column = None if window_scratch_block is None else self.first_block_column + max_blocks
        width = self.first_block_column + max_blocks + (0 if window_scratch_block is None else 1 + max_blocks)
        shape = (self.sizes[-1], width)
        self.staging = torch.zeros(shape, dtype=torch.long, pin_memory=device.type == 'cuda')
        self.staging_rows = self.staging.numpy()
        self.inputs = torch.zeros(shape, dtype=torch.long, device=device)
        # Set when the last step's inputs have left the pinned staging tensor, which may then be rewritten.
        self.copied = torch.cuda.Event() if device.type == 'cuda' else None
        self._pad_rows(0, shape[0])
        self.inputs.copy_(self.staging)
        if make_graph is None:
            pool = torch.cuda.graph_pool_handle()
            make_graph = lambda: CudaGraph(pool)  # noqa: E731
        self.make_graph = make_graph
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _pad_rows(self, start: int, end: int) -> None:
        rows = self.staging_rows[start:end]
        rows[:, :KV_LEN + 1] = (0, 0, self.scratch_block, 1)
        rows[:, KV_LEN + 1:self.first_block_column] = 0
        rows[:, self.first_block_column] = self.scratch_block
        if self.window_column is not None:
            rows[:, self.window_column:self.window_column + 2] = self.window_scratch_block

    def forward(self, size: int) -> torch.Tensor:
        """Logits ``[size, vocab]`` of the first ``size`` rows of the static inputs (what a graph captures)."""
        rows = self.inputs[:size]
        positions = rows[:, POSITION].contiguous()
        rope_positions = rows[:, KV_LEN + 1:self.first_block_column].T.contiguous() if self.uses_mrope else None
        window = {}
        if self.window_column is not None:
            window = dict(window_kv_blocks=rows[:, self.window_column].contiguous(),
                          window_decode_blocks=rows[:, self.window_column + 1:].contiguous())
        ctx = StepContext(positions=positions, kv_blocks=rows[:, KV_BLOCK].contiguous(),
                          kv_offsets=positions % self.block_size, num_prefill_tokens=0, prefill_block_table=None,
                          prefill_q_start=None, prefill_q_len=None, prefill_ctx_len=None, prefill_max_q_len=0,
                          decode_blocks=rows[:, self.first_block_column:self.first_block_column + self.max_blocks]
                          .contiguous(), decode_kv_lens=rows[:, KV_LEN].contiguous(), rope_positions=rope_positions,
                          **window)
        hidden = self.model(rows[:, TOKEN].contiguous(), self.kv_caches, ctx)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first so that smaller graphs reuse the pool's memory; one eager
        run before each capture compiles its kernels and sets up the libraries' workspaces."""
        for size in reversed(self.sizes):
            self.forward(size)
            graph = self.make_graph()
            self.outputs[size] = graph.capture(functools.partial(self.forward, size))
            self.graphs[size] = graph

    def runs(self, decode: list[ScheduledSeq]) -> bool:
        """Whether a decode-only step of these sequences fits a captured graph."""
        return (bool(self.graphs) and len(decode) <= self.sizes[-1]
                and all(len(item.seq.block_ids) <= self.max_blocks for item in decode))

    def _write_row(self, row: int, item: ScheduledSeq) -> None:
        seq = item.seq
        last = seq.num_tokens - 1
        blocks = given_back_as_zero(seq.block_ids)
        values = self.staging_rows[row]
        values[:KV_LEN + 1] = (seq.last_token, last, blocks[last // self.block_size], last + 1)
        if self.uses_mrope:
            values[KV_LEN + 1:self.first_block_column] = seq.rope_positions_of(last, last + 1)[:, 0].numpy()
        values[self.first_block_column:self.first_block_column + len(blocks)] = blocks
        if self.window_column is not None:
            window_blocks = given_back_as_zero(seq.window_block_ids)
            values[self.window_column] = window_blocks[last // self.block_size]
            values[self.window_column + 1:self.window_column + 1 + len(window_blocks)] = window_blocks

    @torch.inference_mode()
    def run(self, decode: list[ScheduledSeq], inflight: InflightTokens | None = None) -> torch.Tensor:
        """Replays the graph of the smallest size that holds ``decode``; logits ``[len(decode), vocab]``
        (a view of the graph's output, valid until the next replay). Tokens still in flight come from
        ``inflight``."""
        batch = len(decode)
        size = next(size for size in self.sizes if size >= batch)
        if self.copied is not None:
            self.copied.synchronize()
        for row, item in enumerate(decode):
            self._write_row(row, item)
        self._pad_rows(batch, size)
        self.inputs[:size].copy_(self.staging[:size], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if inflight is not None:
            inflight.copy_into(self.inputs[:, TOKEN], decode, 0)
        self.graphs[size].replay()
        return self.outputs[size][:batch]
