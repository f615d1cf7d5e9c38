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
import socket
import tempfile
import threading
import time
from collections import Counter

import psutil

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.child_process import ending, unreaped_exit_code
from lmdeploy.pytorch.distributed.cpu_affinity import allowed_cpus
from lmdeploy.pytorch.distributed.executor import Executor
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
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:
    raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'lmdeploy[ray]'") from exc

logger = logging.getLogger('lmdeploy')
PLACEMENT_TIMEOUT_ENV = 'LMDEPLOY_RAY_PLACEMENT_TIMEOUT'
# The processes of a local cluster without which no rank can be reached or stopped: the GCS (every call of
# the driver's; 60 s after it is lost Ray ends the driver, the whole server) and the raylet (its actors).
CLUSTER_CORE = ('gcs_server', 'raylet')
WATCH_INTERVAL = 0.5
GCS_LOST_AFTER = 3.0  # seconds the GCS of a joined cluster may refuse connections before the engine fails
CLUSTER_CHECK_TIMEOUT = 5.0


def placement_timeout() -> float:
    """Seconds the cluster gets to find room for every rank (``$LMDEPLOY_RAY_PLACEMENT_TIMEOUT``, default 120)."""
    return float(os.environ.get(PLACEMENT_TIMEOUT_ENV, 120))


@ray.remote
class RayWorker:
    """One tensor-parallel rank; :meth:`run` returns when rank 0 stops the group."""

    def where(self) -> tuple[str, int]:
        """This actor's machine (its address in the cluster) and process id."""
        return ray.util.get_node_ip_address(), os.getpid()

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
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
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
                ray.init(_node_ip_address=LOOPBACK, include_dashboard=False, num_cpus=len(allowed_cpus()))
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
    """Ranks 1..N-1 as Ray actors in one placement group."""

    def __init__(self, model_path: str | None, config: PytorchEngineConfig):
        super().__init__(model_path, config)
        self.local_cluster = LocalCluster.join()
        self.cluster_core = self._find_cluster_core() if self.local_cluster else []
        self.gcs_address = None if self.local_cluster else ray.get_runtime_context().gcs_address
        self.cluster_lost = False
        self.cluster_tree: list[psutil.Process] = []  # what the GCS and raylet had started once the actors ran
        self.actors: list = []
        self.runs: list = []
        self.group_placement = None
        self.pids: list[int] = []  # the workers' process ids, on their machines
        self.hosts: list[str] = []  # each rank's machine, by its address in the cluster

    def _rank0_host(self) -> str:
        return ray.util.get_node_ip_address()

    @staticmethod
    def _find_cluster_core() -> list[psutil.Process]:
        """The GCS and raylet of the local cluster this process started (its children)."""
        return [child for child in psutil.Process().children() if child.name() in CLUSTER_CORE]

    def _watch_cluster(self) -> None:
        """Fails the engine as soon as the local cluster's GCS or raylet ends; stops with the engine."""
        while not self._closing:
            for process in self.cluster_core:
                code = unreaped_exit_code(process.pid)
                if code is not None or not psutil.pid_exists(process.pid):
                    self.cluster_lost = True
                    self._fail(f"the local Ray cluster's {process.name()} (pid {process.pid}) {ending(code)}: the "
                               'ranks can no longer be reached')
                    return
            time.sleep(WATCH_INTERVAL)

    def _watch_gcs(self) -> None:
        """Fails the engine once the GCS of the cluster it joined has refused connections for ``GCS_LOST_AFTER``
        seconds (its processes are not this one's to watch); stops with the engine."""
        host, _, port = self.gcs_address.rpartition(':')
        refused_since = None
        while not self._closing:
            try:
                socket.create_connection((host, int(port)), timeout=GCS_LOST_AFTER).close()
                refused_since = None
            except OSError as exc:
                refused_since = refused_since or time.monotonic()
                if time.monotonic() - refused_since >= GCS_LOST_AFTER:
                    self.cluster_lost = True
                    self._fail(f"the Ray cluster's GCS at {self.gcs_address} has not answered for {GCS_LOST_AFTER:g} "
                               f's ({exc}): the ranks can no longer be reached')
                    return
            time.sleep(WATCH_INTERVAL)

    def _bundle(self) -> dict[str, float]:
        if self.device.type == 'cuda':
            return {'GPU': 1}
        return {'CPU': self.config.num_threads or max(1, len(allowed_cpus()) // self.world_size)}

    def _place(self, host: str) -> None:
        bundles = [{**self._bundle(), f'node:{host}': 0.001}] + [self._bundle()] * (self.world_size - 1)
        strategy = self.config.ray_placement_strategy
        self.group_placement = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self.group_placement.ready()], timeout=placement_timeout())
        if not ready:
            nodes = sum(node['Alive'] for node in ray.nodes())
            free = ray.available_resources()  # outside every placement group
            raise RuntimeError(f'the Ray cluster found no room within {placement_timeout():g} s for {self.world_size} '
                               f'ranks of {bundles[1]} each ({strategy}; rank 0 on this machine, {host}); it has '
                               f"{free.get('CPU', 0):g} CPUs and {free.get('GPU', 0):g} GPUs free on {nodes} nodes "
                               '(`ray status` says what holds the rest: another engine?)')

    def _launch(self, store_host: str, store_port: int) -> None:
        self._place(store_host)
        resources = self._bundle()
        for rank in range(1, self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self.group_placement, placement_group_bundle_index=rank)
            self.actors.append(RayWorker.options(num_cpus=resources.get('CPU', 0), num_gpus=resources.get('GPU', 0),
                                                 scheduling_strategy=strategy).remote())
        places = ray.get([actor.where.remote() for actor in self.actors])
        self.pids = [pid for _, pid in places]
        self.hosts = hosts = [store_host] + [host for host, _ in places]
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
        if self.cluster_core:
            self.cluster_tree = [child for core in self.cluster_core for child in core.children(recursive=True)]
            threading.Thread(target=self._watch_cluster, name='lmdeploy-ray-watchdog', daemon=True).start()
        elif self.gcs_address:
            threading.Thread(target=self._watch_gcs, name='lmdeploy-ray-watchdog', daemon=True).start()

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
        except ray.exceptions.RayTaskError as exc:
            reason = f'raised {type(exc.cause).__name__}: {exc.cause}'
        self._fail(f'rank {rank} (Ray actor, pid {self.pids[rank - 1]} on {self.hosts[rank]}) {reason}')

    def _stop_workers(self, timeout: float) -> None:
        if self.cluster_lost and not self.local_cluster:  # disconnected, Ray does not end this process later
            ray.shutdown()
            logger.info('disconnected from the lost Ray cluster')
            return
        if self.cluster_lost:  # every call to the cluster would wait on it: its shutdown ends what is left
            LocalCluster.leave(lost=True)
            for process in self.cluster_tree:  # but not the raylet's agents and actors once it is gone
                with contextlib.suppress(psutil.Error):
                    process.kill()
            return
        if self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        for actor in self.actors:
            ray.kill(actor)
        if self.group_placement is not None:
            remove_placement_group(self.group_placement)
        if self.local_cluster:
            LocalCluster.leave()
