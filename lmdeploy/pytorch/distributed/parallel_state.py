"""Which tensor-parallel rank this process is, and the collectives its layers take part in.

A model is built inside :func:`use_group`; each parallel layer keeps the :class:`TPGroup` that was
current when it was constructed, so engines of different tensor-parallel sizes can live in one
process. With one rank every collective is a no-op.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class WorkerError(RuntimeError):
    """A tensor-parallel rank died, hung past its timeout or raised: the engine cannot go on."""


@dataclass(frozen=True)
class Shard:
    """The part ``[start, stop)`` along ``dim`` of a checkpoint tensor that this rank holds."""

    dim: int
    start: int
    stop: int


def split_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s ``[start, stop)`` of ``size`` items dealt out as evenly as they go (the first
    ranks get one more)."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def split_blocks(size: int, granule: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s ``[start, stop)`` of ``size`` items dealt out in whole groups of ``granule`` (a block of a
    quantized format's inputs: Llama-2-7B's 11,008 features over 2 ranks as 22 and 21 Q4_K blocks of 256) where
    ``size`` is whole groups, at least one a rank; else item by item (:func:`split_range`)."""
    if size % granule or size // granule < world_size:
        granule = 1
    start, stop = split_range(size // granule, rank, world_size)
    return start * granule, stop * granule


def head_ranges(num_heads: int, num_kv_heads: int, rank: int,
                world_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's query heads and the KV heads they read, as ``[start, stop)`` ranges.

    KV heads are dealt out as evenly as they go, each with its group of query heads (SmolLM2's 3 KV
    heads over 2 ranks: 2 and 1). With fewer KV heads than ranks, each rank holds one KV head, shared
    (replicated) with the neighbouring ranks, and its share of that head's query heads.
    """
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        kv_start, kv_stop = split_range(num_kv_heads, rank, world_size)
        return (kv_start * group, kv_stop * group), (kv_start, kv_stop)
    kv_head = rank * num_kv_heads // world_size
    sharing = [r for r in range(world_size) if r * num_kv_heads // world_size == kv_head]
    start, stop = split_range(group, sharing.index(rank), len(sharing))
    if start == stop:
        raise ValueError(f'tp={world_size} is more than the {num_heads} attention heads')
    return (kv_head * group + start, kv_head * group + stop), (kv_head, kv_head + 1)


@dataclass
class TPGroup:
    """A tensor-parallel group seen from one rank; ``pg`` is None for a single rank.

    ``timeout`` bounds each collective of a step: a rank that does not join in time fails the step;
    ``connect_timeout`` bounds waiting for the ranks to connect and load their shards. ``control``
    carries the step inputs (a CPU group; the same as ``pg`` on the CPU).
    """

    rank: int = 0
    world_size: int = 1
    pg: dist.Backend | None = None
    control: dist.Backend | None = None
    timeout: timedelta = timedelta(seconds=300)
    connect_timeout: timedelta = timedelta(seconds=900)

    def _check(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise WorkerError(f'tensor-parallel {what} failed on rank {self.rank}: {exc}') from exc

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place; returns it."""
        if self.world_size > 1:
            self._check(self.pg.allreduce([x], dist.ReduceOp.SUM, self.timeout), 'all_reduce')
        return x

    def gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along ``dim`` on rank 0; None on the other ranks."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else []
        self._check(self.pg.gather(parts, x, 0, self.timeout), 'gather')
        return torch.cat(parts, dim=dim) if self.rank == 0 else None

    def min(self, value: int, timeout: timedelta | None = None) -> int:
        """The smallest of the ranks' ``value``s, on every rank."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._check(self.control.allreduce([t], dist.ReduceOp.MIN, timeout or self.timeout), 'min')
        return int(t.item())

    def broadcast(self, x: torch.Tensor, timeout: timedelta | None = None) -> None:
        """Rank 0's CPU tensor ``x`` into ``x`` of every rank (over the control group)."""
        self._check(self.control.broadcast(x, 0, timeout or self.timeout), 'broadcast')

    def shutdown(self) -> None:
        """Drops the connections to the other ranks."""
        for pg in {id(p): p for p in (self.pg, self.control) if p is not None}.values():
            with contextlib.suppress(Exception):
                pg.shutdown()
        self.pg = self.control = None


_current = TPGroup()


def current_group() -> TPGroup:
    """The group layers constructed now belong to (a single rank outside :func:`use_group`)."""
    return _current


@contextlib.contextmanager
def use_group(group: TPGroup) -> Iterator[TPGroup]:
    """Makes ``group`` current while a model is built."""
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous
