"""Each tensor-parallel rank on a machine computes on its own share of the CPUs the process may use."""
from __future__ import annotations

import os
from collections.abc import Callable

import torch


def rank_cpus(local_rank: int, local_world_size: int) -> list[int]:
    """Rank ``local_rank``'s CPUs among the ``local_world_size`` ranks on this machine: an equal share
    of the allowed CPUs (one CPU, shared, when there are more ranks than CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < local_world_size:
        return [cpus[local_rank % len(cpus)]]
    share = len(cpus) // local_world_size
    return cpus[local_rank * share:(local_rank + 1) * share]


def bind_rank(cpus: list[int], num_threads: int | None = None) -> Callable[[], None]:
    """Runs the calling thread's torch work on ``num_threads`` threads (default: one per CPU) pinned to
    ``cpus`` (unless ``LMDEPLOY_CPU_BIND=0``); the OpenMP threads it starts are pinned by
    ``kernels.cpu.bind_worker_threads``. Returns what undoes it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or len(cpus))
    if os.environ.get('LMDEPLOY_CPU_BIND', '1') == '0':
        return lambda: torch.set_num_threads(threads)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)

    def restore() -> None:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(threads)

    return restore
