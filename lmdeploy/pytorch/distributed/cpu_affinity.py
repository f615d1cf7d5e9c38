"""Each tensor-parallel rank on a machine computes on its own share of the CPUs the process may use."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ThreadBinding:
    """What a thread had before the first engine still open on it bound it, and how many are open."""

    allowed: set[int] | None  # None: not pinned (LMDEPLOY_CPU_BIND=0)
    num_threads: int
    engines: int = 0


_binding = threading.local()  # each thread's ThreadBinding, as .current


def allowed_cpus() -> set[int]:
    """The CPUs the calling thread may use: those it had before an engine bound it to rank 0's share."""
    binding: ThreadBinding | None = getattr(_binding, 'current', None)
    if binding is not None and binding.engines and binding.allowed is not None:
        return set(binding.allowed)
    return os.sched_getaffinity(0)


def rank_cpus(local_rank: int, local_world_size: int) -> list[int]:
    """Rank ``local_rank``'s CPUs among the ``local_world_size`` ranks on this machine: an equal share
    of the allowed CPUs (one CPU, shared, when there are more ranks than CPUs)."""
    cpus = sorted(allowed_cpus())
    if len(cpus) < local_world_size:
        return [cpus[local_rank % len(cpus)]]
    share = len(cpus) // local_world_size
    return cpus[local_rank * share:(local_rank + 1) * share]


def bind_rank(cpus: list[int], num_threads: int | None = None) -> Callable[[], None]:
    """Runs the calling thread's torch work on ``num_threads`` threads (default: one per CPU) pinned to
    ``cpus`` (unless ``LMDEPLOY_CPU_BIND=0``); the OpenMP threads it starts are pinned by
    ``kernels.cpu.bind_worker_threads``. Returns what undoes it, to be called on the same thread (torch's thread
    count is the calling thread's): the last of the thread's bindings undone, whatever the order, gives it back
    the CPUs and torch threads it had before the first."""
    pin = os.environ.get('LMDEPLOY_CPU_BIND', '1') != '0'
    binding: ThreadBinding | None = getattr(_binding, 'current', None)
    if binding is None or not binding.engines:
        binding = _binding.current = ThreadBinding(os.sched_getaffinity(0) if pin else None, torch.get_num_threads())
    elif pin and binding.allowed is None:
        binding.allowed = os.sched_getaffinity(0)
    binding.engines += 1
    torch.set_num_threads(num_threads or len(cpus))
    if pin:
        os.sched_setaffinity(0, cpus)

    def restore() -> None:
        binding.engines -= 1
        if binding.engines:
            return
        if binding.allowed is not None:
            os.sched_setaffinity(0, binding.allowed)
        torch.set_num_threads(binding.num_threads)

    return restore
