"""``lmdeploy serve proxy`` in front of two ``lmdeploy serve api_server`` processes on loopback (one joins with
``--proxy-url``, one through ``POST /nodes/add``), in-process proxies in front of the same nodes (the proxy in front
of stand-in nodes is ``test_proxy_guards.py``)."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from proxy_helpers import NODE_FLAGS, healthy_nodes, lmdeploy, per_node, status, stream_texts
from server_helpers import ServerThread, free_port, metrics, serve, tiny_engine, wait_healthy

from lmdeploy.serve.proxy.app import create_proxy_app

ABORTED = 'lmdeploy:request_success_total{finish_reason="abort"'


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f'timed out waiting for {what}'
        time.sleep(0.1)


def total(samples: dict[str, float], prefix: str) -> float:
    return sum(value for key, value in samples.items() if key.startswith(prefix))


def chat_body(text: str, max_tokens: int, **fields) -> dict:
    return {'model': 'tiny', 'messages': [{'role': 'user', 'content': text}], 'max_tokens': max_tokens,
            'ignore_eos': True, **fields}


class Cluster:
    """A proxy process (``url``) and its api_server processes by URL; ``start_node`` (re)starts one."""

    def __init__(self, model: str, logs):
        self.model, self.logs = model, logs
        self.url = f'http://127.0.0.1:{free_port()}'
        self.proxy = lmdeploy(['serve', 'proxy', '--server-port', self.url.rsplit(':', 1)[1],
                               '--health-interval', '0.5'], logs / 'proxy.log')
        self.nodes: dict[str, subprocess.Popen] = {}

    def start_node(self, port: int, *flags: str) -> str:
        url = f'http://127.0.0.1:{port}'
        self.nodes[url] = lmdeploy(['serve', 'api_server', self.model, '--server-port', str(port), *NODE_FLAGS,
                                    *flags], self.logs / f'node{port}.log')
        return url

    def close(self) -> None:
        for proc in [*self.nodes.values(), self.proxy]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope='module')
def cluster(tiny_llama, tmp_path_factory) -> Iterator[Cluster]:
    cluster = Cluster(tiny_llama, tmp_path_factory.mktemp('proxy'))
    try:
        cluster.joined = cluster.start_node(free_port(), '--proxy-url', cluster.url)
        cluster.added = cluster.start_node(free_port())
        wait_healthy(cluster.url, cluster.nodes[cluster.joined], timeout=300)
        wait_healthy(cluster.added, cluster.nodes[cluster.added], timeout=300)
        assert httpx.post(f'{cluster.url}/nodes/add', json={'url': cluster.added}).status_code == 200
        wait_for(lambda: healthy_nodes(cluster.url) == sorted(cluster.nodes), 30, 'both nodes healthy')
        yield cluster
    finally:
        cluster.close()


def test_requests_spread_over_both_nodes_and_answers_come_back_unchanged(cluster):
    before = per_node(metrics(cluster.url), 'lmdeploy:request_success_total')
    assert all(asyncio.run(stream_texts(cluster.url, [f'prompt {i}' for i in range(8)], 24)))
    after = per_node(metrics(cluster.url), 'lmdeploy:request_success_total')
    assert sorted(after) == sorted(cluster.nodes)
    assert all(after[node] - before.get(node, 0) >= 2 for node in cluster.nodes), (before, after)
    body = dict(model='tiny', messages=[{'role': 'user', 'content': 'same'}], max_tokens=16, temperature=0)
    proxied = openai.OpenAI(base_url=f'{cluster.url}/v1', api_key='none', max_retries=0)
    direct = openai.OpenAI(base_url=f'{cluster.joined}/v1', api_key='none', max_retries=0)
    assert proxied.chat.completions.create(**body).choices[0].message.content == \
        direct.chat.completions.create(**body).choices[0].message.content


def test_a_stream_is_relayed_as_made_and_a_client_that_leaves_aborts_it_on_its_node(cluster):
    before = total(metrics(cluster.url), ABORTED)
    with httpx.stream('POST', f'{cluster.url}/v1/chat/completions', json=chat_body('Hi', 900, stream=True),
                      timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers['content-type'].startswith('text/event-stream')
        first = next(line for line in resp.iter_lines() if line.startswith('data: '))
        assert json.loads(first[6:])['object'] == 'chat.completion.chunk'

    def aborted() -> bool:
        samples = metrics(cluster.url)
        return total(samples, 'lmdeploy:num_requests_running') == 0 and total(samples, ABORTED) == before + 1
    wait_for(aborted, 30, 'the node to abort the stream its client left (a buffered stream would have finished)')
    assert all(state['outstanding'] == 0 for state in status(cluster.url).values())


def test_abort_request_reaches_the_node_that_runs_the_session(cluster):
    body = chat_body('Hi', 900, stream=True, session_id=4242)
    with httpx.stream('POST', f'{cluster.url}/v1/chat/completions', json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith('data: {'))
        abort = httpx.post(f'{cluster.url}/abort_request', json={'session_id': 4242})
        assert abort.status_code == 200 and abort.json() == {'success': True}
        events = [json.loads(line[6:]) for line in lines if line.startswith('data: {')]
    assert events[-1]['choices'][0]['finish_reason'] == 'abort'
    refused = httpx.post(f'{cluster.url}/abort_request', json={'abort_all': True})
    assert refused.status_code == 403 and refused.json()['error']['code'] == 'admin_key_required'


def test_node_errors_pass_through_unchanged(cluster):
    bad = [chat_body('Hi', 4, model='nope'), chat_body('Hi', 4, temperature=-1), chat_body('Hi', 4, n=0)]
    for body in bad:
        direct = httpx.post(f'{cluster.added}/v1/chat/completions', json=body)
        proxied = httpx.post(f'{cluster.url}/v1/chat/completions', json=body)
        assert direct.status_code >= 400
        assert (proxied.status_code, proxied.json()) == (direct.status_code, direct.json())
    malformed = httpx.post(f'{cluster.url}/v1/completions', content=b'{"model": ', headers={
        'content-type': 'application/json'})
    assert malformed.status_code == 400 and malformed.json()['error']['message'].startswith('malformed JSON')
    nested = b'{"model": "x", "prompt": ' + b'[' * 1100 + b']' * 1100 + b'}'  # deeper than json.loads reads
    direct, proxied = (httpx.post(f'{url}/v1/completions', content=nested, headers={
        'content-type': 'application/json'}) for url in (cluster.added, cluster.url))
    assert direct.status_code == 400 and (proxied.status_code, proxied.json()) == (400, direct.json())
    client = openai.OpenAI(base_url=f'{cluster.url}/v1', api_key='none', max_retries=0)
    with pytest.raises(openai.NotFoundError, match='does not exist'):
        client.completions.create(model='nope', prompt='Hi', max_tokens=2)


def test_models_and_metrics_aggregate_the_nodes(cluster):
    client = openai.OpenAI(base_url=f'{cluster.url}/v1', api_key='none', max_retries=0)
    assert [model.id for model in client.models.list().data] == ['tiny']
    samples = metrics(cluster.url)
    assert sorted(per_node(samples, 'lmdeploy:kv_cache_usage_perc')) == sorted(cluster.nodes)
    assert per_node(samples, 'lmdeploy_proxy:node_healthy') == {node: 1.0 for node in cluster.nodes}
    assert per_node(samples, 'lmdeploy_proxy:node_requests_in_flight') == {node: 0.0 for node in cluster.nodes}


def test_proxy_keys_guard_it_and_only_admin_keys_manage_nodes(cluster):
    proxy = ServerThread(create_proxy_app([cluster.joined], api_keys=['user-key'], admin_api_keys=['admin-key']))
    try:
        assert httpx.get(f'{proxy.url}/health').status_code == 200
        refused = httpx.post(f'{proxy.url}/v1/completions', json={'model': 'tiny', 'prompt': 'Hi', 'max_tokens': 2})
        assert refused.status_code == 401 and refused.json()['error']['code'] == 'invalid_api_key'
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f'{proxy.url}/v1', api_key='wrong', max_retries=0).models.list()
        client = openai.OpenAI(base_url=f'{proxy.url}/v1', api_key='user-key', max_retries=0)
        completion = client.completions.create(model='tiny', prompt='Hi', max_tokens=2, extra_body={'ignore_eos': True})
        assert completion.choices[0].finish_reason == 'length'
        add = {'url': cluster.added}
        user, admin = {'Authorization': 'Bearer user-key'}, {'Authorization': 'Bearer admin-key'}
        assert httpx.post(f'{proxy.url}/nodes/add', json=add, headers=user).status_code == 403
        assert httpx.post(f'{proxy.url}/nodes/add', json={'url': 'not a url'}, headers=admin).status_code == 400
        assert httpx.post(f'{proxy.url}/nodes/add', json={}, headers=admin).json()['error']['param'] == 'url'
        added = httpx.post(f'{proxy.url}/nodes/add', json=add, headers=admin)
        assert added.status_code == 200 and added.json()[cluster.added]['healthy']
        nodes = httpx.get(f'{proxy.url}/nodes/status', headers=user).json()
        assert sorted(nodes) == sorted(cluster.nodes)
        assert httpx.post(f'{proxy.url}/nodes/remove', json=add, headers=admin).json() == {'success': True}
        assert httpx.post(f'{proxy.url}/nodes/remove', json=add, headers=admin).status_code == 404
        assert list(httpx.get(f'{proxy.url}/nodes/status', headers=admin).json()) == [cluster.joined]
    finally:
        proxy.stop()


@pytest.fixture
def keyed_node(tiny_llama) -> Iterator[ServerThread]:
    """An in-process api_server that wants the key 'node-key'."""
    yield from serve(tiny_engine(tiny_llama), model_name='tiny', api_keys=['node-key'])


def test_the_clients_key_goes_on_to_the_node(keyed_node):
    proxy = ServerThread(create_proxy_app([keyed_node.url]))
    try:
        client = openai.OpenAI(base_url=f'{proxy.url}/v1', api_key='node-key', max_retries=0)
        completion = client.completions.create(model='tiny', prompt='Hi', max_tokens=2, extra_body={'ignore_eos': True})
        assert completion.choices[0].finish_reason == 'length'
        assert [model.id for model in client.models.list().data] == ['tiny']
        body, wrong = {'model': 'tiny', 'prompt': 'Hi', 'max_tokens': 2}, {'Authorization': 'Bearer wrong'}
        direct = httpx.post(f'{keyed_node.url}/v1/completions', json=body, headers=wrong)
        proxied = httpx.post(f'{proxy.url}/v1/completions', json=body, headers=wrong)
        assert (proxied.status_code, proxied.json(), proxied.headers['www-authenticate']) == \
            (401, direct.json(), 'Bearer')
        assert httpx.get(f'{proxy.url}/metrics', headers=wrong).status_code == 401
    finally:
        proxy.stop()


def test_prefix_affinity_keeps_a_shared_prefix_on_one_node_and_its_cache_hits(cluster):
    proxy = ServerThread(create_proxy_app(sorted(cluster.nodes), routing_strategy='prefix_affinity',
                                          affinity_prefix_chars=200))
    try:
        client = openai.OpenAI(base_url=f'{proxy.url}/v1', api_key='none', max_retries=0)
        system = 'You answer questions about the quick brown fox and the lazy dog. ' * 6
        cached = []
        for i in range(4):
            reply = client.chat.completions.create(model='tiny', max_tokens=2, messages=[
                {'role': 'system', 'content': system}, {'role': 'user', 'content': f'question {i}'}])
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        counts = sorted(state['served'] for state in status(proxy.url).values())
        assert counts == [0, 4]
        assert all(tokens > 0 for tokens in cached[1:]), cached
    finally:
        proxy.stop()


def served(url: str) -> dict[str, int]:
    return {node: state['served'] for node, state in status(url).items()}


def test_a_killed_node_fails_only_its_requests_and_the_survivor_takes_the_rest(cluster):
    victim, survivor = cluster.added, cluster.joined

    async def main() -> tuple[list[str | None], dict[str, int]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            async def one(i: int, started: asyncio.Event) -> str | None:
                """The code of the stream's error event, or None when it ended normally."""
                events = []
                async with http.stream('POST', '/v1/chat/completions',
                                       json=chat_body(f'story {i}', 900, stream=True)) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        if line.startswith('data: {'):
                            events.append(json.loads(line[6:]))
                            started.set()
                errors = [event['error']['code'] for event in events if 'error' in event]
                assert errors or events[-1]['choices'][0]['finish_reason'] == 'length'
                return errors[0] if errors else None
            started = [asyncio.Event() for _ in range(6)]
            tasks = [asyncio.create_task(one(i, event)) for i, event in enumerate(started)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            in_flight = {node: state['outstanding'] for node, state in (await http.get('/nodes/status')).json().items()}
            cluster.nodes[victim].kill()
            return await asyncio.wait_for(asyncio.gather(*tasks), 60), in_flight

    outcomes, in_flight = asyncio.run(main())
    assert in_flight == {victim: 3, survivor: 3}
    assert Counter(outcomes) == {None: 3, 'node_failed': 3}
    before = served(cluster.url)
    client = openai.OpenAI(base_url=f'{cluster.url}/v1', api_key='none', max_retries=0)
    for _ in range(4):
        completion = client.completions.create(model='tiny', prompt='Hi', max_tokens=2, extra_body={'ignore_eos': True})
        assert completion.choices[0].finish_reason == 'length'
    after = served(cluster.url)
    assert after[survivor] - before[survivor] == 4 and after[victim] == before[victim]
    assert healthy_nodes(cluster.url) == [survivor]

    cluster.start_node(int(victim.rsplit(':', 1)[1]))
    wait_for(lambda: healthy_nodes(cluster.url) == sorted(cluster.nodes), 300, 'the restarted node to be taken back')
    assert all(asyncio.run(stream_texts(cluster.url, ['a', 'b', 'c', 'd'], 8)))
    assert served(cluster.url)[victim] > after[victim]


def test_a_node_leaves_the_proxy_when_it_shuts_down(cluster):
    assert cluster.joined in status(cluster.url)
    cluster.nodes[cluster.joined].send_signal(signal.SIGTERM)
    assert cluster.nodes[cluster.joined].wait(timeout=60) == 0
    assert sorted(status(cluster.url)) == sorted(set(cluster.nodes) - {cluster.joined})
    cluster.proxy.send_signal(signal.SIGTERM)
    assert cluster.proxy.wait(timeout=60) == 0
