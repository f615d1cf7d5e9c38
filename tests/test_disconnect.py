"""Clients that go away mid-request: their requests are aborted at once and give back everything."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_helpers import ServerThread, serve, slow_down, tiny_engine



@pytest.fixture(scope='module')
def server(tiny_llama):
    engine = tiny_engine(tiny_llama, num_gpu_blocks=512)
    slow_down(engine, 0.005)
    yield from serve(engine, model_name='tiny')


def _idle(server: ServerThread, kv_idle: float, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m['lmdeploy:num_requests_running'] == 0 and m['lmdeploy:num_requests_waiting'] == 0
                and m['lmdeploy:kv_cache_usage_perc'] <= kv_idle)
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
    m = _idle(server, kv_idle)
    assert m['lmdeploy:num_requests_running'] == 0 and m['lmdeploy:num_requests_waiting'] == 0
    assert m['lmdeploy:kv_cache_usage_perc'] <= kv_idle
    assert m['lmdeploy:request_success_total{finish_reason="abort"}'] == 25
    assert not server.app.state.server.engine.session_manager.sessions


def test_non_streaming_disconnect_aborts(server):
    kv_idle = server.metrics()['lmdeploy:kv_cache_usage_perc']
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f'{server.url}/generate', json={'input_ids': [5, 6, 7], 'max_tokens': 1000, 'ignore_eos': True},
                   timeout=0.5)
    start = time.monotonic()
    m = _idle(server, kv_idle)
    assert m['lmdeploy:num_requests_running'] == 0 and time.monotonic() - start < 3
    assert m['lmdeploy:kv_cache_usage_perc'] <= kv_idle
