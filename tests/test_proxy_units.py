"""The parts of the proxy that need no server: routing (on stand-in nodes), node URLs and settings, the cores
of ``--dp`` replicas, the URL a node registers, the writes of a forwarded request."""
from __future__ import annotations

import asyncio

import httpcore
import pytest
from server_helpers import free_port

from lmdeploy.cli.main import main
from lmdeploy.serve.proxy.dp import Replicas, cpu_shares
from lmdeploy.serve.proxy.nodes import Node, normalize_url
from lmdeploy.serve.proxy.registration import advertised_url
from lmdeploy.serve.proxy.routing import LeastRequests, PrefixAffinity, affinity_key, make_strategy
from lmdeploy.serve.proxy.transport import FlushOnReadStream


def nodes(*outstanding: int) -> list[Node]:
    return [Node(f'http://10.0.0.{i}:23333', pool=None, client=None, healthy=True, outstanding=count)
            for i, count in enumerate(outstanding)]


def chat(text: str, **fields) -> dict:
    return {'model': 'm', 'messages': [{'role': 'user', 'content': text}], **fields}


def test_least_requests_takes_the_least_busy_node_and_rotates_ties():
    strategy = LeastRequests()
    busy = nodes(3, 1, 2)
    assert {strategy.choose(busy, None).url for _ in range(5)} == {busy[1].url}
    idle = nodes(0, 0, 0)
    strategy = LeastRequests()
    picks = [strategy.choose(idle, None) for _ in range(6)]
    assert picks == picks[:3] * 2 and set(picks) == set(idle)


def test_prefix_affinity_sends_a_shared_prefix_to_one_node():
    strategy = PrefixAffinity(prefix_chars=64)
    pool = nodes(0, 0, 0)
    prefix = 'You are a careful assistant. ' * 3
    chosen = {strategy.choose(pool, chat(prefix + f'question {i}')).url for i in range(20)}
    assert len(chosen) == 1
    turns = [chat(prefix), {**chat(prefix), 'messages': chat(prefix)['messages'] * 3}]
    assert {strategy.choose(pool, body).url for body in turns} == chosen


def test_prefix_affinity_spreads_different_prompts_and_keeps_sessions():
    strategy = PrefixAffinity(prefix_chars=64)
    pool = nodes(0, 0)
    assert {strategy.choose(pool, chat(f'{i} unrelated prompt')).url for i in range(40)} == {n.url for n in pool}
    for session in range(10):
        assert len({strategy.choose(pool, chat(f'turn {turn}', session_id=session)).url for turn in range(5)}) == 1


def test_prefix_affinity_moves_only_the_keys_of_a_node_that_leaves():
    strategy = PrefixAffinity()
    pool = nodes(0, 0, 0, 0)
    before = {i: strategy.choose(pool, chat(f'prompt {i}')) for i in range(200)}
    gone = pool[2]
    after = {i: strategy.choose([n for n in pool if n is not gone], chat(f'prompt {i}')) for i in range(200)}
    assert all(after[i] is before[i] for i in before if before[i] is not gone)
    assert any(before[i] is gone for i in before)


def test_prefix_affinity_yields_to_least_requests_when_its_node_is_overloaded():
    strategy = PrefixAffinity(max_imbalance=4)
    pool = nodes(0, 0)
    body = chat('a prompt that hashes somewhere')
    home = strategy.choose(pool, body)
    home.outstanding = 5
    assert strategy.choose(pool, body) is not home
    home.outstanding = 4
    assert strategy.choose(pool, body) is home


def test_affinity_key_reads_each_prompt_field():
    assert affinity_key({'prompt': 'abcdef'}, 3) == 'prompt abc'
    assert affinity_key({'input_ids': [1, 2, 3]}, 100) == 'input_ids [1,2,3]'
    assert affinity_key({'session_id': 7, 'prompt': 'x'}, 10) == 'session 7'
    assert affinity_key({'model': 'm'}, 10) is None
    assert affinity_key(['not', 'a', 'dict'], 10) is None


def test_unknown_strategy_and_bad_node_urls_are_refused():
    with pytest.raises(ValueError, match='least_requests'):
        make_strategy('random')
    assert normalize_url('http://127.0.0.1:8000/') == 'http://127.0.0.1:8000'
    assert normalize_url('http://[::1]:8000') == 'http://[::1]:8000'
    for bad in ('127.0.0.1:8000', 'ftp://host:1', 'http://host:1/v1', 'http://', 'http://host:99999', 'http://host:0', 'http://a b:1'):
        with pytest.raises(ValueError):
            normalize_url(bad)


@pytest.mark.parametrize('flags, message', [
    (['--health-interval', '0'], 'health_interval must be positive, got 0.0'),
    (['--request-timeout', '-1'], 'request_timeout must be positive, got -1.0'),
    (['--max-connections-per-node', '0'], 'max_connections_per_node must be positive, got 0'),
    (['--max-request-body-bytes', '-1'], 'max_request_body_bytes must be positive (or None: no limit), got -1'),
    (['--routing-strategy', 'prefix_affinity', '--affinity-prefix-chars', '0'],
     'affinity_prefix_chars must be at least 1, got 0'),
    (['--nodes', 'http://host:99999'], "a node URL is http(s)://host[:port], got 'http://host:99999'"),
])
def test_proxy_settings_out_of_range_are_one_line_errors(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(['serve', 'proxy', *flags])
    assert exited.value.code == 2 and capsys.readouterr().err.strip() == f'lmdeploy: error: {message}'


def test_dp_refuses_a_bad_health_interval_before_any_replica_starts(tiny_llama, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(Replicas, 'start', lambda self: started.append(self))
    port = free_port(3)
    with pytest.raises(SystemExit) as exited:
        main(['serve', 'api_server', tiny_llama, '--server-port', str(port), '--dp', '2', '--health-interval', '0'])
    assert exited.value.code == 2 and not started
    assert capsys.readouterr().err.strip().endswith('lmdeploy: error: health_interval must be positive, got 0.0')


def test_dp_replicas_get_equal_shares_of_the_cores(monkeypatch):
    monkeypatch.setattr('os.sched_getaffinity', lambda _: {0, 1, 2, 3, 4, 6})
    assert cpu_shares(2) == [[0, 1, 2], [3, 4, 6]]
    assert cpu_shares(4) == [[0, 1], [2, 3], [4], [6]]
    monkeypatch.setattr('os.sched_getaffinity', lambda _: {0, 1})
    assert cpu_shares(3) == [[0], [1], [0]]


def test_a_node_on_a_wildcard_address_registers_its_route_to_the_proxy():
    assert advertised_url('0.0.0.0', 23333, 'http://127.0.0.1:8000') == 'http://127.0.0.1:23333'
    assert advertised_url('10.1.2.3', 23333, 'http://127.0.0.1:8000') == 'http://10.1.2.3:23333'
    assert advertised_url('::1', 5, 'http://[::1]:8000') == 'http://[::1]:5'



class RecordingStream(httpcore.AsyncMockStream):
    """httpcore's stand-in network stream, keeping what is written."""

    def __init__(self, buffer: list[bytes]):
        super().__init__(buffer)
        self.writes: list[bytes] = []

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.writes.append(buffer)


def test_a_forwarded_request_leaves_in_one_write():
    """httpcore writes a request's head and body apart; the node's connection sends them together."""
    network = RecordingStream([b'HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok'])
    connection = httpcore.AsyncHTTP11Connection(httpcore.Origin(b'http', b'node', 80), FlushOnReadStream(network))
    request = httpcore.Request('POST', 'http://node/v1/completions', content=b'{"prompt": "hi"}',
                               headers=[(b'host', b'node'), (b'content-length', b'16')])

    async def forward() -> bytes:
        response = await connection.handle_async_request(request)
        return await response.aread()

    assert asyncio.run(forward()) == b'ok'
    assert len(network.writes) == 1
    head, _, body = network.writes[0].partition(b'\r\n\r\n')
    assert head.startswith(b'POST /v1/completions HTTP/1.1\r\n') and body == b'{"prompt": "hi"}'
