"""DeepSeek-V4's attention over a sliding window and compressed entries, on a paged cache of one row per token.

Every layer caches, per token, one row ``[row_width]`` in the paged layout of ``kv_blocks``/``kv_offsets``
(``ModelConfig.kv_latent_dim``): its shared key-value (the first ``head_dim`` features), then, in the layers with
a compressor, that token's compressor inputs (the projected ``kv`` and ``gate``) and, in the row of the last token
of each window of ``ratio`` tokens, the window's compressed entry. A window's entry is written when its last token
is computed, from its tokens' inputs (and, for CSA, the previous window's): so everything a row holds is a function
of the tokens up to its own, and chunked prefill, recompute after preemption and prefix-cache hits read what a solo
run wrote. Each query attends to the last ``window`` keys (itself included) and to the entries of the windows
completed up to it (CSA: the ``index_topk`` of those its indexer scores best), with a sink logit per head.
Torch throughout; as many queries at a time as gather about ``GATHER_ELEMENTS`` key features.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.step_context import StepContext

GATHER_ELEMENTS = 1 << 25  # key features (keys, CSA's index keys) gathered at once: 128 MiB in fp32


@dataclass
class PagedRows:
    """Where each packed token's sequence keeps its rows: ``tables [T, max blocks]`` (its block table),
    ``positions [T]`` and the cache's ``block_size``."""

    tables: torch.Tensor
    positions: torch.Tensor
    block_size: int

    @classmethod
    def of(cls, ctx: StepContext, block_size: int) -> PagedRows:
        tables = []
        if ctx.prefill_q_len is not None:
            tables.append(ctx.prefill_block_table.repeat_interleave(ctx.prefill_q_len, dim=0))
        if ctx.decode_blocks is not None:
            tables.append(ctx.decode_blocks)
        width = max(t.shape[1] for t in tables)
        tables = torch.cat([F.pad(t, (0, width - t.shape[1])) for t in tables])
        return cls(tables, ctx.positions, block_size)

    def read(self, cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, columns: slice) -> torch.Tensor:
        """``cache[..., columns]`` at ``positions [R, K]`` (>= 0) of the sequences of packed tokens ``rows [R]``."""
        blocks = self.tables[rows].gather(1, positions // self.block_size)
        return cache[blocks, positions % self.block_size, columns]


def write_rows(cache: torch.Tensor, ctx: StepContext, columns: slice, values: torch.Tensor) -> None:
    """Writes each packed token's ``values [T, width]`` into its row's ``columns``."""
    cache[ctx.kv_blocks, ctx.kv_offsets, columns] = values.to(cache.dtype)


@dataclass
class CompressorColumns:
    """A compressor's place in a row: ``inputs`` (``kv`` then ``gate``, ``2 * width`` features; ``width`` is
    ``2 * dim`` with ``overlap``: CSA's two series) and ``entry`` (``dim``)."""

    start: int
    dim: int
    overlap: bool

    @property
    def width(self) -> int:
        return 2 * self.dim if self.overlap else self.dim

    @property
    def inputs(self) -> slice:
        return slice(self.start, self.start + 2 * self.width)

    @property
    def entry(self) -> slice:
        return slice(self.start + 2 * self.width, self.start + 2 * self.width + self.dim)

    @property
    def stop(self) -> int:
        return self.entry.stop


def closing_rows(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """The packed tokens that complete a window of ``ratio`` tokens."""
    return ((positions + 1) % ratio == 0).nonzero().flatten()


def pooled_windows(cache: torch.Tensor, paged: PagedRows, rows: torch.Tensor, cols: CompressorColumns,
                   ratio: int, position_bias: torch.Tensor) -> torch.Tensor:
    """The softmax-gated sum of each window that token ``rows`` completes, ``[R, dim]`` in the cache's dtype (before
    the compressor's norm): the window's ``kv`` by ``softmax(gate + position_bias)`` over its tokens; with
    ``overlap`` over ``2 * ratio`` slots, the previous window's first series (none before the first window) and
    this window's second."""
    last = paged.positions[rows]
    offsets = torch.arange(ratio, device=last.device)
    window = last.unsqueeze(1) - ratio + 1 + offsets
    inputs = paged.read(cache, rows, window, cols.inputs)
    kv, gate = inputs[..., :cols.width], inputs[..., cols.width:].float() + position_bias
    if not cols.overlap:
        return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
    dim = cols.dim
    previous = paged.read(cache, rows, (window - ratio).clamp(min=0), cols.inputs)
    prev_kv, prev_gate = previous[..., :dim], previous[..., cols.width:cols.width + dim].float() + position_bias[:, :dim]
    prev_gate = prev_gate.masked_fill((window < ratio).unsqueeze(-1), float('-inf'))  # the first window: no previous
    kv = torch.cat((prev_kv, kv[..., dim:]), dim=1)
    gate = torch.cat((prev_gate, gate[..., dim:]), dim=1)
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def entry_positions(positions: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For queries at ``positions [R]``: the positions of the rows that hold the entries of the windows completed up
    to each, ``[R, N]`` (clamped to 0 past a query's own), and which of them it may read ``[R, N]``."""
    counts = (positions + 1) // ratio
    width = int(counts.max()) if counts.numel() else 0
    entries = torch.arange(width, device=positions.device)
    valid = entries.unsqueeze(0) < counts.unsqueeze(1)
    return torch.where(valid, (entries + 1) * ratio - 1, 0), valid


def sink_attention(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """``q [R, H, D]`` over its rows' ``keys [R, K, D]`` (which are also the values) where ``allowed [R, K]``, a
    softmax that also weighs each head's ``sinks [H]`` logit (whose value is nothing); ``[R, H, D]``."""
    logits = torch.einsum('rhd,rkd->rhk', q, keys) * scale
    logits = logits.masked_fill(~allowed.unsqueeze(1), float('-inf'))
    sink = sinks.to(logits.dtype).view(1, -1, 1).expand(logits.shape[0], -1, 1)
    combined = torch.cat((logits, sink), dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1)[..., :-1].to(keys.dtype)
    return torch.einsum('rhk,rkd->rhd', probs, keys)


def window_keys(cache: torch.Tensor, paged: PagedRows, rows: torch.Tensor, window: int,
                dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``window`` keys of each query of ``rows`` (itself included) ``[R, window, dim]``, and which exist."""
    positions = paged.positions[rows].unsqueeze(1) - window + 1 + torch.arange(window, device=rows.device)
    return paged.read(cache, rows, positions.clamp(min=0), slice(0, dim)), positions >= 0
