"""``lmdeploy serve api_server --dp N``: N engine replicas, each an api_server process of its own on
127.0.0.1, ports ``--server-port`` + 1 .. + N, behind a proxy in the parent process on ``--server-port``.

On the CPU each replica is pinned to its share of the cores (and runs that many torch threads) and sizes its
KV cache from its share of the memory; on CUDA each gets one visible device. A replica that dies is started
again (after 1 s, doubling up to a minute while it keeps dying within a minute of its start), and so is one
whose engine failed for good (``/health`` says ``engine_failed``: a tensor-parallel rank died, ...), once
stopped; the proxy takes it back once its health check passes. A replica dies with the parent: the parent
stops them after its own shutdown, and the kernel sends them SIGTERM should the parent die any other way."""
from __future__ import annotations

import argparse
import copy
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import httpx

from lmdeploy.serve.ports import is_free

logger = logging.getLogger('lmdeploy')
PR_SET_PDEATHSIG = 1
STOP_GRACE = 15.0
RESTART_DELAY = 1.0
MAX_RESTART_DELAY = 60.0
STABLE_AFTER = 60.0  # a replica up this long that dies is restarted after RESTART_DELAY again
FAILED_CHECK_INTERVAL = 2.0  # seconds between the checks for replicas whose engine failed


def cpu_shares(n: int) -> list[list[int]]:
    """The cores this process may use, split into ``n`` shares of (nearly) equal size; with fewer cores
    than ``n``, replicas share cores round-robin."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < n:
        logger.warning('--dp %d on %d cores: replicas share cores', n, len(cores))
        return [[cores[i % len(cores)]] for i in range(n)]
    size, extra = divmod(len(cores), n)
    starts = [i * size + min(i, extra) for i in range(n + 1)]
    return [cores[starts[i]:starts[i + 1]] for i in range(n)]


def cuda_devices(n: int) -> list[str]:
    """One visible CUDA device per replica."""
    visible = os.environ.get('CUDA_VISIBLE_DEVICES')
    if visible is None:
        import torch
        devices = [str(i) for i in range(torch.cuda.device_count())]
    else:
        devices = [device for device in visible.split(',') if device.strip()]
    if len(devices) < n:
        raise ValueError(f'--dp {n} needs {n} CUDA devices, {len(devices)} are visible')
    return devices[:n]


def _replica_main(run: Callable[[argparse.Namespace], None], args: argparse.Namespace, cores: list[int] | None,
                  device: str | None, parent: int) -> None:
    """A replica process: dies with ``parent``, keeps to its ``cores`` or CUDA ``device``, serves ``args``."""
    if sys.platform == 'linux':
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the line above took effect
        return
    if cores:
        for thread in os.listdir('/proc/self/task'):
            os.sched_setaffinity(int(thread), cores)
    if device is not None:
        os.environ['CUDA_VISIBLE_DEVICES'] = device
    run(args)
    from lmdeploy.pytorch.child_process import exit_now  # here: the parent imports nothing of lmdeploy.pytorch
    exit_now()  # stopped: without the teardown of torch and the rest, a second the parent would wait


class Replicas:
    """The replica processes: started, watched and restarted when one dies, stopped with the parent."""

    def __init__(self, run: Callable[[argparse.Namespace], None], configs: list[argparse.Namespace],
                 shares: list[list[int] | None], devices: list[str | None]):
        self.run, self.configs, self.shares, self.devices = run, configs, shares, devices
        self.urls = [f'http://127.0.0.1:{config.server_port}' for config in configs]
        self.context = multiprocessing.get_context('spawn')
        self.processes: list[multiprocessing.Process] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # a replica is not started again once stop() began

    def start(self) -> None:
        """Starts every replica."""
        for i in range(len(self.configs)):
            self.processes.append(self._start(i))

    def _start(self, i: int) -> multiprocessing.Process:
        process = self.context.Process(target=_replica_main, name=f'lmdeploy-replica-{i}',
                                       args=(self.run, self.configs[i], self.shares[i], self.devices[i], os.getpid()))
        process.start()
        return process

    def wait_ready(self) -> None:
        """Returns once every replica answers its health check; raises if one exits first."""
        pending = set(self.urls)
        while pending:
            for url, replica in zip(self.urls, self.processes):
                if replica.exitcode is not None:
                    raise RuntimeError(f'replica {replica.name} ({url}) exited with status {replica.exitcode}')
                try:
                    if url in pending and httpx.get(f'{url}/health', timeout=5).status_code == 200:
                        pending.discard(url)
                except httpx.TransportError:
                    pass
            time.sleep(0.2)

    def supervise(self) -> None:
        """Restarts replicas that die, in a daemon thread, until :meth:`stop`."""
        threading.Thread(target=self._watch, name='lmdeploy-replica-watch', daemon=True).start()

    def engine_failed(self, i: int) -> str | None:
        """Why replica ``i``'s engine failed for good (its ``/health`` says ``engine_failed``: a
        tensor-parallel rank died, ...), or None while it runs, starts or answers nothing."""
        try:
            response = httpx.get(f'{self.urls[i]}/health', timeout=5)
            error = response.json().get('error') if response.status_code == 503 else None
        except (httpx.HTTPError, ValueError):
            return None
        return error['message'] if isinstance(error, dict) and error.get('code') == 'engine_failed' else None

    def _stop_failed(self, i: int, stopped: list[float | None], last_check: list[float]) -> None:
        """SIGTERM to replica ``i`` once its engine failed (a replica that serves on would answer every
        request with a 503 forever), SIGKILL if it is still there a grace period later; the restart
        follows its exit."""
        replica, now = self.processes[i], time.monotonic()
        if stopped[i] is not None:
            if now - stopped[i] > self.configs[i].shutdown_timeout + STOP_GRACE:
                replica.kill()
            return
        if now - last_check[i] < FAILED_CHECK_INTERVAL:
            return
        last_check[i] = now
        reason = self.engine_failed(i)
        if reason is not None:
            logger.warning('replica %s (%s) failed (%s): stopping it', replica.name, self.urls[i], reason)
            replica.terminate()
            stopped[i] = now

    def _watch(self) -> None:
        started = [time.monotonic()] * len(self.processes)
        delays = [RESTART_DELAY] * len(self.processes)
        stopped: list[float | None] = [None] * len(self.processes)
        last_check = [0.0] * len(self.processes)
        while not self.stopping.wait(0.5):
            for i, replica in enumerate(self.processes):
                if replica.exitcode is None:
                    self._stop_failed(i, stopped, last_check)
                    continue
                stopped[i] = None
                if time.monotonic() - started[i] > STABLE_AFTER:
                    delays[i] = RESTART_DELAY
                logger.warning('replica %s (%s) exited with status %s: starting it again in %.0f s', replica.name,
                               self.urls[i], replica.exitcode, delays[i])
                if self.stopping.wait(delays[i]):
                    return
                with self.lock:
                    if self.stopping.is_set():
                        return
                    self.processes[i] = self._start(i)
                started[i], delays[i] = time.monotonic(), min(2 * delays[i], MAX_RESTART_DELAY)

    def stop(self, grace: float) -> None:
        """SIGTERM to every replica, SIGKILL to those still running after ``grace`` seconds."""
        with self.lock:
            self.stopping.set()
        for replica in self.processes:
            if replica.is_alive():
                replica.terminate()
        deadline = time.monotonic() + grace
        for replica in self.processes:
            replica.join(max(0.0, deadline - time.monotonic()))
            if replica.is_alive():
                logger.warning('replica %s did not stop within %.0f s: killing it', replica.name, grace)
                replica.kill()
                replica.join()


def run_data_parallel(args: argparse.Namespace, run: Callable[[argparse.Namespace], None]) -> None:
    """Serves ``args`` with ``args.dp`` replicas, each run by ``run`` (the single-replica api_server)."""
    from lmdeploy.serve.proxy.app import create_proxy_app, quiet_signal, run_proxy
    n = args.dp
    taken = [port for port in range(args.server_port + 1, args.server_port + 1 + n) if not is_free(port)]
    if taken:
        raise SystemExit(f'--dp {n} serves its replicas on 127.0.0.1, ports {args.server_port + 1} to '
                         f'{args.server_port + n} (after --server-port); taken: {", ".join(map(str, taken))}')
    on_cuda = args.device.startswith('cuda')
    shares = [None] * n if on_cuda else cpu_shares(n)
    devices = cuda_devices(n) if on_cuda else [None] * n
    configs = []
    for i in range(n):
        replica = copy.copy(args)
        replica.dp, replica.proxy_url, replica.server_name = 1, None, '127.0.0.1'
        replica.server_port = args.server_port + 1 + i
        replica.num_threads = args.num_threads or (len(shares[i]) if shares[i] else None)
        if on_cuda:
            replica.device = 'cuda'
        elif not args.num_gpu_blocks:  # the replicas share the host's memory: each sizes its cache from a share
            replica.cache_max_entry_count = args.cache_max_entry_count / n
        configs.append(replica)
    replicas = Replicas(run, configs, shares, devices)
    # Made before any replica starts: it checks the proxy's settings.
    app = create_proxy_app(replicas.urls, args.routing_strategy, args.api_keys, args.admin_api_keys,
                           args.health_interval, max_request_body_bytes=args.max_request_body_bytes or None)
    try:
        replicas.start()
        replicas.wait_ready()
        replicas.supervise()
        signal.signal(signal.SIGINT, quiet_signal)
        run_proxy(app, args.server_name, args.server_port, args.log_level, args.shutdown_timeout, args.proxy_url,
                  args.proxy_api_key)
    finally:
        replicas.stop(args.shutdown_timeout + STOP_GRACE)
