"""Tensor-parallel workers as Ray actors, placed by a placement group: on this machine, or across the
machines of a Ray cluster.

It joins the cluster that ``ray.init(address='auto')`` finds (``$RAY_ADDRESS``, or ``ray start`` on
this machine) or starts a local one on the loopback interface, which it shuts down with the engine.
Ray reads whether it may bind the loopback interface when it is imported: when no cluster is to be
joined, this module sets that up (and turns off usage reports and token auth, which a cluster that
only this machine reaches does not need) before it imports Ray.
Bundle 0 of the placement group holds rank 0's share on this machine (the engine's thread uses it; no
actor runs there), so that no worker lands on the cores or the GPU rank 0 computes on. The group's
strategy is ``config.ray_placement_strategy``: ``PACK`` fills this machine first and goes on to others
only when it has no room; ``SPREAD`` puts the ranks on as many machines as it can.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import Counter

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.distributed.executor import Executor
from lmdeploy.pytorch.distributed.worker import WorkerSpec, run_worker

LOOPBACK = '127.0.0.1'
LOCAL_CLUSTER_ENV = {'RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER': '0', 'RAY_USAGE_STATS_ENABLED': '0',
                     'RAY_AUTH_MODE': 'disabled'}


def cluster_configured() -> bool:
    """Whether ``ray.init(address='auto')`` has a cluster to join: ``$RAY_ADDRESS``, or one that
    ``ray start`` started on this machine (it leaves its address in Ray's temporary folder)."""
    temp_dir = os.environ.get('RAY_TMPDIR') or tempfile.gettempdir()
    return bool(os.environ.get('RAY_ADDRESS')) or os.path.exists(os.path.join(temp_dir, 'ray', 'ray_current_cluster'))


if not cluster_configured():
    for _key, _value in LOCAL_CLUSTER_ENV.items():
        os.environ.setdefault(_key, _value)

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:
    raise ImportError("distributed_executor_backend='ray' needs Ray: pip install 'lmdeploy[ray]'") from exc

logger = logging.getLogger('lmdeploy')
PLACEMENT_TIMEOUT_ENV = 'LMDEPLOY_RAY_PLACEMENT_TIMEOUT'


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


def connect_cluster() -> bool:
    """Connects this process to a Ray cluster; True when it had to start a local one."""
    if ray.is_initialized():
        return False
    try:
        ray.init(address='auto')
        return False
    except ConnectionError:
        pass
    ray.init(_node_ip_address=LOOPBACK, include_dashboard=False, num_cpus=len(os.sched_getaffinity(0)))
    logger.info('started a local Ray cluster on %s', LOOPBACK)
    return True


class RayExecutor(Executor):
    """Ranks 1..N-1 as Ray actors in one placement group."""

    def __init__(self, model_path: str | None, config: PytorchEngineConfig):
        super().__init__(model_path, config)
        self.started_cluster = connect_cluster()
        self.actors: list = []
        self.runs: list = []
        self.group_placement = None
        self.pids: list[int] = []  # the workers' process ids, on their machines
        self.hosts: list[str] = []  # each rank's machine, by its address in the cluster

    def _rank0_host(self) -> str:
        return ray.util.get_node_ip_address()

    def _bundle(self) -> dict[str, float]:
        if self.device.type == 'cuda':
            return {'GPU': 1}
        return {'CPU': self.config.num_threads or max(1, len(os.sched_getaffinity(0)) // self.world_size)}

    def _place(self, host: str) -> None:
        bundles = [{**self._bundle(), f'node:{host}': 0.001}] + [self._bundle()] * (self.world_size - 1)
        strategy = self.config.ray_placement_strategy
        self.group_placement = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self.group_placement.ready()], timeout=placement_timeout())
        if not ready:
            nodes = sum(node['Alive'] for node in ray.nodes())
            raise RuntimeError(f'the Ray cluster found no room within {placement_timeout():g} s for {self.world_size} '
                               f'ranks of {bundles[1]} each ({strategy}; rank 0 on this machine, {host}); it has '
                               f'{ray.available_resources()} free on {nodes} nodes')

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
        self._fail(f'rank {rank} (Ray actor) {reason}')

    def _stop_workers(self, timeout: float) -> None:
        if self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        for actor in self.actors:
            ray.kill(actor)
        if self.group_placement is not None:
            remove_placement_group(self.group_placement)
        if self.started_cluster:
            ray.shutdown()
