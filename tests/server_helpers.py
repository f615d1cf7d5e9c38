"""Run an API server app with uvicorn on a free port in a background thread."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import httpx
import uvicorn

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.ports import free_port


def tiny_engine(path: str, media_policy=None, **kwargs) -> AsyncEngine:
    kwargs.setdefault('num_gpu_blocks', 256)
    kwargs.setdefault('block_size', 16)
    return AsyncEngine(path, PytorchEngineConfig(dtype='float32', **kwargs), show_progress=False,
                       media_policy=media_policy)


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """Unlabelled samples of ``/metrics`` by name (labelled ones keep their labels in the key)."""
    out = {}
    for line in httpx.get(f'{url}/metrics', headers=headers).text.splitlines():
        if line and not line.startswith('#'):
            name, value = line.rsplit(' ', 1)
            out[name] = float(value)
    return out


def wait_healthy(url: str, proc, timeout: float = 120) -> None:
    """Waits until the server process ``proc`` at ``url`` answers /health with 200."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f'{url}/health').status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, 'the server did not start'
        time.sleep(0.2)


class ServerThread:
    """``app`` served on 127.0.0.1 by uvicorn in a daemon thread; ``url`` is its base address."""

    def __init__(self, app):
        self.app = app
        self.port = free_port()
        self.url = f'http://127.0.0.1:{self.port}'
        self.server = uvicorn.Server(uvicorn.Config(app, host='127.0.0.1', port=self.port, log_level='warning'))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError('the test server did not start')
            time.sleep(0.02)

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """See :func:`metrics`."""
        return metrics(self.url, headers)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def slow_down(engine: AsyncEngine, seconds: float) -> None:
    """Makes every engine step take at least ``seconds`` longer, so that requests stay in flight a while."""
    step = engine.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()
    engine.engine.step = slow_step


def serve(engine: AsyncEngine, **app_kwargs) -> Iterator[ServerThread]:
    """A fixture's body (``yield from serve(...)``): ``engine`` behind a server (``server.engine``); the
    server stops and the engine closes afterwards."""
    from lmdeploy.serve.openai.api_server import create_app
    server = ServerThread(create_app(engine, **app_kwargs))
    server.engine = engine
    try:
        yield server
    finally:
        server.stop()
        engine.close()


def serve_per_parser(engine: AsyncEngine, **app_kwargs) -> Iterator[Callable[[str], ServerThread]]:
    """A fixture's body (``yield from serve_per_parser(...)``): yields ``of(parser)``, a server for a tool
    parser's name (started on first use, ``server.engine`` set), all on ``engine``; they stop and the engine
    closes afterwards."""
    from lmdeploy.serve.openai.api_server import create_app
    running: dict[str, ServerThread] = {}

    def of(parser: str) -> ServerThread:
        if parser not in running:
            running[parser] = ServerThread(create_app(engine, model_name='m', tool_call_parser=parser, **app_kwargs))
            running[parser].engine = engine
        return running[parser]
    try:
        yield of
    finally:
        for server in running.values():
            server.stop()
        engine.close()
