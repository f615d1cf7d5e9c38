"""Tensor-parallel workers as processes on this machine (``torch.multiprocessing``, 'spawn'), each
bound to its share of the CPUs (or to its GPU), all ended with the engine."""
from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from lmdeploy.pytorch.child_process import die_with_parent, exit_now, main_module_hidden
from lmdeploy.pytorch.distributed.executor import Executor
from lmdeploy.pytorch.distributed.worker import WorkerSpec, run_worker

LOOPBACK = '127.0.0.1'


def _worker_main(spec: WorkerSpec, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    run_worker(spec)
    exit_now()  # a worker that failed raises instead, and exits the usual way with its traceback


def _ending(exitcode: int | None) -> str:
    if exitcode is None:
        return 'ended'
    if exitcode < 0:
        return f'was killed by {signal.Signals(-exitcode).name}'
    return f'exited with code {exitcode}'


class MPExecutor(Executor):
    """Ranks 1..N-1 as spawned processes, connected over the loopback interface."""

    processes: list[mp.Process]

    def _rank0_host(self) -> str:
        return LOOPBACK

    def rank_device(self, rank: int) -> str:
        if self.device.type == 'cpu':
            return 'cpu'
        return f'cuda:{(self.device.index or 0) + rank}'

    def _launch(self, store_host: str, store_port: int) -> None:
        context = mp.get_context('spawn')
        self.processes = []
        for rank in range(1, self.world_size):
            spec = WorkerSpec(rank, self.world_size, store_host, store_port, LOOPBACK, rank, self.world_size,
                              self.rank_device(rank), self.model_path, self.config)
            process = context.Process(target=_worker_main, args=(spec, os.getpid()), daemon=True,
                                      name=f'lmdeploy-tp-rank{rank}')
            with main_module_hidden():
                process.start()
            self.processes.append(process)
        threading.Thread(target=self._watch, name='lmdeploy-tp-watchdog', daemon=True).start()

    def _watch(self) -> None:
        sentinels = {process.sentinel: process for process in self.processes}
        ended = wait(list(sentinels))
        if self._closing:
            return
        process = sentinels[ended[0]]
        process.join(1)
        self._fail(f'rank {self.processes.index(process) + 1} (pid {process.pid}) {_ending(process.exitcode)}')

    def _stop_workers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0))
            if process.is_alive():
                process.kill()
                process.join()

    @property
    def pids(self) -> list[int]:
        """The workers' process ids."""
        return [process.pid for process in self.processes]

