"""Clients that go away mid-request: their requests are aborted at once and give back everything."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import subprocess
import sys
import time

import httpx
import pytest
from server_helpers import free_port, metrics, serve, slow_down, tiny_engine, wait_healthy

from lmdeploy.messages import GenerationConfig
from lmdeploy.serve.openai.admission import Admission
from lmdeploy.serve.openai.request_start import start_run
from lmdeploy.serve.openai.serving_common import Job

ABORTED = 'lmdeploy:request_success_total{finish_reason="abort"}'
LENGTH = 'lmdeploy:request_success_total{finish_reason="length"}'


@pytest.fixture(scope='module')
def server(tiny_llama):
    engine = tiny_engine(tiny_llama, num_gpu_blocks=512)
    slow_down(engine, 0.005)
    yield from serve(engine, model_name='tiny')


def _finished(m: dict) -> dict:
    return {k: v for k, v in m.items() if k.startswith('lmdeploy:request_success_total')}


def _idle(url: str, kv_idle: float, aborted: int | None = None, finished: int | None = None,
          timeout: float = 5.0) -> dict:
    """The metrics once nothing runs or waits, KV usage is back to ``kv_idle`` and (if given) ``aborted``
    requests, or ``finished`` ones whatever the reason, were counted, which a request's last choice does
    just after it let go of its engine instance; or the metrics at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (m['lmdeploy:num_requests_running'] == 0 and m['lmdeploy:num_requests_waiting'] == 0
                and m['lmdeploy:kv_cache_usage_perc'] <= kv_idle and aborted in (None, m.get(ABORTED, 0))
                and finished in (None, sum(_finished(m).values())))
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


async def _client(http: httpx.AsyncClient, i: int) -> tuple[bool, str | None]:
    """Streams one chat; odd clients hang up after three events. Returns (hung up, last event)."""
    body = {'model': 'tiny', 'messages': [{'role': 'user', 'content': f'Hello {i}'}], 'max_tokens': 40,
            'temperature': 0, 'ignore_eos': True, 'stream': True}
    last = None
    async with http.stream('POST', '/v1/chat/completions', json=body) as resp:
        assert resp.status_code == 200
        events = 0
        async for line in resp.aiter_lines():
            if line.startswith('data:'):
                events, last = events + 1, line
                if i % 2 and events == 3:
                    return True, last
    return False, last


def test_half_of_50_streams_disconnect(server):
    kv_idle = server.metrics()['lmdeploy:kv_cache_usage_perc']

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*(_client(http, i) for i in range(50)))

    results = asyncio.run(main())
    assert sum(hung for hung, _ in results) == 25
    assert all(last == 'data: [DONE]' for hung, last in results if not hung)
    m = _idle(server.url, kv_idle, aborted=25)
    assert m['lmdeploy:num_requests_running'] == 0 and m['lmdeploy:num_requests_waiting'] == 0
    assert m['lmdeploy:kv_cache_usage_perc'] <= kv_idle
    assert m[ABORTED] == 25
    assert not server.app.state.server.engine.session_manager.sessions


def test_non_streaming_disconnect_aborts(server):
    kv_idle = server.metrics()['lmdeploy:kv_cache_usage_perc']
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f'{server.url}/generate', json={'input_ids': [5, 6, 7], 'max_tokens': 1000, 'ignore_eos': True},
                   timeout=0.5)
    start = time.monotonic()
    m = _idle(server.url, kv_idle)
    assert m['lmdeploy:num_requests_running'] == 0 and time.monotonic() - start < 3
    assert m['lmdeploy:kv_cache_usage_perc'] <= kv_idle



async def _drop_stream(http: httpx.AsyncClient, i: int) -> int:
    """Streams a chat of 6 choices and hangs up after 3 to 9 events; returns the events read."""
    body = {'model': 'tiny', 'messages': [{'role': 'user', 'content': f'Hi {i}'}], 'max_tokens': 60, 'n': 6,
            'temperature': 0, 'ignore_eos': True, 'stream': True}
    events = 0
    async with http.stream('POST', '/v1/chat/completions', json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith('data:'):
                events += 1
                if events == 3 + i % 7:
                    break
    return events


def test_dropped_streams_are_aborted_at_once(server):
    """Every choice of a stream dropped mid-way is aborted (none runs on to its end); nothing runs or waits
    afterwards and KV usage is back to idle."""
    before = server.metrics()
    kv_idle = before['lmdeploy:kv_cache_usage_perc']

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*(_drop_stream(http, i) for i in range(40)))

    assert asyncio.run(main()) == [3 + i % 7 for i in range(40)]
    m = _idle(server.url, kv_idle, aborted=before.get(ABORTED, 0) + 40 * 6)
    assert m['lmdeploy:num_requests_running'] == 0 and m['lmdeploy:num_requests_waiting'] == 0
    assert m['lmdeploy:kv_cache_usage_perc'] <= kv_idle
    assert m[ABORTED] - before.get(ABORTED, 0) == 40 * 6
    assert not server.app.state.server.engine.session_manager.sessions



def test_run_closed_before_its_jobs_ran(server):
    """A run closed before its jobs' tasks ever ran still ends each job (as 'abort') and gives its admission
    slots and its sessions back: nothing waits for a job that never started."""
    state = server.app.state.server

    async def main():
        admission = Admission(4, 0)
        ticket = await admission.acquire(2)
        jobs = [Job(i, [5, 6, 7], GenerationConfig(max_new_tokens=8), state.engine.reserve()) for i in range(2)]
        run = start_run(dataclasses.replace(state, admission=admission), ticket, jobs)
        await run.close()
        return await asyncio.wait_for(run.collect(), 10), admission.running

    responses, running = asyncio.run(main())
    assert [(r.index, r.finish_reason) for r in responses] == [(0, 'abort'), (1, 'abort')]
    assert running == 0 and not state.engine.session_manager.sessions


@pytest.fixture(scope='module')
def server_process(tiny_llama, tmp_path_factory):
    """``lmdeploy serve api_server`` in a process of its own (as deployed: asyncio reports writes to closed
    sockets in its log); yields its url and the path of its log."""
    log_path = tmp_path_factory.mktemp('server') / 'server.log'
    port = free_port()
    with open(log_path, 'w') as log:
        proc = subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.main', 'serve', 'api_server', tiny_llama,
                                 '--dtype', 'float32', '--num-gpu-blocks', '512', '--block-size', '16',
                                 '--server-port', str(port), '--model-name', 'tiny'],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, 'PYTHONUNBUFFERED': '1'})
    url = f'http://127.0.0.1:{port}'
    try:
        wait_healthy(url, proc)
        yield url, log_path
    finally:
        proc.terminate()
        proc.wait(timeout=60)


async def _drop_streams(url: str, seed: int, count: int) -> int:
    """``count`` streams of 1-3 choices, one after the other, each dropped after 1-6 events; returns the
    number of choices."""
    rng = random.Random(seed)
    choices = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        for _ in range(count):
            n = rng.choice([1, 2, 3])
            body = {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hello ' * rng.randint(3, 30)}],
                    'max_tokens': 900, 'ignore_eos': True, 'n': n, 'stream': True}
            drop_after, events = rng.randint(1, 6), 0
            async with http.stream('POST', '/v1/chat/completions', json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    events += line.startswith('data:')
                    if events == drop_after:
                        break
            choices += n
    return choices


@pytest.mark.slow
def test_dropped_streams_leave_no_trace(server_process):
    """400 streams dropped by 8 clients at random points: every choice is aborted (or, rarely, had already
    reached max_tokens) and counted once, then nothing runs or waits,
    every KV block is free, and the server never wrote on to a closed socket (asyncio logs each such write
    after the fifth as 'socket.send() raised exception')."""
    url, log_path = server_process

    async def main():
        return sum(await asyncio.gather(*(_drop_streams(url, seed, 50) for seed in range(8))))

    choices = asyncio.run(main())
    m = _idle(url, 0.0, finished=choices)
    assert m['lmdeploy:num_requests_running'] == 0 and m['lmdeploy:num_requests_waiting'] == 0
    assert m['lmdeploy:kv_cache_usage_perc'] == 0
    finished = _finished(m)
    # a choice may reach max_tokens before its slow client hangs up: it counts as 'length', never twice
    assert set(finished) <= {ABORTED, LENGTH} and sum(finished.values()) == choices, finished
    assert m[ABORTED] >= choices - 8, finished
    assert 'socket.send() raised exception' not in log_path.read_text()
