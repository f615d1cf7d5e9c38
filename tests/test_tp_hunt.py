"""What the hunt on tensor parallelism and the proxy (docs/reliability.md) found: an ``api_server --dp``
replica whose tensor-parallel rank died served on with a dead engine, answering 503 forever; a hung rank's
error named rank 0 (the one that waited); a rank whose forkserver died was said to exit with code 255."""
from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest
from helpers import assert_gone, make_engine
from proxy_helpers import NODE_FLAGS
from server_helpers import free_port

from lmdeploy import GenerationConfig
from lmdeploy.cli.main import build_parser
from lmdeploy.cli.serve import run_api_server
from lmdeploy.pytorch.distributed.parallel_state import WorkerError
from lmdeploy.serve.proxy.dp import Replicas


def tp_workers(pid: int) -> list[psutil.Process]:
    """The tensor-parallel workers under process ``pid``: forked by its forkserver (or spawned)."""
    def started_by(process: psutil.Process | None, marker: str) -> bool:
        return process is not None and marker in ' '.join(process.cmdline())

    return [child for child in psutil.Process(pid).children(recursive=True)
            if started_by(child.parent(), 'forkserver') or started_by(child, 'spawn_main')]


def stream_events(url: str, on_first_token=None) -> list[str]:
    """A long streamed completion's ``data:`` events; ``on_first_token()`` runs once the first arrives."""
    body = {'model': 'tiny', 'prompt': 'Hello', 'max_tokens': 900, 'ignore_eos': True, 'stream': True}
    events = []
    with httpx.stream('POST', f'{url}/v1/completions', json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith('data: '):
                events.append(line)
                if len(events) == 1 and on_first_token is not None:
                    on_first_token()
    return events


def test_a_dp_replica_whose_rank_died_is_started_again_and_a_hung_rank_is_named(tiny_llama, monkeypatch):
    """A replica of ``--dp`` with ``--tp 2`` (one replica here: one tensor-parallel server at a time) whose
    worker is SIGKILLed mid-stream: the stream ends with the worker's error, ``/health`` says
    ``engine_failed``, and the parent stops the replica and starts it again, which then serves. Before, the
    replica process lived on with its dead engine and was never restarted. Then the new worker is stopped
    (SIGSTOP) mid-stream: the error names rank 1, its pid, that it is stopped, and the timeout (before:
    ``broadcast failed on rank 0``; then ``rank 1 did not answer ...``, not saying it was stopped), and no process
    is left, the stopped worker included."""
    monkeypatch.setenv('LMDEPLOY_TP_TIMEOUT', '4')  # the replicas' environment
    args = build_parser().parse_args(['serve', 'api_server', tiny_llama, '--tp', '2', *NODE_FLAGS,
                                      '--server-port', str(free_port())])
    del args.help_of  # not picklable (as in main())
    replicas = Replicas(run_api_server, [args], [None], [None])
    (url,) = replicas.urls
    pids: list[int] = []
    try:
        replicas.start()
        replicas.wait_ready()
        replicas.supervise()
        first = replicas.processes[0]
        (worker,) = tp_workers(first.pid)
        pids = [first.pid, worker.pid]
        events = stream_events(url, worker.kill)
        assert 'was killed by SIGKILL' in events[-2] and events[-1] == 'data: [DONE]'
        health = httpx.get(f'{url}/health', timeout=5)
        assert health.status_code == 503 and health.json()['error']['code'] == 'engine_failed'
        deadline = time.monotonic() + 180
        while replicas.processes[0] is first or not _healthy(url):
            assert time.monotonic() < deadline, 'the replica with the dead rank was not started again'
            time.sleep(0.3)
        assert first.exitcode is not None
        pids.append(replicas.processes[0].pid)
        (worker,) = tp_workers(replicas.processes[0].pid)
        pids.append(worker.pid)
        events = stream_events(url, worker.suspend)
        assert '"choices"' in events[0], 'the restarted replica did not serve'
        assert f'rank 1 (pid {worker.pid}, stopped) did not answer within 4 s (LMDEPLOY_TP_TIMEOUT)' in events[-2], \
            events[-2]
    finally:
        replicas.stop(10)
    assert_gone(pids)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f'{url}/health', timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_a_rank_whose_forkserver_died_says_so(tiny_llama, monkeypatch):
    """The forkserver SIGKILLed mid-run takes its worker with it (the kernel SIGKILLs a worker whose parent
    dies); ``multiprocessing`` reports exit code 255 for it, and the error said ``rank 1 (pid ...) exited with
    code 255``. Now it names the forkserver and how it ended."""
    monkeypatch.setenv('LMDEPLOY_TP_START_METHOD', 'forkserver')
    engine = make_engine(tiny_llama, tp=2)
    try:
        (pid,) = engine.executor.pids
        server = psutil.Process(pid).ppid()
        engine.add_request([5, 6, 7], GenerationConfig(max_new_tokens=500, ignore_eos=True))
        engine.step()
        os.kill(server, signal.SIGKILL)
        with pytest.raises(WorkerError, match=rf'rank 1 \(pid {pid}\) was killed by SIGKILL when its forkserver '
                                              rf'\(pid {server}\) died, which was killed by SIGKILL'):
            while True:
                engine.step()
    finally:
        engine.close()
    assert_gone([pid, server])
