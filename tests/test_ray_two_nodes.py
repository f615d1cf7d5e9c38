"""Two Ray nodes on this machine stand in for two machines: machine A (127.0.0.2, this process, rank 0) and
machine B (127.0.0.3, a ``ray start --address`` node), neither on the usual loopback address 127.0.0.1,
so the ranks' rendezvous and gloo addresses must be the nodes' own. Where ``unshare`` may make a mount
namespace, node B runs in its own, with an empty folder mounted over ``hidden/``: a model there exists
on A only.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import save_tiny_model
from helpers import make_engine, random_prompts, run

from lmdeploy import GenerationConfig
from lmdeploy.pytorch.distributed.parallel_state import WorkerError

HOST_A, HOST_B = '127.0.0.2', '127.0.0.3'
NODE_CPUS = 2
# A cluster that only this machine reaches: loopback addresses, no usage reports, no token auth; and an
# interface that does not exist for gloo, which the engine must not need (it binds the nodes' addresses).
RAY_ENV = {'RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER': '0', 'RAY_USAGE_STATS_ENABLED': '0', 'RAY_AUTH_MODE': 'disabled',
           'GLOO_SOCKET_IFNAME': 'nosuchif0'}
PROMPTS = random_prompts([5, 17, 40, 9], seed=3)
GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)

pytestmark = pytest.mark.slow


def _wait_idle(ray, timeout: float = 120) -> None:
    """Until both nodes are up and every CPU is free (what an engine that closed held is freed a little later)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get('CPU', 0) < 2 * NODE_CPUS:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def _can_unshare() -> bool:
    return shutil.which('unshare') is not None and subprocess.run(
        ['unshare', '-m', '--propagation', 'private', 'true'], capture_output=True).returncode == 0


@pytest.fixture(scope='module')
def two_nodes(tmp_path_factory):
    """A two-node cluster this process is connected to: ``(model, model on A only or None, ray)``."""
    # Imported before Ray, as in any session: it sets up the environment Ray reads once, at its own import.
    pytest.importorskip('lmdeploy.pytorch.distributed.ray_executor', reason='needs Ray')
    import ray
    from ray.cluster_utils import Cluster
    root = tmp_path_factory.mktemp('two_nodes')
    model = save_tiny_model('llama', str(root / 'shared'))
    hidden = root / 'hidden'
    model_on_a = save_tiny_model('llama', str(hidden / 'model'))
    temp_dir = tempfile.mkdtemp(prefix='ray', dir='/tmp')  # short: Ray's socket paths live under it
    log_b = os.path.join(temp_dir, 'node_b.log')
    cluster = node_b = None
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**RAY_ENV, 'RAY_TMPDIR': temp_dir}.items():
            mp.setenv(key, value)
        try:
            cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=NODE_CPUS, node_ip_address=HOST_A,
                                                                        include_dashboard=False))
            isolated = _can_unshare()
            ray_cli = shutil.which('ray', path=os.path.dirname(sys.executable)) or 'ray'  # this Python's Ray
            start_b = f'{ray_cli} start --address {cluster.address} --node-ip-address {HOST_B} --num-cpus {NODE_CPUS}'
            command = (['unshare', '-m', '--propagation', 'private', 'sh', '-c',
                        f'mount -t tmpfs tmpfs {hidden} && exec {start_b} --block'] if isolated
                       else [*start_b.split(), '--block'])
            # `ray start --address` joins only where Ray clusters are enabled
            with open(log_b, 'w') as log:
                node_b = subprocess.Popen(command, env={**os.environ, 'RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER': '1'},
                                          start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
            ray.init(address=cluster.address, _node_ip_address=HOST_A)
            deadline = time.monotonic() + 120
            while len([node for node in ray.nodes() if node['Alive']]) < 2:
                assert node_b.poll() is None and time.monotonic() < deadline, open(log_b).read()
                time.sleep(0.2)
            yield model, model_on_a if isolated else None, ray
        finally:
            ray.shutdown()
            if node_b is not None:
                os.killpg(node_b.pid, signal.SIGTERM)
                node_b.wait(60)
            if cluster is not None:
                cluster.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def test_rank1_spills_to_the_second_machine_and_gives_tp1_tokens(two_nodes):
    """PACK (the default): rank 0 takes all of A's CPUs, so rank 1 goes to B; the gloo group and the step
    inputs cross between the two addresses."""
    model, _, ray = two_nodes
    engine = make_engine(model)
    try:
        expected = run(engine, PROMPTS, GREEDY)
    finally:
        engine.close()
    _wait_idle(ray)
    engine = make_engine(model, tp=2, distributed_executor_backend='ray', num_threads=NODE_CPUS)
    try:
        assert engine.executor.hosts == [HOST_A, HOST_B] and engine.executor.local_world_size == 1
        assert run(engine, PROMPTS, GREEDY) == expected
    finally:
        engine.close()


def test_spread_puts_rank1_on_the_second_machine_where_pack_would_not(two_nodes):
    """A has room for both one-CPU ranks; SPREAD still puts rank 1 on B."""
    model, _, ray = two_nodes
    _wait_idle(ray)
    engine = make_engine(model, tp=2, distributed_executor_backend='ray', num_threads=1,
                         ray_placement_strategy='SPREAD')
    try:
        assert engine.executor.hosts == [HOST_A, HOST_B]
        assert run(engine, PROMPTS[:1], GenerationConfig(max_new_tokens=4, ignore_eos=True))
    finally:
        engine.close()


def test_a_model_missing_on_the_second_machine_fails_fast_naming_path_and_machine(two_nodes):
    _, model_on_a, ray = two_nodes
    if model_on_a is None:
        pytest.skip('unshare cannot make a mount namespace here: both nodes see the same files')
    _wait_idle(ray)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=f'rank 1 on {HOST_B}: model path {model_on_a} does not exist'):
        make_engine(model_on_a, tp=2, distributed_executor_backend='ray', num_threads=NODE_CPUS)
    assert time.monotonic() - start < 30
