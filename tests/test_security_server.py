"""Security of the server: where images may come from in ``create_app(AsyncEngine(path))`` and in the server
that ``lmdeploy serve api_server`` builds, API keys on every endpoint, keys kept out of logs, owned aborts."""
from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from security_fixtures import (ADMIN_KEY, ALL, LONG, USER_KEYS, WRONG_KEY, bearer, image_host, image_message,  # noqa: F401
                               qwen_vl)
from server_helpers import ServerThread, slow_down, tiny_engine

from lmdeploy.cli.chat import add_chat_parser
from lmdeploy.cli.serve import add_serve_parser
from lmdeploy.serve.openai import api_server as api_server_module
from lmdeploy.serve.openai.api_server import AUTH_EXEMPT, create_app
from lmdeploy.vl.media import MediaPolicy

WEB_PATHS = {'/', '/web/app.js', '/web/markdown.js', '/web/style.css'}


# ---------------------------------------------------------------------------------------------------------
# the server: create_app(AsyncEngine(path)) and the one the CLI builds


def _refusals(url: str, image_port: int, headers: dict | None = None) -> dict[str, str]:
    """The error message of a chat request for each refused image source."""
    sources = ['file:///etc/passwd', '/etc/passwd', 'file:///etc/no-such-file',
               f'http://127.0.0.1:{image_port}/cat.png',
               f'http://localhost:{image_port}/cat.png', 'http://10.0.0.1/cat.png', 'http://169.254.169.254/latest',
               'http://[::1]/cat.png']
    out = {}
    for source in sources:
        r = httpx.post(f'{url}/v1/chat/completions', headers=headers, timeout=60, json={
            'model': 'tiny-vl', 'messages': image_message(source), 'max_tokens': 2})
        assert r.status_code == 400, (source, r.text)
        out[source] = r.json()['error']['message']
        assert 'root:' not in out[source]
    return out


def _accepted(url: str, source: str, headers: dict | None = None) -> bool:
    r = httpx.post(f'{url}/v1/chat/completions', headers=headers, timeout=60, json={
        'model': 'tiny-vl', 'messages': image_message(source), 'max_tokens': 2})
    return r.status_code == 200


def test_create_app_on_a_default_async_engine_refuses_local_files_and_private_hosts(qwen_vl, image_host):
    port, hits = image_host
    engine = tiny_engine(qwen_vl)  # AsyncEngine(path, config): no media_policy given
    server = ServerThread(create_app(engine, model_name='tiny-vl'))
    try:
        before = len(hits)
        messages = _refusals(server.url, port)
        assert all('not allowed' in m for m in messages.values()), messages
        assert messages['file:///etc/passwd'] == messages['file:///etc/no-such-file']
        # even with every host name allowed, loopback and private addresses stay refused
        engine.processor.media_policy = ALL
        messages = _refusals(server.url, port)
        for source, message in messages.items():
            if source.startswith('http'):
                assert 'not a public address' in message, (source, message)
        assert len(hits) == before  # the loopback image host was never asked
        engine.processor.media_policy = MediaPolicy(allowed_domains=('*',), allow_private_hosts=True)
        assert _accepted(server.url, f'http://127.0.0.1:{port}/cat.png')  # the refusals above were the policy
    finally:
        server.stop()
        engine.close()


def run_cli(argv: list[str], monkeypatch, check) -> None:
    """Runs ``lmdeploy serve api_server ARGV`` in this process up to the point where it would serve; then
    serves its app on a free port and calls ``check(url)`` instead."""
    import argparse

    def serve(app, host, port, log_level, shutdown_timeout):
        server = ServerThread(app)
        try:
            check(server.url)
        finally:
            server.stop()

    monkeypatch.setattr(api_server_module, 'run_server', serve)
    parser = argparse.ArgumentParser(prog='lmdeploy')
    commands = parser.add_subparsers(dest='command', required=True)
    add_chat_parser(commands)
    add_serve_parser(commands)
    args = parser.parse_args(['serve', 'api_server', *argv])
    args.run(args)


def test_cli_server_refuses_local_files_and_private_hosts(qwen_vl, image_host, monkeypatch):
    port, hits = image_host
    base = ['--dtype', 'float32', '--num-gpu-blocks', '64', '--model-name', 'tiny-vl', '--log-level', 'WARNING']
    before = len(hits)
    checked = []

    def defaults(url):
        assert all('not allowed' in m for m in _refusals(url, port).values())
        checked.append('defaults')

    def every_domain(url):
        messages = _refusals(url, port)
        assert all('not a public address' in m for s, m in messages.items() if s.startswith('http'))
        checked.append('every domain')

    def opted_in(url):
        assert _accepted(url, f'http://127.0.0.1:{port}/cat.png')
        checked.append('opted in')

    run_cli([qwen_vl, *base], monkeypatch, defaults)
    domains = ['--allowed-media-domains', '*', '--allowed-media-domains', 'localhost', '--allowed-media-domains',
               '127.0.0.1']
    run_cli([qwen_vl, *base, *domains], monkeypatch, every_domain)
    assert len(hits) == before
    run_cli([qwen_vl, *base, '--allowed-media-domains', '127.0.0.1', '--allow-private-media-hosts'], monkeypatch,
            opted_in)
    assert checked == ['defaults', 'every domain', 'opted in'] and hits[before:] == ['/cat.png']


def test_cli_admin_keys_without_api_keys(tiny_llama, monkeypatch):
    def check(url):
        assert httpx.get(f'{url}/v1/models').status_code == 200  # no --api-keys: inference stays open
        refused = httpx.post(f'{url}/abort_request', json={'abort_all': True})
        assert refused.status_code == 403 and 'admin' in refused.json()['error']['message']
        wrong = httpx.post(f'{url}/abort_request', json={'abort_all': True}, headers=bearer(WRONG_KEY))
        assert wrong.status_code == 403
        ok = httpx.post(f'{url}/abort_request', json={'abort_all': True}, headers=bearer(ADMIN_KEY))
        assert ok.status_code == 200 and ok.json() == {'success': True}

    run_cli([tiny_llama, '--dtype', 'float32', '--num-gpu-blocks', '32', '--admin-api-keys', ADMIN_KEY], monkeypatch,
            check)


# ---------------------------------------------------------------------------------------------------------
# API keys


@pytest.fixture(scope='module')
def keyed(tiny_llama):
    engine = tiny_engine(tiny_llama, num_gpu_blocks=512)
    slow_down(engine, 0.005)
    server = ServerThread(create_app(engine, model_name='tiny', api_keys=USER_KEYS, admin_api_keys=[ADMIN_KEY]))
    server.engine = engine
    yield server
    server.stop()
    engine.close()


def _paths(app) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, path parameters filled in."""
    from starlette.routing import Mount, Route, WebSocketRoute
    out = []
    for route in app.routes:
        assert isinstance(route, (Route, WebSocketRoute, Mount)), route
        path = route.path.replace('{', '').replace('}', '') or '/'
        if isinstance(route, WebSocketRoute):
            out.append(('WEBSOCKET', path))
            continue
        methods = getattr(route, 'methods', None) or {'GET', 'POST'}
        out += [(method, path) for method in sorted(methods | {'OPTIONS'})]
    return out


def test_every_endpoint_needs_a_key(keyed):
    app = keyed.app
    routes = _paths(app)
    paths = {path for _, path in routes}
    assert {'/v1/chat/completions', '/v1/completions', '/generate', '/v1/encode', '/abort_request', '/v1/models',
            '/metrics', '/health', '/docs', '/openapi.json'} <= paths, paths
    assert AUTH_EXEMPT == {'/health'}
    body = json.dumps({'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'prompt': 'hi',
                       'input': 'hi', 'abort_all': True, 'max_tokens': 1})
    opened = []
    for method, path in routes + [('GET', '/no-such-endpoint'), ('POST', '/v1/embeddings')]:
        if method == 'WEBSOCKET':
            pytest.fail(f'websocket route {path}: add it to this test')  # none today
        for headers in ({}, bearer(WRONG_KEY), {'Authorization': USER_KEYS[0]}, {'Authorization': 'Basic x'}):
            r = httpx.request(method, f'{keyed.url}{path}', content=body,
                              headers={**headers, 'Content-Type': 'application/json'})
            if r.status_code != 401:
                opened.append((method, path, r.status_code))
            elif method != 'HEAD':
                assert r.json()['error']['code'] == 'invalid_api_key'
    # the chat page's own files are public (the page asks for a key and sends it with its API calls)
    assert {path for _, path, _ in opened} == {'/health'} | WEB_PATHS, opened
    for path in WEB_PATHS:
        page = httpx.get(f'{keyed.url}{path}')
        assert page.status_code == 200 and page.headers['content-type'].startswith(('text/html', 'text/javascript',
                                                                                      'text/css'))
    # and the keys do open them
    assert httpx.get(f'{keyed.url}/v1/models', headers=bearer(USER_KEYS[1])).status_code == 200
    assert httpx.get(f'{keyed.url}/docs', headers=bearer(ADMIN_KEY)).status_code == 200
    assert httpx.get(f'{keyed.url}/openapi.json', headers=bearer(USER_KEYS[0])).status_code == 200


def _start_stream(url: str, key: str, session_id: int | None = None):
    """A long streamed /generate; returns (context manager, line iterator) once its first token arrived."""
    body = dict(LONG, session_id=session_id) if session_id is not None else LONG
    stream = httpx.stream('POST', f'{url}/generate', json=body, headers=bearer(key), timeout=60)
    response = stream.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith('data:'))
    return stream, lines


def _finish(lines) -> str:
    events = [line for line in lines if line.startswith('data:') and line != 'data: [DONE]']
    return json.loads(events[-1][len('data: '):])['finish_reason']


def _streams_on(lines, count: int = 3) -> bool:
    got = 0
    for line in lines:
        if line.startswith('data:'):
            if '"finish_reason": null' not in line:
                return False
            got += 1
            if got == count:
                return True
    return False


def test_only_the_key_that_started_a_session_aborts_it(keyed):
    url = keyed.url
    stream, lines = _start_stream(url, USER_KEYS[0], session_id=4242)
    try:
        other = httpx.post(f'{url}/abort_request', json={'session_id': 4242}, headers=bearer(USER_KEYS[1]))
        assert other.status_code == 403 and 'not started with your API key' in other.json()['error']['message']
        assert _streams_on(lines)  # still running
        everything = httpx.post(f'{url}/abort_request', json={'abort_all': True}, headers=bearer(USER_KEYS[0]))
        assert everything.status_code == 403 and 'admin' in everything.json()['error']['message']
        assert httpx.post(f'{url}/abort_request', json={'abort_all': True}).status_code == 401
        assert _streams_on(lines)
        mine = httpx.post(f'{url}/abort_request', json={'session_id': 4242}, headers=bearer(USER_KEYS[0]))
        assert mine.status_code == 200 and mine.json() == {'success': True}
        assert _finish(lines) == 'abort'
    finally:
        stream.__exit__(None, None, None)
    # an idle or unknown session: nothing to abort, for any key
    idle = httpx.post(f'{url}/abort_request', json={'session_id': 4242}, headers=bearer(USER_KEYS[1]))
    assert idle.status_code == 200


def test_anonymous_sessions_cannot_be_aborted_by_guessing_ids(keyed):
    url = keyed.url
    stream, lines = _start_stream(url, USER_KEYS[0])
    try:
        running = [sid for sid, s in list(keyed.engine.session_manager.sessions.items()) if s.request is not None]
        assert len(running) == 1
        for session_id in [*running, 0, 1, 2]:  # anonymous ids are negative: no client can send them
            r = httpx.post(f'{url}/abort_request', json={'session_id': session_id}, headers=bearer(USER_KEYS[1]))
            assert r.status_code == (400 if session_id < 0 else 200)
        assert _streams_on(lines)
        admin = httpx.post(f'{url}/abort_request', json={'abort_all': True}, headers=bearer(ADMIN_KEY))
        assert admin.status_code == 200 and admin.json() == {'success': True}
        assert _finish(lines) == 'abort'
    finally:
        stream.__exit__(None, None, None)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter('%(name)s %(levelname)s %(message)s'))
        self.lines: list[str] = []

    def emit(self, record):
        if getattr(record, '_seen', self) is not self:
            return
        record._seen = self  # a record that propagates to several of the loggers counts once
        self.lines.append(self.format(record) + repr(record.__dict__))


def test_keys_never_appear_in_logs(keyed):
    url = keyed.url
    handler = _Records()
    names = ['', 'lmdeploy', 'uvicorn', 'uvicorn.error', 'uvicorn.access', 'fastapi', 'starlette', 'httpx',
             'httpcore']
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:  # uvicorn's loggers do not propagate: each gets the handler
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    try:
        chat = {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'Hello'}], 'max_tokens': 2}
        for key in USER_KEYS + [ADMIN_KEY, WRONG_KEY]:
            httpx.post(f'{url}/v1/chat/completions', json=chat, headers=bearer(key))
            httpx.post(f'{url}/v1/chat/completions', json={**chat, 'stream': True}, headers=bearer(key))
            httpx.post(f'{url}/v1/completions', json={'model': 'tiny', 'prompt': 'x', 'max_tokens': 2,
                                                     'temperature': -1}, headers=bearer(key))  # a 400
            httpx.post(f'{url}/abort_request', json={'abort_all': True}, headers=bearer(key))
            httpx.post(f'{url}/abort_request', json={'session_id': 1}, headers=bearer(key))
            httpx.get(f'{url}/v1/models', headers={'Authorization': f'Basic {key}'})
        time.sleep(0.2)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    assert any('/v1/chat/completions' in line for line in handler.lines), 'the access log was not captured'
    for key in USER_KEYS + [ADMIN_KEY, WRONG_KEY]:
        assert not [line for line in handler.lines if key in line], key
