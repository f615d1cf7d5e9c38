"""Tensor-parallel workers as Ray actors on a local Ray cluster (loopback only), which the engines of a
process share: tp=1's tokens, and a killed actor fails the engine fast, naming its process; so does the loss
of the cluster's GCS (of a local cluster or one joined), which Ray would otherwise answer by ending this whole
process a minute later, and a server whose cluster was lost still drains on SIGTERM. A GCS, raylet or actor
that hangs (SIGSTOP) fails the engine within seconds too, naming it, and so does a GCS that hangs at start-up.
Neither the actors nor the cluster outlive the engine, nor is anything left stopped."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from helpers import assert_gone, make_engine, random_prompts, run
from server_helpers import free_port, wait_healthy

from lmdeploy import GenerationConfig
from lmdeploy.pytorch.distributed.parallel_state import WorkerError

PROMPTS = random_prompts([5, 17, 40, 9], seed=3)
GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)


def test_ray_tp2_matches_tp1_and_a_killed_actor_fails_fast(tiny_llama, monkeypatch):
    """Two engines share the local cluster the first started (given room for both: 4 CPUs here). The first's actor
    SIGSTOPped (hung, not dead) while it serves: within seconds the first fails naming it (the stopped GCS's and
    raylet's test, whose cluster this one shares; before, a stopped actor failed only the next step, after
    ``LMDEPLOY_TP_TIMEOUT``) and closes within seconds, the stopped actor gone. Closing the first leaves the second
    serving (before, it shut the cluster down under the second), which gives tp=1's tokens until its actor is
    killed. (One cluster for both actors: a cluster's start is most of such a test's time.)"""
    monkeypatch.delenv('RAY_ADDRESS', raising=False)
    engine = make_engine(tiny_llama)
    try:
        expected = run(engine, PROMPTS, GREEDY)
    finally:
        engine.close()
    pytest.importorskip('lmdeploy.pytorch.distributed.ray_executor')  # sets up the environment Ray reads
    import ray
    init = ray.init
    monkeypatch.setattr(ray, 'init', lambda **kwargs: init(**{**kwargs, 'num_cpus': 4} if 'num_cpus' in kwargs
                                                            else kwargs))
    monkeypatch.setenv('LMDEPLOY_RAY_HEALTH_TIMEOUT', '3')
    monkeypatch.setenv('LMDEPLOY_TP_TIMEOUT', '60')  # a stopped actor is not found by a step's timeout
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    allowed = os.sched_getaffinity(0)
    first = make_engine(tiny_llama, tp=2, distributed_executor_backend='ray')
    try:
        engine = make_engine(tiny_llama, tp=2, distributed_executor_backend='ray')
    except BaseException:
        first.close()
        raise
    cluster = [child.pid for child in psutil.Process().children(recursive=True) if child.pid not in before]
    try:
        (stopped,) = first.executor.pids
        resume = threading.Timer(90, os.kill, (stopped, signal.SIGCONT))  # an engine that hangs on it ends the test
        try:
            run(first, PROMPTS[:1], GREEDY)
            os.kill(stopped, signal.SIGSTOP)
            resume.start()
            start = time.monotonic()
            with pytest.raises(WorkerError, match=STOPPED['actor'].format(pid=stopped)):
                while True:
                    run(first, PROMPTS[:1], GREEDY)
                    assert time.monotonic() - start < 40, 'the stopped actor was not noticed'
            assert time.monotonic() - start < 30
        finally:
            start = time.monotonic()
            first.close()
            closed = time.monotonic() - start
            resume.cancel()
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        assert closed < 30
        assert_gone([stopped], timeout=30)
        assert ray.is_initialized() and ray.util.get_node_ip_address() == '127.0.0.1'
        assert run(engine, PROMPTS, GREEDY) == expected
        (pid,) = engine.executor.pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=rf'rank 1 \(Ray actor, pid {pid} on 127\.0\.0\.1\) died'):
            run(engine, PROMPTS, GREEDY)
        assert time.monotonic() - start < 5
    finally:
        engine.close()
    assert os.sched_getaffinity(0) == allowed  # closed in the order they started (before: left on rank 0's CPUs)
    assert not ray.is_initialized()
    assert_gone(cluster + [pid], timeout=30)


@pytest.mark.slow
def test_a_second_engine_is_refused_and_a_lost_gcs_fails_the_engine_fast(tiny_llama, monkeypatch):
    """A second engine while the first holds the cluster's CPUs: refused after ``LMDEPLOY_RAY_PLACEMENT_TIMEOUT``,
    saying what is free (before: every placement group's own resources, unreadable), its pending group removed.
    Then the local cluster's GCS SIGKILLed: the engine fails within a second or two naming it (before, the
    engine served on, its close waited on the GCS, and Ray ended this process 60 s after the loss)."""
    monkeypatch.delenv('RAY_ADDRESS', raising=False)
    before = {child.pid for child in psutil.Process().children(recursive=True)}  # earlier tests' (a suite's run)
    engine = make_engine(tiny_llama, tp=2, distributed_executor_backend='ray')
    try:
        monkeypatch.setenv('LMDEPLOY_RAY_PLACEMENT_TIMEOUT', '2')
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"no room within 2 s for 2 ranks of \{'CPU': 1\} each \(PACK; rank 0 "
                                               r'on this machine, 127\.0\.0\.1\); it has 0 CPUs and 0 GPUs free on 1 '
                                               r'nodes \(`ray status`'):
            make_engine(tiny_llama, tp=2, distributed_executor_backend='ray')  # the first holds the cluster's CPUs
        assert time.monotonic() - start < 15
        import ray
        assert {group['state'] for group in ray.util.placement_group_table().values()} == {'CREATED', 'REMOVED'}
        cluster = [child.pid for child in psutil.Process().children(recursive=True) if child.pid not in before]
        (gcs,) = [child.pid for child in psutil.Process().children() if child.name() == 'gcs_server']
        os.kill(gcs, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=rf"local Ray cluster's gcs_server \(pid {gcs}\) was killed by SIGKILL"):
            while True:
                run(engine, PROMPTS[:1], GREEDY)
        assert time.monotonic() - start < 5
    finally:
        start = time.monotonic()
        engine.close()
    assert time.monotonic() - start < 30
    assert_gone(cluster, timeout=30)


STOPPED = {  # the stopped process, and what the engine's error says (health timeout 3 s)
    'gcs_server': r"the Ray cluster's GCS at 127\.0\.0\.1:\d+ \(the local cluster's gcs_server, pid {pid}, stopped\) "
                  r'has not answered for 3 s',
    'raylet': r"the Ray node of rank 0 \(\w+ on 127\.0\.0\.1; the local cluster's raylet, pid {pid}, stopped\) missed "
              r"the GCS's health checks and was declared dead",
    'actor': r'rank 1 \(Ray actor, pid {pid} on 127\.0\.0\.1, stopped\) has not answered for 3 s '
             r'\(LMDEPLOY_RAY_HEALTH_TIMEOUT\): a hung or stopped worker',
}


@pytest.mark.slow
@pytest.mark.parametrize('stopped', ['gcs_server', 'raylet'])
def test_a_stopped_gcs_raylet_or_actor_fails_the_engine_naming_it(tiny_llama, monkeypatch, stopped):
    """The local cluster's GCS or its raylet SIGSTOPped (hung, not dead) while the engine serves: within seconds the
    engine fails naming the stopped process (``LMDEPLOY_RAY_HEALTH_TIMEOUT`` 3 s; the raylet after the GCS's own
    health checks, which a local cluster runs every second), and it closes within seconds, leaving nothing, the
    stopped process included. Before, a stopped GCS was not noticed (the ranks talk over gloo) and the close waited
    on it for ever; a stopped raylet was taken for the actor's death a minute later and the close waited on it too.
    (A stopped actor: :func:`test_ray_tp2_matches_tp1_and_a_killed_actor_fails_fast`.)"""
    monkeypatch.delenv('RAY_ADDRESS', raising=False)
    monkeypatch.setenv('LMDEPLOY_RAY_HEALTH_TIMEOUT', '3')
    monkeypatch.setenv('LMDEPLOY_TP_TIMEOUT', '60')
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    engine = make_engine(tiny_llama, tp=2, distributed_executor_backend='ray')
    cluster = [child.pid for child in psutil.Process().children(recursive=True) if child.pid not in before]
    (pid,) = [child.pid for child in psutil.Process().children() if child.name() == stopped]
    resume = threading.Timer(90, os.kill, (pid, signal.SIGCONT))  # an engine that hangs on it ends the test
    try:
        run(engine, PROMPTS[:1], GREEDY)
        os.kill(pid, signal.SIGSTOP)
        resume.start()
        start = time.monotonic()
        with pytest.raises(WorkerError, match=STOPPED[stopped].format(pid=pid)):
            while True:
                run(engine, PROMPTS[:1], GREEDY)
                assert time.monotonic() - start < 40, f'the stopped {stopped} was not noticed'
        assert time.monotonic() - start < 30
    finally:
        start = time.monotonic()
        engine.close()
        closed = time.monotonic() - start
        resume.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert closed < 30
    assert_gone(cluster, timeout=30)


def test_a_ray_address_where_no_cluster_answers_is_refused_at_once(tiny_llama, tmp_path, monkeypatch):
    """``$RAY_ADDRESS``, or the address file a ``ray start`` cluster that is gone left, naming a port where
    nothing listens: a ``ConnectionError`` saying so within seconds (before, ``ray.init`` retried for minutes).
    The same for a port that accepts connections but never answers, as a hung (stopped) GCS does (before: taken
    for a cluster, as only a connection was tried)."""
    pytest.importorskip('lmdeploy.pytorch.distributed.ray_executor')  # imported before the environment changes
    gone = f'127.0.0.1:{free_port()}'
    (tmp_path / 'ray').mkdir()
    (tmp_path / 'ray' / 'ray_current_cluster').write_text(gone)
    with socket.create_server(('127.0.0.1', 0)) as hung:  # the kernel accepts its connections; nothing answers
        hung_address = f'127.0.0.1:{hung.getsockname()[1]}'
        for address, source, env in [
                (gone, 'RAY_ADDRESS', {'RAY_ADDRESS': gone}),
                (gone, f"{tmp_path}/ray/ray_current_cluster \\(left by `ray start`", {'RAY_TMPDIR': str(tmp_path)}),
                (hung_address, 'RAY_ADDRESS', {'RAY_ADDRESS': hung_address})]:
            with monkeypatch.context() as patch:
                patch.delenv('RAY_ADDRESS', raising=False)
                for key, value in env.items():
                    patch.setenv(key, value)
                start = time.monotonic()
                refused = rf'no Ray cluster answers at {address}, the address {source}'
                with pytest.raises(ConnectionError, match=refused):
                    make_engine(tiny_llama, tp=2, distributed_executor_backend='ray')
                assert time.monotonic() - start < 30


JOINED_CLUSTER = """
import sys
from lmdeploy.pytorch.distributed import ray_executor  # sets up the environment of a loopback cluster
ray_executor.ray.init(_node_ip_address='127.0.0.1', include_dashboard=False, num_cpus=2)
print(ray_executor.ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_server_whose_joined_clusters_gcs_hung_fails_fast_and_drains_on_sigterm(tiny_llama, tmp_path):
    """A server that joined a cluster another process started (``$RAY_ADDRESS``), whose GCS is SIGSTOPped (it
    accepts connections but answers nothing): within seconds ``/health`` says ``engine_failed``, naming the GCS,
    and a new request is refused with 503 (before: it served on, as the watchdog only connected to the GCS; a
    SIGKILLed GCS, which the watchdog noticed, had let Ray end the server 60 s after the loss). The GCS continued,
    the engine stays failed, and SIGTERM then drains the server, which exits 0 (before: the engine's ``ray.shutdown()`` had put SIGTERM's default back,
    and it ended the server at once with -15; behind ``--proxy-url`` it did not leave the proxy)."""
    pytest.importorskip('lmdeploy.pytorch.distributed.ray_executor')  # sets up the environment Ray reads
    env = {key: value for key, value in os.environ.items()
           if key not in ('RAY_ADDRESS', 'RAY_DISABLE_FAILURE_SIGNAL_HANDLER')}
    cluster = subprocess.Popen([sys.executable, '-c', JOINED_CLUSTER], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    processes: list[psutil.Process] = []
    try:
        address = cluster.stdout.readline().strip()
        port = free_port()
        with open(tmp_path / 'server.log', 'w') as log:
            server = subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.main', 'serve', 'api_server', tiny_llama,
                                       '--tp', '2', '--distributed-executor-backend', 'ray', '--dtype', 'float32',
                                       '--num-gpu-blocks', '64', '--block-size', '16', '--server-port', str(port)],
                                      env={**env, 'RAY_ADDRESS': address, 'LMDEPLOY_RAY_HEALTH_TIMEOUT': '3'},
                                      stdout=log, stderr=subprocess.STDOUT)
        url = f'http://127.0.0.1:{port}'
        try:
            wait_healthy(url, server, timeout=240)
            model = httpx.get(f'{url}/v1/models', timeout=5).json()['data'][0]['id']
            processes = psutil.Process(cluster.pid).children(recursive=True)
            (gcs,) = [child for child in psutil.Process(cluster.pid).children() if child.name() == 'gcs_server']
            gcs.suspend()
            deadline = time.monotonic() + 20
            while (health := httpx.get(f'{url}/health', timeout=5)).status_code == 200:
                assert time.monotonic() < deadline, 'the hung GCS was not noticed'
                time.sleep(0.2)
            assert health.json()['error']['code'] == 'engine_failed', health.text
            assert f"Ray cluster's GCS at {address} has not answered for 3 s" in health.json()['error']['message']
            body = {'model': model, 'prompt': 'Hello', 'max_tokens': 4}
            assert httpx.post(f'{url}/v1/completions', json=body, timeout=10).status_code == 503
            gcs.resume()  # Ray's disconnect waits on a stopped GCS (docs/reliability.md); the engine stays failed
            deadline = time.monotonic() + 30
            while 'disconnected from the lost Ray cluster' not in (tmp_path / 'server.log').read_text():
                assert time.monotonic() < deadline, 'the failed engine did not close'
                time.sleep(0.2)
            assert httpx.get(f'{url}/health', timeout=5).status_code == 503  # failed for good, the GCS back or not
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 0, (tmp_path / 'server.log').read_text()[-3000:]
        finally:
            server.kill()
            server.wait()
    finally:
        for process in [cluster, *processes]:  # Ray's agents would outlive their raylet by up to a minute
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                process.kill()
        cluster.wait()
