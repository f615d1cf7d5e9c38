"""Tensor-parallel workers as Ray actors, placed by a placement group: on this machine, or across the
machines of a Ray cluster.

It joins the cluster that ``ray.init(address='auto')`` finds (``$RAY_ADDRESS``, or ``ray start`` on
this machine) or starts a local one on the loopback interface, which it shuts down with the engine.
Ray reads whether it may bind the loopback interface when it is imported: when no cluster is to be
joined, this module sets that up (and turns off usage reports and token auth, which a cluster that
only this machine reaches does not need) before it imports Ray. Every engine of this process uses that
local cluster; the last to close shuts it down.
Bundle 0 of the placement group holds rank 0's share on this machine (the engine's thread uses it; no
actor runs there), so that no worker lands on the cores or the GPU rank 0 computes on. The group's
strategy is ``config.ray_placement_strategy``: ``PACK`` fills this machine first and goes on to others
only when it has no room; ``SPREAD`` puts the ranks on as many machines as it can.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections import Counter

import psutil

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.child_process import ending, is_stopped, unreaped_exit_code
from lmdeploy.pytorch.distributed.cpu_affinity import allowed_cpus
from lmdeploy.pytorch.distributed.executor import Executor
from lmdeploy.pytorch.distributed.parallel_state import WorkerError
from lmdeploy.pytorch.distributed.rendezvous import CONNECT_TIMEOUT_ENV, connect_timeout
from lmdeploy.pytorch.distributed.worker import WorkerSpec, run_worker

LOOPBACK = '127.0.0.1'
LOCAL_CLUSTER_ENV = {'RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER': '0', 'RAY_USAGE_STATS_ENABLED': '0',
                     'RAY_AUTH_MODE': 'disabled'}


def address_file() -> str:
    """Where ``ray start`` leaves its cluster's address on this machine (``ray stop`` removes it)."""
    return os.path.join(os.environ.get('RAY_TMPDIR') or tempfile.gettempdir(), 'ray', 'ray_current_cluster')


def cluster_configured() -> bool:
    """Whether ``ray.init(address='auto')`` has a cluster to join: ``$RAY_ADDRESS``, or one that
    ``ray start`` started on this machine."""
    return bool(os.environ.get('RAY_ADDRESS')) or os.path.exists(address_file())


if not cluster_configured():
    for _key, _value in LOCAL_CLUSTER_ENV.items():
        os.environ.setdefault(_key, _value)
# Ray's failure signal handlers would replace this process's SIGTERM handler at the C level, and ray.shutdown()
# (on the engine's thread, from which Python cannot set a handler again) puts back the default: a server's
# SIGTERM would then end it at once instead of draining it.
os.environ.setdefault('RAY_DISABLE_FAILURE_SIGNAL_HANDLER', '1')

try:
    import ray
    from ray._raylet import InnerGcsClient, NodeID
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:
    raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'lmdeploy[ray]'") from exc

logger = logging.getLogger('lmdeploy')
PLACEMENT_TIMEOUT_ENV = 'LMDEPLOY_RAY_PLACEMENT_TIMEOUT'
HEALTH_TIMEOUT_ENV = 'LMDEPLOY_RAY_HEALTH_TIMEOUT'
# The processes of a local cluster without which no rank can be reached or stopped: the GCS (every call of
# the driver's; 60 s after it is lost Ray ends the driver, the whole server) and the raylet (its actors).
CLUSTER_CORE = ('gcs_server', 'raylet')
WATCH_INTERVAL = 0.5
CALL_TIMEOUT = 1.0  # seconds one health call may take; the watchdog asks again until health_timeout()
CLUSTER_CHECK_TIMEOUT = 5.0


def placement_timeout() -> float:
    """Seconds the cluster gets to find room for every rank (``$LMDEPLOY_RAY_PLACEMENT_TIMEOUT``, default 120)."""
    return float(os.environ.get(PLACEMENT_TIMEOUT_ENV, 120))


def health_timeout() -> float:
    """Seconds the cluster's GCS or a rank's actor may leave the engine's health checks unanswered before the
    engine fails (``$LMDEPLOY_RAY_HEALTH_TIMEOUT``, default 10); on a local cluster, also the seconds the GCS
    gives a raylet that misses its health checks before it declares it dead."""
    return float(os.environ.get(HEALTH_TIMEOUT_ENV, 10))


def local_health_checks() -> dict[str, int]:
    """The GCS's checks of the raylets of a local cluster (Ray's ``_system_config``): one a second, a raylet
    that misses :func:`health_timeout` of them in a row is dead (Ray's defaults take about a minute)."""
    return {'health_check_period_ms': 1000, 'health_check_timeout_ms': 1000,
            'health_check_failure_threshold': max(1, round(health_timeout()))}


def stopped_mark(pid: int) -> str:
    """', stopped' for a process of this machine that is stopped (SIGSTOP), else ''."""
    return ', stopped' if is_stopped(pid) else ''


@ray.remote(concurrency_groups={'health': 1})
class RayWorker:
    """One tensor-parallel rank; :meth:`run` returns when rank 0 stops the group."""

    @ray.method(concurrency_group='health')
    def where(self) -> tuple[str, int, str]:
        """This actor's machine (its address in the cluster), process id and Ray node id; answered while
        :meth:`run` runs (on a thread of its own), so that it also tells whether the actor still answers."""
        return ray.util.get_node_ip_address(), os.getpid(), ray.get_runtime_context().get_node_id()

    def run(self, spec: WorkerSpec) -> None:
        run_worker(spec)


def check_configured_cluster(timeout: float = CLUSTER_CHECK_TIMEOUT) -> None:
    """Raises ``ConnectionError`` when the cluster that ``$RAY_ADDRESS`` or ``ray start``'s address file names
    does not answer: ``ray.init`` would retry for minutes."""
    configured = os.environ.get('RAY_ADDRESS', '')
    source = 'RAY_ADDRESS'
    if not configured and os.path.exists(address_file()):
        with open(address_file()) as file:
            configured = file.read().strip()
        source = f'{address_file()} (left by `ray start`; `ray stop` removes it)'
    host, _, port = configured.rpartition(':')
    if not host or not port.isdigit() or '://' in configured:  # 'auto', 'local', a Ray Client URL: Ray's own
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()  # refused at once: no GCS client
        InnerGcsClient.standalone(configured, None, int(timeout * 1000)).check_alive([], timeout=timeout)
    except (OSError, ray.exceptions.RpcError) as exc:
        raise ConnectionError(f'no Ray cluster answers at {configured}, the address {source} names ({exc}); start '
                              'it (`ray start --head`), fix the address, or unset it to let the engine start a '
                              'local cluster') from exc


class LocalCluster:
    """The local cluster this process started, if any, and how many engines use it: the last to close shuts
    it down (the first to close did, under the others)."""

    lock = threading.Lock()
    engines = 0

    @classmethod
    def join(cls) -> bool:
        """Connects this process to a Ray cluster; True when it is a local cluster this process started (now
        or for an engine still open), which this engine must :meth:`leave`."""
        with cls.lock:
            if ray.is_initialized():
                if cls.engines == 0:
                    return False  # whoever called ray.init owns it
            else:
                check_configured_cluster()
                try:
                    ray.init(address='auto')
                    return False
                except ConnectionError:
                    pass
                ray.init(_node_ip_address=LOOPBACK, include_dashboard=False, num_cpus=len(allowed_cpus()),
                         _system_config=local_health_checks())
                logger.info('started a local Ray cluster on %s', LOOPBACK)
            cls.engines += 1
            return True

    @classmethod
    def leave(cls, lost: bool = False) -> None:
        """One engine less; shuts the cluster down after the last, or at once when it is ``lost``."""
        with cls.lock:
            cls.engines = max(cls.engines - 1, 0)
            if cls.engines == 0 or lost:
                ray.shutdown()


class RayExecutor(Executor):
    """Ranks 1..N-1 as Ray actors in one placement group, watched (:meth:`_watch_cluster`) from before they start
    until the engine closes."""

    def __init__(self, model_path: str | None, config: PytorchEngineConfig):
        super().__init__(model_path, config)
        self.local_cluster = LocalCluster.join()
        self.cluster_core = self._find_cluster_core() if self.local_cluster else {}
        self.gcs_address = ray.get_runtime_context().gcs_address
        self.cluster_lost = False
        self.cluster_tree: list[psutil.Process] = []  # what the GCS and raylet had started once the actors ran
        self.actors: list = []
        self.runs: list = []
        self.group_placement = None
        self.pids: list[int] = []  # the workers' process ids, on their machines
        self.hosts: list[str] = [self._rank0_host()]  # each rank's machine, by its address in the cluster
        self.node_ids: list[str] = [ray.get_runtime_context().get_node_id()]  # each rank's Ray node
        self.watchdog = threading.Thread(target=self._watch_cluster, name='lmdeploy-ray-watchdog', daemon=True)

    def _rank0_host(self) -> str:
        return ray.util.get_node_ip_address()

    @staticmethod
    def _find_cluster_core() -> dict[str, int]:
        """The process ids of the GCS and raylet of the local cluster this process started (its children)."""
        return {child.name(): child.pid for child in psutil.Process().children() if child.name() in CLUSTER_CORE}

    def _watch_cluster(self) -> None:
        """Fails the engine as soon as the GCS or raylet of a local cluster ends, or once the cluster's GCS, a
        rank's raylet or a rank's actor has not answered for :func:`health_timeout` seconds (hung, stopped or
        gone); stops with the engine."""
        answered, error = time.monotonic(), None
        pings: dict[int, tuple[ray.ObjectRef, float]] = {}  # rank: its health call in flight, sent when
        while not self._closing and self.failure is None:
            try:
                alive = self._nodes_alive()
                answered = time.monotonic()
            except ray.exceptions.RpcError as exc:
                alive, error = [], exc
            lost = self._core_ended() or self._dead_node(alive)
            if lost is None and time.monotonic() - answered >= health_timeout():
                lost = (f"the Ray cluster's GCS at {self.gcs_address}{self._core_process('gcs_server')} has not "
                        f'answered for {health_timeout():g} s ({error}): the ranks can no longer be reached')
            if lost is not None:
                self.cluster_lost = True
                self._fail(lost)
                return
            hung = self._unanswered_rank(pings)
            if hung is not None:
                rank, reason = hung
                self._fail(reason)
                ray.kill(self.actors[rank - 1])  # ends rank 0's collective that waits on it: a step in flight fails now
                return
            time.sleep(WATCH_INTERVAL)

    def _nodes_alive(self) -> list[bool]:
        """Whether the GCS holds each rank's node alive; raises ``RpcError`` when it does not answer in time."""
        gcs = ray._private.worker.global_worker.gcs_client
        return gcs.check_alive([NodeID.from_hex(node) for node in self.node_ids], timeout=CALL_TIMEOUT)

    def _core_process(self, name: str) -> str:
        """', the local cluster's NAME (pid ...)' when this process started the cluster, else ''."""
        pid = self.cluster_core.get(name)
        return f" (the local cluster's {name}, pid {pid}{stopped_mark(pid)})" if pid is not None else ''

    def _core_ended(self) -> str | None:
        for name, pid in self.cluster_core.items():
            code = unreaped_exit_code(pid)
            if code is not None or not psutil.pid_exists(pid):
                return f"the local Ray cluster's {name} (pid {pid}) {ending(code)}: the ranks can no longer be reached"
        return None

    def _dead_node(self, alive: list[bool]) -> str | None:
        """Why the engine failed when the GCS holds a rank's node dead (its raylet missed the GCS's health checks)."""
        for rank, node_alive in enumerate(alive):
            if not node_alive:
                pid = self.cluster_core.get('raylet')
                raylet = f"the local cluster's raylet, pid {pid}{stopped_mark(pid)}" if pid else 'its raylet'
                return (f'the Ray node of rank {rank} ({self.node_ids[rank][:12]} on {self.hosts[rank]}; {raylet}) '
                        "missed the GCS's health checks and was declared dead: the ranks can no longer be reached")
        return None

    def _unanswered_rank(self, pings: dict[int, tuple[ray.ObjectRef, float]]) -> tuple[int, str] | None:
        """Asks each rank's actor whether it answers (one call in flight per rank); the first rank that has not
        answered for :func:`health_timeout` seconds, and why it failed. A dead actor's call is answered with its
        death, which :meth:`_watch` reports."""
        now = time.monotonic()
        for rank, actor in enumerate(self.actors[:len(self.pids)], start=1):
            ref, sent = pings.get(rank) or (actor.where.remote(), now)
            if ray.wait([ref], timeout=0)[0]:
                pings.pop(rank, None)
            elif now - sent >= health_timeout():
                pid, host = self.pids[rank - 1], self.hosts[rank]
                state = stopped_mark(pid) if rank in self.local_pids() else ''
                return rank, (f'rank {rank} (Ray actor, pid {pid} on {host}{state}) has not answered for '
                              f'{health_timeout():g} s ({HEALTH_TIMEOUT_ENV}): a hung or stopped worker')
            else:
                pings[rank] = (ref, sent)
        return None

    def local_pids(self) -> dict[int, int]:
        return {rank: pid for rank, pid in enumerate(self.pids, start=1) if self.hosts[rank] == self.hosts[0]}

    def _bundle(self) -> dict[str, float]:
        if self.device.type == 'cuda':
            return {'GPU': 1}
        return {'CPU': self.config.num_threads or max(1, len(allowed_cpus()) // self.world_size)}

    def _wait(self, refs: list, timeout: float) -> bool:
        """Whether ``refs`` are all ready within ``timeout`` seconds; raises :class:`WorkerError` as soon as the
        watchdog fails the engine (a hung GCS or raylet never makes them ready)."""
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            left = deadline - time.monotonic()
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(max(left, 0), WATCH_INTERVAL))
            if len(ready) == len(refs):
                return True
            if left <= 0:
                return False

    def _place(self, host: str) -> None:
        bundles = [{**self._bundle(), f'node:{host}': 0.001}] + [self._bundle()] * (self.world_size - 1)
        strategy = self.config.ray_placement_strategy
        self.group_placement = placement_group(bundles, strategy=strategy)
        if not self._wait([self.group_placement.ready()], placement_timeout()):
            nodes = sum(node['Alive'] for node in ray.nodes())
            free = ray.available_resources()  # outside every placement group
            raise RuntimeError(f'the Ray cluster found no room within {placement_timeout():g} s for {self.world_size} '
                               f'ranks of {bundles[1]} each ({strategy}; rank 0 on this machine, {host}); it has '
                               f"{free.get('CPU', 0):g} CPUs and {free.get('GPU', 0):g} GPUs free on {nodes} nodes "
                               '(`ray status` says what holds the rest: another engine?)')

    def _launch(self, store_host: str, store_port: int) -> None:
        self.watchdog.start()
        self._place(store_host)
        resources = self._bundle()
        for rank in range(1, self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self.group_placement, placement_group_bundle_index=rank)
            self.actors.append(RayWorker.options(num_cpus=resources.get('CPU', 0), num_gpus=resources.get('GPU', 0),
                                                 scheduling_strategy=strategy).remote())
        calls = [actor.where.remote() for actor in self.actors]
        if not self._wait(calls, connect_timeout().total_seconds()):
            raise WorkerError(f'the Ray actors of ranks 1..{self.world_size - 1} did not start within '
                              f'{connect_timeout()} ({CONNECT_TIMEOUT_ENV})')
        places = ray.get(calls)  # in this order: the watchdog reads a rank's host by its node, its pid by its host
        self.hosts = hosts = [store_host] + [host for host, _, _ in places]
        self.pids = [pid for _, pid, _ in places]
        self.node_ids = self.node_ids + [node for _, _, node in places]
        logger.info('tensor-parallel ranks 0..%d on %s', self.world_size - 1, ', '.join(hosts))
        per_host = Counter(hosts)
        self.local_world_size = per_host[store_host]
        device = 'cuda:0' if self.device.type == 'cuda' else 'cpu'  # Ray shows each GPU actor its own GPU
        for rank, actor in enumerate(self.actors, start=1):
            local_rank = hosts[:rank].count(hosts[rank])
            spec = WorkerSpec(rank, self.world_size, store_host, store_port, hosts[rank], local_rank,
                              per_host[hosts[rank]], device, self.model_path, self.config)
            self.runs.append(actor.run.remote(spec))
        threading.Thread(target=self._watch, name='lmdeploy-tp-watchdog', daemon=True).start()
        self.cluster_tree = [child for pid in self.cluster_core.values() if psutil.pid_exists(pid)
                             for child in psutil.Process(pid).children(recursive=True)]

    def _watch(self) -> None:
        ready, _ = ray.wait(self.runs, num_returns=1, timeout=None)
        if self._closing:
            return
        rank = self.runs.index(ready[0]) + 1
        try:
            ray.get(ready[0])
            reason = 'returned before it was told to stop'
        except ray.exceptions.RayActorError as exc:
            reason = f'died ({type(exc).__name__}: {str(exc).splitlines()[0]})'
            with contextlib.suppress(ray.exceptions.RpcError):
                lost = self._dead_node(self._nodes_alive())  # a raylet declared dead takes its actors
                if lost is not None:
                    self.cluster_lost = True
                    self._fail(lost)
                    return
        except ray.exceptions.RayTaskError as exc:
            reason = f'raised {type(exc.cause).__name__}: {exc.cause}'
        self._fail(f'rank {rank} (Ray actor, pid {self.pids[rank - 1]} on {self.hosts[rank]}) {reason}')

    def _stop_workers(self, timeout: float) -> None:
        if self.watchdog.is_alive():  # before Ray shuts down under its calls
            self.watchdog.join(CALL_TIMEOUT + WATCH_INTERVAL + 1)
        if self.cluster_lost and not self.local_cluster:  # disconnected, Ray does not end this process later
            ray.shutdown()
            logger.info('disconnected from the lost Ray cluster')
            return
        if self.cluster_lost:  # every call to the cluster would wait on it: its processes go, then Ray
            for pid in self.cluster_core.values():  # SIGKILL: a stopped process would keep a SIGTERM pending
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for process in self.cluster_tree:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            LocalCluster.leave(lost=True)
            return
        if self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        for actor in self.actors:
            ray.kill(actor)
        if self.group_placement is not None:
            remove_placement_group(self.group_placement)
        if self.local_cluster:
            LocalCluster.leave()
