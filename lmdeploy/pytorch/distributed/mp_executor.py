"""Tensor-parallel workers as processes on this machine (``torch.multiprocessing``, 'spawn' or 'forkserver'),
each bound to its share of the CPUs (or to its GPU), all ended with the engine."""
from __future__ import annotations

import os
import threading
import time
from multiprocessing import forkserver
from multiprocessing.connection import wait

import psutil
import torch.multiprocessing as mp

from lmdeploy.messages import ConfigError, PytorchEngineConfig
from lmdeploy.pytorch.child_process import die_with_parent, ending, exit_now, main_module_hidden, unreaped_exit_code
from lmdeploy.pytorch.distributed.cpu_affinity import allowed_cpus
from lmdeploy.pytorch.distributed.executor import Executor
from lmdeploy.pytorch.distributed.worker import WorkerSpec, run_worker

LOOPBACK = '127.0.0.1'
START_METHOD_ENV = 'LMDEPLOY_TP_START_METHOD'
START_METHODS = ('spawn', 'forkserver')
FORKSERVER_LOST = 255  # a forkserver's child's exit code when the forkserver cannot tell it (it died)
# What the forkserver imports once; each worker forked from it starts with them loaded (the model's config
# class too: the GGUF reader imports Llama's, and with it most of what transformers' config classes need).
FORKSERVER_PRELOAD = [__name__, 'lmdeploy.pytorch.weights.gguf']


def start_method() -> str:
    """How workers start (``$LMDEPLOY_TP_START_METHOD``): 'spawn' (default), a fresh interpreter that imports
    torch and the engine each time, or 'forkserver', forked from a process that imported them once (the first
    engine's workers start as slowly, later ones at once; the server stays, with its imports, until this
    process ends)."""
    method = os.environ.get(START_METHOD_ENV, 'spawn')
    if method not in START_METHODS:
        raise ConfigError(f"{START_METHOD_ENV} is 'spawn' or 'forkserver', got {method!r}")
    return method


def _worker_main(spec: WorkerSpec, parent_pid: int, environ: dict[str, str], cpus: set[int]) -> None:
    die_with_parent(parent_pid)
    # A forkserver's child starts with the environment and CPUs the server had, not the engine's now.
    os.environ.clear()
    os.environ.update(environ)
    os.sched_setaffinity(0, cpus)
    run_worker(spec)
    exit_now()  # a worker that failed raises instead, and exits the usual way with its traceback


class MPExecutor(Executor):
    """Ranks 1..N-1 as processes started the :func:`start_method` way, connected over the loopback interface."""

    processes: list[mp.Process]

    def __init__(self, model_path: str | None, config: PytorchEngineConfig):
        super().__init__(model_path, config)
        self.start_method = start_method()  # a bad one is refused before anything starts
        self.forkserver_pid: int | None = None

    def _rank0_host(self) -> str:
        return LOOPBACK

    def rank_device(self, rank: int) -> str:
        if self.device.type == 'cpu':
            return 'cpu'
        return f'cuda:{(self.device.index or 0) + rank}'

    def _launch(self, store_host: str, store_port: int) -> None:
        context = mp.get_context(self.start_method)
        parent = os.getpid()
        if self.start_method == 'forkserver':
            context.set_forkserver_preload(FORKSERVER_PRELOAD)  # used when the server starts, the first time
            forkserver.ensure_running()
            parent = self.forkserver_pid = forkserver._forkserver._forkserver_pid  # exits when this process does
        self.processes = []
        for rank in range(1, self.world_size):
            spec = WorkerSpec(rank, self.world_size, store_host, store_port, LOOPBACK, rank, self.world_size,
                              self.rank_device(rank), self.model_path, self.config)
            args = (spec, parent, dict(os.environ), allowed_cpus())
            process = context.Process(target=_worker_main, args=args, daemon=True, name=f'lmdeploy-tp-rank{rank}')
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
        self._fail(f'rank {self.processes.index(process) + 1} (pid {process.pid}) {self._ending(process)}')

    def _ending(self, process: mp.Process) -> str:
        """How ``process`` ended. A forkserver that dies takes its workers with it (the kernel kills them:
        :func:`die_with_parent`), and ``multiprocessing`` then reports exit code 255 for each."""
        if process.exitcode != FORKSERVER_LOST or self.forkserver_pid is None:
            return ending(process.exitcode)
        server = self._forkserver_exit_code(timeout=1.0)
        if server is None and psutil.pid_exists(self.forkserver_pid):
            return ending(process.exitcode)
        how = f', which {ending(server)}' if server is not None else ''
        return f'was killed by SIGKILL when its forkserver (pid {self.forkserver_pid}) died{how}'

    def _forkserver_exit_code(self, timeout: float) -> int | None:
        """The forkserver's exit code once it ended (it closes its pipes a moment before); None while it runs."""
        deadline = time.monotonic() + timeout
        while (code := unreaped_exit_code(self.forkserver_pid)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return code

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

    def local_pids(self) -> dict[int, int]:
        return dict(enumerate(self.pids, start=1))

