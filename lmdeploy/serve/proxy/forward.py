"""Forwarding one request to a node: the node's status, headers and body come back unchanged, chunk by chunk
as the node sends them, and a client that goes away closes the node's connection (the node then aborts)."""
from __future__ import annotations

import asyncio
import json
import logging

import httpcore
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from lmdeploy.serve.openai.errors import error_body, error_response
from lmdeploy.serve.proxy.nodes import Node, NodeRegistry
from lmdeploy.serve.proxy.routing import LeastRequests
from lmdeploy.serve.proxy.transport import NODE_ERRORS

logger = logging.getLogger('lmdeploy')
HOP_BY_HOP = frozenset({'connection', 'keep-alive', 'proxy-authenticate', 'proxy-authorization', 'te', 'trailer',
                        'transfer-encoding', 'upgrade'})
REQUEST_DROP = HOP_BY_HOP | {'host', 'content-length'}
RESPONSE_DROP = HOP_BY_HOP | {'date', 'server'}


def proxy_error(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error the proxy itself answers (its errors name no request field)."""
    return error_response(status, message, code=code, headers=headers)


def forwarded_headers(raw: list[tuple[bytes, bytes]], drop: frozenset[str]) -> list[tuple[bytes, bytes]]:
    return [(key, value) for key, value in raw if key.decode('latin-1').lower() not in drop]


async def send_error(send: Send, status: int, message: str, code: str) -> None:
    """Sends a whole :func:`proxy_error` response on ``send``."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({'type': 'http.response.start', 'status': status,
                'headers': [(b'content-type', b'application/json'), (b'content-length', str(len(body)).encode())]})
    await send({'type': 'http.response.body', 'body': body})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())['type'] != 'http.disconnect':
        pass


MODEL_PATH = '/v1/models/'


class Forward(Response):
    """The ASGI response of one forwarded request: the node is chosen by ``strategy`` among the healthy ones
    (those serving the body's ``model``, or the one a ``/v1/models/{model}`` path names, when any does). A node
    that refuses the connection is marked down and the next one is tried (the request never reached it); with
    none left the answer is a 503 ``no_healthy_node``. A node that fails mid-answer ends a server-sent-event
    stream with an error event (``node_failed``), and cuts any other body short, so that the client sees an
    error rather than waiting."""

    def __init__(self, registry: NodeRegistry, strategy: LeastRequests, scope: Scope, body: bytes):
        super().__init__()
        self.registry, self.strategy, self.body = registry, strategy, body
        self.method = scope['method']
        query = scope.get('query_string', b'').decode('latin-1')
        self.target = scope.get('raw_path', b'').decode('latin-1').partition('?')[0] or scope['path']
        self.target += f'?{query}' if query else ''
        self.request_headers = forwarded_headers(scope['headers'], REQUEST_DROP)
        self.timeout = registry.timeout.as_dict()
        try:
            self.parsed = json.loads(body) if body else None
        except (ValueError, RecursionError):  # the node answers the body's fault itself
            self.parsed = None
        model = self.parsed.get('model') if isinstance(self.parsed, dict) else None
        if scope['path'].startswith(MODEL_PATH):  # GET /v1/models/{model}: the model is in the path
            model = scope['path'][len(MODEL_PATH):]
        self.model = model if isinstance(model, str) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.target.startswith('/'):  # appended to the node's URL, '@host/...' would name another host
            await send_error(send, 400, f'the request target must be a path starting with /, got {self.target!r}',
                             'invalid_request_target')
            return
        task, finished = asyncio.current_task(), False
        watch = asyncio.ensure_future(_wait_disconnect(receive))

        def on_disconnect(done: asyncio.Future) -> None:
            if not finished and not done.cancelled():
                task.cancel()

        watch.add_done_callback(on_disconnect)
        try:
            await self._forward(send)
        except asyncio.CancelledError:
            if watch.cancelled() or not watch.done():
                raise  # cancelled from outside, not by the client's disconnect
            task.uncancel()
        finally:
            finished = True
            watch.cancel()

    async def _forward(self, send: Send) -> None:
        tried: set[str] = set()
        while True:
            nodes = [node for node in self.registry.healthy(self.model) if node.url not in tried]
            if not nodes:
                message = 'no healthy node: ' + ('every node refused the connection' if tried else
                                                 'the proxy has no node that passes its health check')
                await send_error(send, 503, message, 'no_healthy_node')
                return
            node = self.strategy.choose(nodes, self.parsed)
            self.registry.acquire(node)
            try:
                if await self._try(node, send):
                    return
            finally:
                await self.registry.release(node)
            tried.add(node.url)

    async def _try(self, node: Node, send: Send) -> bool:
        """Forwards to ``node``; False when it refused the connection (and nothing was sent)."""
        headers = [(b'host', node.url.partition('://')[2].encode()),
                   (b'content-length', str(len(self.body)).encode()), *self.request_headers,
                   (b'via', self.registry.via.encode())]
        request = httpcore.Request(self.method, node.url + self.target, headers=headers, content=self.body,
                                   extensions={'timeout': self.timeout})
        try:
            upstream = await node.pool.handle_async_request(request)
        except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
            self.registry.mark_down(node, f'connection failed: {exc!r}')
            return False
        except httpcore.PoolTimeout:
            await send_error(send, 503, f'node {node.url} had no free connection within '
                             f'{self.registry.request_timeout} s', 'node_busy')
            return True
        except NODE_ERRORS as exc:
            self._failed(node, exc)
            await send_error(send, 502, f'node {node.url} failed before answering: {exc!r}', 'node_failed')
            return True
        try:
            await self._relay(node, upstream, send)
        finally:
            await upstream.aclose()
        return True

    async def _relay(self, node: Node, upstream: httpcore.Response, send: Send) -> None:
        # The head goes out with the first chunk of the body: one wake-up of the client, not two.
        start = {'type': 'http.response.start', 'status': upstream.status,
                 'headers': forwarded_headers(upstream.headers, RESPONSE_DROP)}
        stream = any(key.lower() == b'content-type' and value.startswith(b'text/event-stream')
                     for key, value in upstream.headers)
        try:
            async for chunk in upstream.aiter_stream():
                if start is not None:
                    await send(start)
                    start = None
                await send({'type': 'http.response.body', 'body': chunk, 'more_body': True})
        except NODE_ERRORS as exc:
            self._failed(node, exc)
            if start is not None:
                await send_error(send, 502, f'node {node.url} failed before answering: {exc!r}', 'node_failed')
                return
            if not stream:
                raise
            body = error_body(502, f'node {node.url} failed mid-stream: {exc!r}', code='node_failed')
            event = f'data: {json.dumps(body)}\n\ndata: [DONE]\n\n'.encode()
            await send({'type': 'http.response.body', 'body': event, 'more_body': True})
        if start is not None:
            await send(start)
        await send({'type': 'http.response.body', 'body': b'', 'more_body': False})

    def _failed(self, node: Node, exc: Exception) -> None:
        logger.warning('proxy: %s %s on node %s failed: %r', self.method, self.target, node.url, exc)
        if not isinstance(exc, httpcore.TimeoutException):
            self.registry.mark_down(node, f'{type(exc).__name__}: {exc}')
