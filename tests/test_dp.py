"""``api_server --dp 2``: replicas behind one port on their own cores, dying with the parent, started again
when one dies."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
from proxy_helpers import NODE_FLAGS, healthy_nodes, lmdeploy, per_node, stream_texts
from server_helpers import free_port, metrics, wait_healthy


def _listening_on(processes: list[psutil.Process], port: int) -> psutil.Process:
    return next(proc for proc in processes if any(
        conn.laddr.port == port and conn.status == psutil.CONN_LISTEN for conn in proc.net_connections('tcp')))


def _start_dp(model: str, tmp_path) -> tuple[int, subprocess.Popen]:
    """``api_server --dp 2`` on a free run of three ports (logging to ``tmp_path / 'dp.log'``): its port and
    process. The proxy checks its replicas every 0.5 s (not 5 s), so a restarted one is back sooner."""
    port = free_port(3)
    flags = [flag for flag in NODE_FLAGS if flag not in ('--num-threads', '1')]
    return port, lmdeploy(['serve', 'api_server', model, '--server-port', str(port), '--dp', '2', *flags,
                           '--health-interval', '0.5'],
                          tmp_path / 'dp.log')


def _replica_pid(parent: int, port: int) -> int | None:
    try:
        return _listening_on(psutil.Process(parent).children(recursive=True), port).pid
    except (StopIteration, psutil.Error):
        return None


def _serves_on_both_replicas(url: str, port: int, parent: subprocess.Popen) -> None:
    """Both replicas are healthy behind the proxy, each serves some of six streams, on cores of its own."""
    assert healthy_nodes(url) == [f'http://127.0.0.1:{port + 1}', f'http://127.0.0.1:{port + 2}']
    assert all(asyncio.run(stream_texts(url, [f'prompt {i}' for i in range(6)], 8)))
    assert all(count >= 2 for count in per_node(metrics(url), 'lmdeploy:request_success_total').values())
    children = psutil.Process(parent.pid).children(recursive=True)
    first, second = (set(_listening_on(children, port + i).cpu_affinity()) for i in (1, 2))
    if len(os.sched_getaffinity(0)) >= 2:
        assert first.isdisjoint(second) and first | second == os.sched_getaffinity(0)


def _dies_with_its_replicas(parent: subprocess.Popen, sig: signal.Signals) -> None:
    """``sig`` to the parent: it exits cleanly and leaves no replica behind."""
    children = psutil.Process(parent.pid).children(recursive=True)
    parent.send_signal(sig)
    assert parent.wait(timeout=90) == 0
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f'orphans: {alive}'


def test_dp_replicas_share_the_port_and_the_cores_and_die_with_the_parent_on_sigint(tiny_llama, tmp_path):
    port, parent = _start_dp(tiny_llama, tmp_path)
    url = f'http://127.0.0.1:{port}'
    try:
        wait_healthy(url, parent, timeout=300)
        assert 'libtorch_cpu' not in Path(f'/proc/{parent.pid}/maps').read_text(), 'the proxy loaded torch'
        _serves_on_both_replicas(url, port, parent)
        _dies_with_its_replicas(parent, signal.SIGINT)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_dp_replica_that_dies_is_started_again_and_all_die_with_the_parent_on_sigterm(tiny_llama, tmp_path):
    """SIGKILL to a replica: its requests end, the others go on, and the parent starts it again on the
    same port, where the proxy takes it back; SIGTERM to the parent then stops the restarted replica too.
    (One server for both checks: a ``--dp`` start is the slowest part.)"""
    port, parent = _start_dp(tiny_llama, tmp_path)
    url = f'http://127.0.0.1:{port}'
    try:
        wait_healthy(url, parent, timeout=300)
        _serves_on_both_replicas(url, port, parent)
        victim = _listening_on(psutil.Process(parent.pid).children(recursive=True), port + 2)
        victim.kill()
        victim.wait(timeout=30)
        deadline = time.monotonic() + 240
        while _replica_pid(parent.pid, port + 2) in (None, victim.pid) or \
                healthy_nodes(url) != [f'http://127.0.0.1:{port + 1}', f'http://127.0.0.1:{port + 2}']:
            assert time.monotonic() < deadline, 'the replica was not started again'
            assert parent.poll() is None
            time.sleep(0.2)
        assert all(asyncio.run(stream_texts(url, [f'prompt {i}' for i in range(6)], 8)))
        assert per_node(metrics(url), 'lmdeploy:request_success_total').get(f'http://127.0.0.1:{port + 2}', 0) >= 1
        assert 'starting it again' in (tmp_path / 'dp.log').read_text()
        _dies_with_its_replicas(parent, signal.SIGTERM)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_dp_refuses_taken_replica_ports(tiny_llama, tmp_path):
    port = free_port(3)
    with socket.socket() as taken:
        taken.bind(('127.0.0.1', port + 2))
        taken.listen()
        proc = lmdeploy(['serve', 'api_server', tiny_llama, '--server-port', str(port), '--dp', '2'],
                        tmp_path / 'dp.log')
        try:
            assert proc.wait(timeout=60) != 0
        finally:
            proc.kill()
    log = (tmp_path / 'dp.log').read_text()
    assert f'ports {port + 1} to {port + 2}' in log and f'taken: {port + 2}' in log
