"""Connects the ranks of a tensor-parallel group over a TCPStore that rank 0 hosts: gloo on the CPU;
on CUDA, NCCL for the model's collectives plus gloo for the step inputs. A rank that fails leaves
its error in the store, where rank 0 reads it to say why the group broke."""
from __future__ import annotations

import os
import traceback
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from lmdeploy.pytorch.distributed.parallel_state import TPGroup

STEP_TIMEOUT_ENV = 'LMDEPLOY_TP_TIMEOUT'
CONNECT_TIMEOUT_ENV = 'LMDEPLOY_TP_CONNECT_TIMEOUT'


def _seconds(env: str, default: float) -> timedelta:
    return timedelta(seconds=float(os.environ.get(env, default)))


def connect_timeout() -> timedelta:
    """How long ranks wait for each other to connect and load their shards."""
    return _seconds(CONNECT_TIMEOUT_ENV, 900)


def step_timeout() -> timedelta:
    """How long a collective of a step waits for the other ranks."""
    return _seconds(STEP_TIMEOUT_ENV, 300)


def host_store(host: str, world_size: int) -> dist.TCPStore:
    """Rank 0's store on a free port of ``host`` (``store.port`` says which)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=connect_timeout(),
                         wait_for_workers=False)


def join_store(host: str, port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=connect_timeout())


def _gloo(store: dist.Store, rank: int, world_size: int, host: str, timeout: timedelta) -> dist.Backend:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def connect(store: dist.Store, rank: int, world_size: int, host: str, device: torch.device) -> TPGroup:
    """This rank's :class:`TPGroup`, once every rank has connected; ``host`` is the address of this rank's
    machine that the other ranks reach. Collectives time out after ``$LMDEPLOY_TP_TIMEOUT`` seconds
    (default 300), connecting and loading after ``$LMDEPLOY_TP_CONNECT_TIMEOUT`` (default 900)."""
    store.set(f'ready/{rank}', '1')
    wait = connect_timeout()
    control = _gloo(dist.PrefixStore('control', store), rank, world_size, host, wait)
    pg = control
    if device.type == 'cuda':
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = wait
        pg = dist.ProcessGroupNCCL(dist.PrefixStore('nccl', store), rank, world_size, opts)
    return TPGroup(rank, world_size, pg, control, step_timeout(), wait)


def report_error(store: dist.Store, rank: int, exc: BaseException) -> None:
    """Leaves this rank's error in the store for rank 0."""
    text = ''.join(traceback.format_exception_only(type(exc), exc)).strip()
    try:
        store.set(f'error/{rank}', text)
    except Exception:  # the store went with rank 0: nobody is left to tell
        pass


def reported_errors(store: dist.Store, world_size: int) -> dict[int, str]:
    """The errors ranks left with :func:`report_error`, by rank."""
    errors = {}
    for rank in range(1, world_size):
        try:
            if store.check([f'error/{rank}']):
                errors[rank] = store.get(f'error/{rank}').decode()
        except Exception:
            break
    return errors


def all_ready(store: dist.Store, ranks: Iterable[int]) -> bool:
    """Whether every rank of ``ranks`` has started to connect."""
    return store.check([f'ready/{rank}' for rank in ranks])
