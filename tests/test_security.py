"""Security: API keys on every endpoint, keys kept out of logs, owned aborts, and where images may come from
(local files, loopback, private addresses, redirects, DNS rebinding) in the library defaults and in the
server that ``lmdeploy serve api_server`` builds."""
from __future__ import annotations

import http.server
import json
import logging
import os
import socket
import threading
import time

import httpcore
import httpx
import pytest
from server_helpers import ServerThread, slow_down, tiny_engine
from test_vl import IMAGES, png_bytes
from vl_models import save_tiny_vl_model

from lmdeploy.cli.chat import add_chat_parser
from lmdeploy.cli.serve import add_serve_parser
from lmdeploy.serve.openai import api_server as api_server_module
from lmdeploy.serve.openai.api_server import AUTH_EXEMPT, create_app
from lmdeploy.vl import media
from lmdeploy.vl.media import MediaPolicy, load_image

USER_KEYS = ['user-key-A-5f1c9e0d', 'user-key-B-7a2b3c4d']
ADMIN_KEY = 'admin-key-9e8d7c6b'
WRONG_KEY = 'wrong-key-0a1b2c3d'
LONG = {'input_ids': [5, 6, 7], 'max_tokens': 4000, 'ignore_eos': True, 'stream': True}
ALL = MediaPolicy(allowed_domains=('*',))  # any host name, private addresses still refused


def bearer(key: str) -> dict:
    return {'Authorization': f'Bearer {key}'}


def image_message(url: str) -> list[dict]:
    return [{'role': 'user', 'content': [{'type': 'text', 'text': 'describe'},
                                         {'type': 'image_url', 'image_url': {'url': url}}]}]


# ---------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope='module')
def qwen_vl(tmp_path_factory) -> str:
    return save_tiny_vl_model('qwen2_vl', str(tmp_path_factory.mktemp('qwen2_vl')))


@pytest.fixture(scope='module')
def image_host():
    """A real HTTP server on 127.0.0.1: /cat.png, redirects (/to?url), a redirect loop; ``hits`` counts paths."""
    body = png_bytes(IMAGES[0])
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            if self.path == '/cat.png':
                self.send_response(200)
                self.send_header('Content-Length', str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path.startswith('/to?'):
                self.send_response(302)
                self.send_header('Location', self.path[len('/to?'):])
                self.send_header('Content-Length', '0')
                self.end_headers()
            elif self.path == '/loop':
                self.send_response(302)
                self.send_header('Location', '/loop')
                self.send_header('Content-Length', '0')
                self.end_headers()
            else:
                self.send_response(404)
                self.send_header('Content-Length', '0')
                self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={'poll_interval': 0.05}, daemon=True)
    thread.start()
    yield server.server_address[1], hits
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def fake_dns(monkeypatch):
    """``names[host] = [addresses]`` makes ``host`` resolve to those (one list per lookup when a list of
    lists); every lookup of such a name is recorded in ``lookups``. Other names resolve as usual."""
    real = socket.getaddrinfo
    names: dict[str, list] = {}
    lookups: list[str] = []

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in names:
            return real(host, port, *args, **kwargs)
        lookups.append(host)
        answer = names[host]
        if answer and isinstance(answer[0], list):
            answer = answer[min(lookups.count(host), len(answer)) - 1]
        return [(socket.AF_INET6 if ':' in a else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, '',
                 (a, port)) for a in answer]

    monkeypatch.setattr(socket, 'getaddrinfo', getaddrinfo)
    return names, lookups


@pytest.fixture
def connects(monkeypatch):
    """Records every address the image loader's backend connects to (and then connects)."""
    real = httpcore.SyncBackend.connect_tcp
    seen: list[str] = []

    def connect_tcp(self, host, port, *args, **kwargs):
        seen.append(host)
        return real(self, host, port, *args, **kwargs)

    monkeypatch.setattr(httpcore.SyncBackend, 'connect_tcp', connect_tcp)
    return seen


# ---------------------------------------------------------------------------------------------------------
# library defaults


def test_library_defaults_allow_no_url_and_no_local_file(tmp_path):
    policy = MediaPolicy()
    assert policy.allowed_domains == () and policy.allowed_local_path is None and not policy.allow_private_hosts
    path = tmp_path / 'cat.png'
    path.write_bytes(png_bytes(IMAGES[0]))
    for source in (str(path), path.as_uri(), '/etc/passwd', 'file:///etc/passwd'):
        with pytest.raises(ValueError, match='local image files are not allowed'):
            load_image(source)
    with pytest.raises(ValueError, match='is not allowed'):
        load_image('http://example.com/cat.png')
    assert load_image(png_bytes(IMAGES[0])).size == IMAGES[0].size  # bytes, PIL images, data URLs still load
    local = MediaPolicy.for_local_caller()
    assert load_image(str(path), local).size == IMAGES[0].size


def test_pipeline_opts_into_local_files_and_async_engine_does_not(tiny_llama):
    from lmdeploy import PytorchEngineConfig, pipeline
    with pipeline(tiny_llama, PytorchEngineConfig(dtype='float32', num_gpu_blocks=16, block_size=16),
                  show_progress=False) as pipe:
        assert pipe.async_engine.processor.media_policy == MediaPolicy.for_local_caller()
    engine = tiny_engine(tiny_llama, num_gpu_blocks=16)
    try:
        assert engine.processor.media_policy == MediaPolicy()
    finally:
        engine.close()


def test_local_file_errors_do_not_tell_whether_a_path_exists(tmp_path):
    allowed = tmp_path / 'allowed'
    allowed.mkdir()
    (allowed / 'sub').mkdir()
    (tmp_path / 'outside.png').write_bytes(png_bytes(IMAGES[0]))
    os.mkfifo(allowed / 'fifo')
    policy = MediaPolicy(allowed_local_path=str(allowed))
    paths = [tmp_path / 'outside.png', tmp_path / 'no-such.png', allowed / 'no-such.png', allowed / 'sub',
             allowed / 'fifo', '/etc/passwd', '/etc/no-such-file']
    messages = set()
    for path in paths:
        start = time.monotonic()
        with pytest.raises(ValueError) as error:
            load_image(str(path), policy)
        assert time.monotonic() - start < 5  # a FIFO does not block
        messages.add(str(error.value).replace(repr(str(path)), 'PATH'))
    assert messages == {'cannot read image file PATH: it does not exist, is not a readable file or is outside '
                        'the allowed directory'}


def test_non_public_addresses_are_refused_before_connecting(connects):
    for host in ('127.0.0.1', '127.1.2.3', '[::1]', '[::ffff:127.0.0.1]', '10.0.0.1', '172.16.5.4', '192.168.1.1',
                 '169.254.169.254', '100.64.0.1', '0.0.0.0', '224.0.0.1', '240.0.0.1', '[fe80::1]', '[fc00::1]',
                 '[2002:7f00:1::1]', 'localhost'):
        with pytest.raises(ValueError, match='unknown or not a public address.*--allow-private-media-hosts'):
            load_image(f'http://{host}:9/cat.png', ALL)
    assert connects == []
    for address in ('8.8.8.8', '2606:4700:4700::1111', '93.184.215.14'):
        assert media._is_public(media.ipaddress.ip_address(address))


def test_private_hosts_allowed_only_by_the_flag(image_host):
    port, _ = image_host
    with pytest.raises(ValueError, match='not a public address'):
        load_image(f'http://127.0.0.1:{port}/cat.png', ALL)
    opted_in = MediaPolicy(allowed_domains=('*',), allow_private_hosts=True)
    assert load_image(f'http://127.0.0.1:{port}/cat.png', opted_in).tobytes() == IMAGES[0].tobytes()


def test_names_resolving_to_private_addresses_are_refused(fake_dns, connects):
    names, _ = fake_dns
    names['intranet.example.test'] = ['10.1.2.3']
    names['mixed.example.test'] = ['93.184.215.14', '127.0.0.1']  # one bad answer is enough
    policy = MediaPolicy(allowed_domains=('example.test',))
    for host in ('intranet.example.test', 'mixed.example.test'):
        with pytest.raises(ValueError, match='unknown or not a public address') as error:
            load_image(f'http://{host}/cat.png', policy)
        assert '10.1.2.3' not in str(error.value) and '127.0.0.1' not in str(error.value)
    assert connects == []


def test_connects_to_the_address_it_checked(fake_dns, monkeypatch):
    """DNS rebinding: the first answer is public, later ones loopback; the loader must not look again."""
    names, lookups = fake_dns
    names['rebind.example.test'] = [['93.184.215.14'], ['127.0.0.1']]
    connects = []

    def refuse_network(self, host, port, *args, **kwargs):  # no network in tests: record, then fail
        connects.append(host)
        raise httpcore.ConnectError('no network in tests')

    monkeypatch.setattr(httpcore.SyncBackend, 'connect_tcp', refuse_network)
    with pytest.raises(ValueError, match='could not fetch image') as error:
        load_image('http://rebind.example.test/cat.png', MediaPolicy(allowed_domains=('rebind.example.test',)))
    assert connects == ['93.184.215.14'] and lookups == ['rebind.example.test']
    assert 'no network' not in str(error.value)  # connection details stay in the log


def test_redirects_are_followed_only_where_the_policy_allows(image_host, fake_dns, connects, monkeypatch):
    port, hits = image_host
    names, _ = fake_dns
    # Pretend 127.0.0.1 is public and 127.0.0.2 private: public.test is the image host, internal.test "private".
    names['public.test'] = ['127.0.0.1']
    names['internal.test'] = ['127.0.0.2']
    monkeypatch.setattr(media, '_is_public', lambda ip: str(ip) == '127.0.0.1')
    policy = MediaPolicy(allowed_domains=('public.test', 'internal.test'))
    base = f'http://public.test:{port}'
    assert load_image(f'{base}/to?/cat.png', policy).tobytes() == IMAGES[0].tobytes()
    assert load_image(f'{base}/to?{base}/cat.png', policy).tobytes() == IMAGES[0].tobytes()
    refused = {
        f'{base}/to?http://internal.test:{port}/cat.png': 'unknown or not a public address',
        f'{base}/to?http://127.0.0.1:{port}/cat.png': 'redirects to a host that is not allowed',
        f'{base}/to?file:///etc/passwd': 'redirects to a URL that is not http',
        f'{base}/loop': 'more than 5 redirects',
    }
    for url, reason in refused.items():
        with pytest.raises(ValueError, match=reason):
            load_image(url, policy)
    assert '127.0.0.2' not in connects
    assert hits.count('/loop') == 6


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
    run_cli([qwen_vl, *base, '--allowed-media-domains', '*', 'localhost', '127.0.0.1'], monkeypatch, every_domain)
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
    assert {path for _, path, _ in opened} == {'/health'}, opened
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
        for session_id in range(0, max(running) + 3):  # a client guessing the small sequential ids
            r = httpx.post(f'{url}/abort_request', json={'session_id': session_id}, headers=bearer(USER_KEYS[1]))
            assert r.status_code == (403 if session_id in running else 200)
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
