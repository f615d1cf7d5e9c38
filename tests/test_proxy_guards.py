"""The proxy in front of stand-in nodes (small FastAPI apps on loopback): what it must not do with what a client
sends (forward it to another host, read a body of any size, keep one client's cookies for the next, go round a
loop of proxies) and its answer when no node is up."""
from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse
from proxy_helpers import status
from server_helpers import ServerThread, free_port

from lmdeploy.serve.proxy.app import create_proxy_app


def test_no_healthy_node_is_an_openai_503():
    proxy = ServerThread(create_proxy_app([f'http://127.0.0.1:{free_port()}']))
    try:
        client = openai.OpenAI(base_url=f'{proxy.url}/v1', api_key='none', max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as caught:
                client.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': 'Hi'}],
                                               stream=stream)
            assert caught.value.status_code == 503
            assert (caught.value.body['type'], caught.value.code) == ('server_error', 'no_healthy_node')
        assert httpx.get(f'{proxy.url}/health').status_code == 503
        assert httpx.get(f'{proxy.url}/v1/models').json()['error']['code'] == 'no_healthy_node'
    finally:
        proxy.stop()


def test_the_proxys_own_errors_have_openais_types():
    """The proxy's refusals read as OpenAI's do in the official client (they had ``authentication_error`` and
    ``permission_error``): ``invalid_request_error`` with a specific ``code``."""
    proxy = ServerThread(create_proxy_app([f'http://127.0.0.1:{free_port()}'], api_keys=['user'],
                                          admin_api_keys=['admin']))
    try:
        with pytest.raises(openai.AuthenticationError) as denied:
            openai.OpenAI(base_url=f'{proxy.url}/v1', api_key='wrong', max_retries=0).models.list()
        user = openai.OpenAI(base_url=proxy.url, api_key='user', max_retries=0)
        with pytest.raises(openai.PermissionDeniedError) as refused:
            user.post('/nodes/add', cast_to=httpx.Response, body={'url': 'http://127.0.0.1:1'})
        assert [(e.value.body['type'], e.value.code) for e in (denied, refused)] == [
            ('invalid_request_error', 'invalid_api_key'), ('invalid_request_error', 'admin_key_required')]
    finally:
        proxy.stop()


def test_forwarding_keeps_no_cookies_between_clients_and_follows_no_redirects():
    """The proxy relays a node's Set-Cookie and redirects to the client that asked, and sends the next
    client's request with only that client's own headers."""
    node_app = FastAPI()

    @node_app.get('/health')
    async def health():
        return {'status': 'ok'}

    @node_app.get('/v1/models')
    async def models():
        return {'object': 'list', 'data': []}

    @node_app.post('/v1/echo')
    async def echo(request: Request):
        response = JSONResponse({'cookie': request.headers.get('cookie'), 'query': request.url.query})
        response.set_cookie('session', 'first-client')
        return response

    @node_app.get('/v1/moved')
    async def moved():
        return RedirectResponse('/v1/elsewhere', status_code=307)

    node = ServerThread(node_app)
    proxy = ServerThread(create_proxy_app([node.url]))
    try:
        first = httpx.post(f'{proxy.url}/v1/echo?a=1&b=%20', json={})
        assert first.cookies.get('session') == 'first-client'
        assert first.json() == {'cookie': None, 'query': 'a=1&b=%20'}
        second = httpx.post(f'{proxy.url}/v1/echo', json={})
        assert second.json()['cookie'] is None
        redirect = httpx.get(f'{proxy.url}/v1/moved')
        assert redirect.status_code == 307 and redirect.headers['location'] == '/v1/elsewhere'
    finally:
        proxy.stop()
        node.stop()


def test_a_body_over_the_limit_is_refused_before_the_proxy_reads_it_all():
    """The proxy bounds the bodies it reads as the nodes do (a 413): a declared size over the limit is refused at
    once, a chunked body as soon as it passes the limit, and no node sees either."""
    node_app, seen = FastAPI(), []

    @node_app.get('/health')
    async def health():
        return {'status': 'ok'}

    @node_app.post('/v1/completions')
    async def completions(request: Request):
        seen.append(len(await request.body()))
        return {'ok': True}

    node = ServerThread(node_app)
    proxy = ServerThread(create_proxy_app([node.url], max_request_body_bytes=1024))
    try:
        assert httpx.post(f'{proxy.url}/v1/completions', content=b'x' * 1024).json() == {'ok': True}
        assert seen == [1024]
        over = httpx.post(f'{proxy.url}/v1/completions', content=b'x' * 1025)
        assert over.status_code == 413 and over.json()['error']['code'] == 'max_request_body_bytes_exceeded'
        chunked = httpx.post(f'{proxy.url}/v1/completions', content=iter([b'x' * 600] * 2))
        assert chunked.status_code == 413
        with socket.create_connection(('127.0.0.1', proxy.port), timeout=10) as sock:  # a terabyte announced
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n'
                         b'Content-Length: 1000000000000\r\n\r\n{"prompt": ')
            assert sock.recv(65536).startswith(b'HTTP/1.1 413 ')
        assert seen == [1024]
    finally:
        proxy.stop()
        node.stop()


def test_a_request_target_that_is_not_a_path_is_refused_and_reaches_no_other_host():
    """The proxy forwards paths only: a target such as ``@host:port/path`` (which, appended to the node's URL,
    named another host: the proxy sent the client's request there), an absolute URL or ``*`` is a 400."""
    elsewhere_app, reached = FastAPI(), []

    @elsewhere_app.get('/{path:path}')
    async def anything(path: str):
        reached.append(path)
        return {'reached': path}

    node_app = FastAPI()

    @node_app.get('/health')
    async def health():
        return {'status': 'ok'}

    elsewhere, node = ServerThread(elsewhere_app), ServerThread(node_app)
    proxy = ServerThread(create_proxy_app([node.url]))
    try:
        for target in (f'@127.0.0.1:{elsewhere.port}/secret', f'http://127.0.0.1:{elsewhere.port}/secret', '*'):
            with socket.create_connection(('127.0.0.1', proxy.port), timeout=10) as sock:
                sock.sendall(f'GET {target} HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n'.encode())
                answer = b''
                while chunk := sock.recv(65536):
                    answer += chunk
            head, _, body = answer.partition(b'\r\n\r\n')
            assert head.startswith(b'HTTP/1.1 400 '), (target, answer)
            assert json.loads(body)['error']['code'] == 'invalid_request_target'
        assert reached == []
    finally:
        proxy.stop()
        node.stop()
        elsewhere.stop()


def test_a_proxy_that_is_its_own_node_answers_508_instead_of_forwarding_in_a_loop():
    """A proxy added as a node of itself (or of a proxy in front of it) would forward a request to itself until
    every connection to that node is taken: its requests carry ``Via`` with the proxy's id, and one that comes
    back is a 508 ``loop_detected`` after one hop; ``/v1/models``, ``/metrics`` and ``/abort_request`` answer that
    too."""
    node_app = FastAPI()

    @node_app.get('/health')
    async def health():
        return {'status': 'ok'}

    node = ServerThread(node_app)
    proxy = ServerThread(create_proxy_app([node.url], request_timeout=30, max_connections_per_node=16))
    try:
        assert httpx.post(f'{proxy.url}/nodes/add', json={'url': proxy.url}).json()[proxy.url]['healthy']
        assert httpx.post(f'{proxy.url}/nodes/remove', json={'url': node.url}).status_code == 200
        answer = httpx.post(f'{proxy.url}/v1/completions', json={'model': 'tiny', 'prompt': 'Hi'}, timeout=60)
        assert answer.status_code == 508 and answer.json()['error']['code'] == 'loop_detected'
        assert answer.json()['error']['type'] == 'server_error'
        assert status(proxy.url)[proxy.url]['served'] == 1
        for path in ('/v1/models', '/metrics'):  # the node's answer (the proxy's own 508) comes back
            assert httpx.get(f'{proxy.url}{path}', timeout=60).status_code == 508
        # no node aborted anything: the abort is the 508 too
        assert httpx.post(f'{proxy.url}/abort_request', json={'session_id': 7}, timeout=60).status_code == 508
    finally:
        proxy.stop()
        node.stop()


def test_a_ring_of_two_proxies_cuts_models_metrics_and_aborts_after_one_round():
    """Proxy A in front of proxy B, which has a node and A: A's own answers from all nodes (``/v1/models``,
    ``/metrics``, ``/abort_request``) went to B, which asked A again without A's ``Via``, and so on until the
    first asker timed out (5 s), which also took both proxies' health checks down. They carry the ``Via`` of the
    request on now: the round through A is a 508 to B, and B answers with its node alone (an abort: success, as
    its node aborted; it once passed the 508 on)."""
    node_app, aborts = FastAPI(), []

    @node_app.get('/health')
    async def health():
        return {'status': 'ok'}

    @node_app.get('/v1/models')
    async def models():
        return {'object': 'list', 'data': [{'id': 'tiny', 'object': 'model'}]}

    @node_app.get('/metrics')
    async def node_metrics():
        return PlainTextResponse('# TYPE lmdeploy:num_requests_running gauge\nlmdeploy:num_requests_running 0.0\n')

    @node_app.post('/abort_request')
    async def abort(request: Request):
        aborts.append(await request.json())
        return {'success': True}

    node = ServerThread(node_app)
    inner = ServerThread(create_proxy_app([node.url]))
    outer = ServerThread(create_proxy_app([inner.url]))
    try:
        assert httpx.post(f'{inner.url}/nodes/add', json={'url': outer.url}).json()[outer.url]['healthy']
        start = time.monotonic()
        listed = httpx.get(f'{outer.url}/v1/models', timeout=30)
        assert listed.status_code == 200 and [card['id'] for card in listed.json()['data']] == ['tiny'], listed.text
        scraped = httpx.get(f'{outer.url}/metrics', timeout=30)
        assert scraped.status_code == 200 and f'node_healthy{{node="{inner.url}"}} 1.0' in scraped.text
        assert f'lmdeploy:num_requests_running{{node="{inner.url}"}} 0.0' in scraped.text
        aborted = httpx.post(f'{outer.url}/abort_request', json={'session_id': 7}, timeout=30)
        assert aborted.status_code == 200 and aborted.json() == {'success': True}, aborted.text
        assert time.monotonic() - start < 3 and aborts == [{'session_id': 7}]
        assert all(state['healthy'] for state in status(inner.url).values())
    finally:
        outer.stop()
        inner.stop()
        node.stop()
