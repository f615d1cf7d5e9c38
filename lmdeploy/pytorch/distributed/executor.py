"""Runs the ranks 1..N-1 of a tensor-parallel engine and watches them; rank 0 is the engine's own
thread. The engine talks to one :class:`Executor`, whichever backend starts the workers."""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from abc import ABC, abstractmethod
from datetime import timedelta

import torch
import torch.distributed as dist

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.child_process import is_stopped
from lmdeploy.pytorch.distributed.channel import StepChannel
from lmdeploy.pytorch.distributed.parallel_state import TPGroup, WorkerError
from lmdeploy.pytorch.distributed.rendezvous import (STEP_TIMEOUT_ENV, all_ready, connect, connect_timeout, host_store,
                                                     reported_errors)

logger = logging.getLogger('lmdeploy')
STOP_TIMEOUT = timedelta(seconds=5)
JOIN_TIMEOUT = 10.0  # seconds a worker gets to exit after the stop message
FAILED_JOIN_TIMEOUT = 1.0  # after a failure: a worker still there is likely hung
TIMED_OUT = 'Timed out'  # how gloo's error for a collective past its timeout begins


class Executor(ABC):
    """Starts the workers (:meth:`start`), notices when one fails (:meth:`check`), stops them all
    (:meth:`shutdown`, also when the engine is dropped without it)."""

    def __init__(self, model_path: str | None, config: PytorchEngineConfig):
        self.model_path = os.path.abspath(os.path.expanduser(model_path)) if model_path is not None else None
        self.config = config
        self.world_size = config.tp
        self.device = torch.device(config.device)
        self.store: dist.TCPStore | None = None
        self.group: TPGroup | None = None
        self.failure: str | None = None
        self.local_world_size = self.world_size  # ranks on rank 0's machine, rank 0 included
        self._closing = False
        self._lock = threading.Lock()

    @abstractmethod
    def _launch(self, store_host: str, store_port: int) -> None:
        """Starts ranks 1..N-1, each to connect to the store at ``store_host:store_port``."""

    @abstractmethod
    def _rank0_host(self) -> str:
        """The address of rank 0's machine that the workers reach."""

    @abstractmethod
    def _stop_workers(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for the workers to exit, then ends those still there."""

    def _fail(self, reason: str) -> None:
        """Called by the watchdog when a worker ended without being told to."""
        with self._lock:
            if self._closing or self.failure is not None:
                return
            errors = reported_errors(self.store, self.world_size) if self.store is not None else {}
            details = ''.join(f'; rank {rank}: {text}' for rank, text in sorted(errors.items())
                              if text.split(': ', 1)[-1] not in reason)  # not what the reason already says
            self.failure = f'{reason}{details}'
        logger.error('tensor-parallel engine failed: %s', self.failure)

    def start(self) -> TPGroup:
        """Launches the workers and connects rank 0 to them; raises :class:`WorkerError` when a worker
        fails before it connects."""
        host = self._rank0_host()
        self.store = host_store(host, self.world_size)
        self._launch(host, self.store.port)
        deadline = time.monotonic() + connect_timeout().total_seconds()
        while not all_ready(self.store, range(1, self.world_size)):
            self.check()
            if time.monotonic() > deadline:
                raise WorkerError(f'tensor-parallel workers did not connect within {connect_timeout()}')
            time.sleep(0.05)
        self.group = connect(self.store, 0, self.world_size, host, self.device)
        return self.group

    def check(self) -> None:
        """Raises :class:`WorkerError` once a worker has failed."""
        if self.failure is not None:
            raise WorkerError(f'tensor-parallel {self.failure}; the engine cannot go on')

    def explain(self, exc: BaseException) -> WorkerError:
        """The error to raise for a collective that failed: why the group broke, where the workers said."""
        # A worker that died broke its connections, and its watchdog report may be on its way; one that let the
        # collective time out is alive (hung), and no report comes.
        timed_out = TIMED_OUT in str(exc)
        deadline = time.monotonic() + (0.0 if timed_out else 2.0)
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if timed_out and self.group is not None:  # gloo names the rank that waited (0), not the one it waited for
            self._fail(f'{self._unanswered()} did not answer within {self.group.timeout.total_seconds():g} s '
                       f'({STEP_TIMEOUT_ENV}): a hung or overloaded worker')
        self._fail(str(exc))
        if self.failure in str(exc):
            return WorkerError(str(exc))
        return WorkerError(f'tensor-parallel {self.failure}; the engine cannot go on ({exc})')

    def local_pids(self) -> dict[int, int]:
        """The process ids of the workers on this machine, by rank."""
        return {}

    def _unanswered(self) -> str:
        """The rank a collective that timed out waited for: the stopped workers of this machine, else rank 1 of
        two, else any (gloo does not say)."""
        stopped = [f'rank {rank} (pid {pid}, stopped)' for rank, pid in self.local_pids().items() if is_stopped(pid)]
        if stopped:
            return ', '.join(stopped)
        return 'rank 1' if self.world_size == 2 else f'a rank of 1..{self.world_size - 1}'

    def shutdown(self) -> None:
        """Tells the workers to stop, waits a little for them, then ends those still running; idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self.group is not None:
            if self.failure is None:
                with contextlib.suppress(Exception):
                    self.group.timeout = STOP_TIMEOUT
                    StepChannel(self.group).stop()
            else:  # a worker may wait for a message that never comes: breaking its connection ends it
                self.group.shutdown()
        self._stop_workers(JOIN_TIMEOUT if self.failure is None else FAILED_JOIN_TIMEOUT)
        if self.group is not None:
            self.group.shutdown()
        self.store = None


def create_executor(model_path: str | None, config: PytorchEngineConfig) -> Executor:
    """The executor of ``config.distributed_executor_backend``: ``mp`` (processes on this machine) or
    ``ray`` (Ray actors, on one machine or several). Each worker resolves ``model_path`` (the path the
    engine was given; None: the default model) on its own machine."""
    if config.distributed_executor_backend == 'ray':
        from lmdeploy.pytorch.distributed.ray_executor import RayExecutor
        return RayExecutor(model_path, config)
    from lmdeploy.pytorch.distributed.mp_executor import MPExecutor
    return MPExecutor(model_path, config)
