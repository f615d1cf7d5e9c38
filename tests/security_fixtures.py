"""Fixtures of the security and VL server tests: an image server on 127.0.0.1, fake DNS answers, a record of the
addresses connected to, and a tiny Qwen2-VL."""
from __future__ import annotations

import http.server
import socket
import threading

import httpcore
import pytest
from test_vl import IMAGES, png_bytes
from vl_models import save_tiny_vl_model

from lmdeploy.vl.media import MediaPolicy

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
