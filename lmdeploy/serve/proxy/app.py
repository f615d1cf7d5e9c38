"""The proxy's FastAPI app (:func:`create_proxy_app`) and its server (:func:`run_proxy`)."""
from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from lmdeploy.messages import ConfigError
from lmdeploy.serve.openai.errors import install_error_handlers
from lmdeploy.serve.openai.limits import BodyLimitMiddleware, RequestLimits
from lmdeploy.serve.proxy.aggregate import NO_NODE, list_models, metrics
from lmdeploy.serve.proxy.forward import Forward, proxy_error
from lmdeploy.serve.proxy.nodes import NodeRegistry
from lmdeploy.serve.proxy.registration import NodeServer
from lmdeploy.serve.proxy.routing import LeastRequests, make_strategy

logger = logging.getLogger('lmdeploy')
NODE_PATHS = frozenset({'/nodes/add', '/nodes/remove'})


class NodeRequest(BaseModel):
    url: str
    models: list[str] | None = None


def _has_key(headers: list[tuple[bytes, bytes]], keys: list[bytes]) -> bool:
    scheme, _, token = dict(headers).get(b'authorization', b'').partition(b' ')
    token = token.strip()
    found = False
    for key in keys:  # every key is compared, so that the time taken does not tell which one matched
        found |= hmac.compare_digest(token, key)
    return scheme.lower() == b'bearer' and found


class ProxyAuth:
    """Bearer keys: with ``api_keys``, every endpoint but ``/health`` needs one of them or of ``admin_keys``;
    ``/nodes/add`` and ``/nodes/remove`` need one of ``admin_keys`` (without any, they are refused)."""

    def __init__(self, app: ASGIApp, api_keys: list[str], admin_keys: list[str]):
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        self.admin_keys = [key.encode() for key in admin_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope['type'] != 'http' or scope['path'] == '/health':
            await self.app(scope, receive, send)
            return
        admin = scope['path'] in NODE_PATHS
        if _has_key(scope['headers'], self.admin_keys if admin else self.api_keys + self.admin_keys):
            await self.app(scope, receive, send)
        elif admin and _has_key(scope['headers'], self.api_keys):
            await proxy_error(403, 'adding and removing nodes needs an admin key (the proxy takes them with '
                              '--admin-api-keys)', 'admin_key_required')(scope, receive, send)
        else:
            await proxy_error(401, 'missing or invalid API key (send Authorization: Bearer <key>)',
                              'invalid_api_key', {'WWW-Authenticate': 'Bearer'})(scope, receive, send)


class LoopGuard:
    """Answers 508 ``loop_detected`` to a request that carries this proxy's own ``Via`` (``via``): it came back
    through a node that is the proxy itself or leads back to it, and forwarding it again would go round until
    every connection is taken. ``/health`` is answered, so that such a node shows as healthy while it lasts."""

    def __init__(self, app: ASGIApp, via: str):
        self.app, self.via = app, via.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope['type'] == 'http' and scope['path'] != '/health' and any(
                key == b'via' and self.via in value for key, value in scope['headers']):
            await proxy_error(508, 'the request came back to this proxy: one of its nodes is the proxy itself, or '
                              'a proxy in front of it; remove that node', 'loop_detected')(scope, receive, send)
            return
        await self.app(scope, receive, send)


class ForwardOthers:
    """Every HTTP request for a path the proxy does not serve itself (chat, completions, generate, encode,
    ...) goes to one node (:class:`Forward`), without the app's routing."""

    def __init__(self, app: ASGIApp, registry: NodeRegistry, strategy: LeastRequests, own_paths: frozenset[str]):
        self.app, self.registry, self.strategy, self.own_paths = app, registry, strategy, own_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope['type'] != 'http' or scope['path'] in self.own_paths:
            await self.app(scope, receive, send)
            return
        body, more = [], True
        while more:
            message = await receive()
            if message['type'] == 'http.disconnect':
                return
            body.append(message.get('body', b''))
            more = message.get('more_body', False)
        await Forward(self.registry, self.strategy, scope, b''.join(body))(scope, receive, send)


def _onward_headers(request: Request, via: str) -> dict[str, str]:
    """The headers of the proxy's own requests to its nodes for ``request``: the client's ``Authorization``, and
    ``Via`` with the request's own hops before the proxy's, so that a loop of proxies ends at :class:`LoopGuard`."""
    headers = {'via': ', '.join([*request.headers.getlist('via'), via])}
    auth = request.headers.get('authorization')
    return {**headers, 'authorization': auth} if auth else headers


def create_proxy_app(nodes: list[str] = (), routing_strategy: str = 'least_requests',
                     api_keys: list[str] | None = None, admin_api_keys: list[str] | None = None,
                     health_interval: float = 5.0, request_timeout: float = 600.0,
                     max_connections_per_node: int = 1024, affinity_prefix_chars: int = 512,
                     max_request_body_bytes: int | None = RequestLimits.max_request_body_bytes) -> FastAPI:
    """A proxy in front of the api_servers at ``nodes`` (more join through ``/nodes/add``).

    Requests go to a healthy node picked by ``routing_strategy`` (see :data:`ROUTING_STRATEGIES`) and its
    answer comes back unchanged and unbuffered; the client's ``Authorization`` goes on to the node, so the
    nodes' own keys apply. ``api_keys`` and ``admin_api_keys`` guard the proxy itself (see
    :class:`ProxyAuth`); with neither, anyone who reaches it may also add nodes. Nodes are checked every
    ``health_interval`` seconds; see :class:`NodeRegistry` for ``request_timeout`` and
    ``max_connections_per_node``. A request body over ``max_request_body_bytes`` (None: no limit) is a 413, as
    on the nodes, before the proxy has read more of it than that."""
    if max_request_body_bytes is not None and max_request_body_bytes < 1:
        raise ConfigError(f'max_request_body_bytes must be positive (or None: no limit), got {max_request_body_bytes}')
    registry = NodeRegistry(list(nodes), health_interval, request_timeout, max_connections_per_node)
    strategy = make_strategy(routing_strategy, affinity_prefix_chars)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await registry.start()
        yield
        await registry.close()

    app = FastAPI(title='lmdeploy proxy', lifespan=lifespan)
    app.state.registry = registry
    install_error_handlers(app)

    @app.get('/health')
    async def health() -> Response:
        """200 while some node passes its health check, else 503."""
        alive = len(registry.healthy())
        return JSONResponse({'status': 'ok', 'healthy_nodes': alive}) if alive else proxy_error(
            503, NO_NODE, 'no_healthy_node')

    @app.get('/nodes/status')
    async def nodes_status() -> dict:
        """Every node by URL: healthy, requests in flight, requests served, models, last check and error."""
        return {url: node.status() for url, node in registry.nodes.items()}

    @app.post('/nodes/add')
    async def add_node(req: NodeRequest) -> Response:
        """Adds a node (``models``: what it serves, if known) and checks its health at once."""
        try:
            node = await registry.add(req.url, req.models)
        except ValueError as exc:
            return proxy_error(400, str(exc), 'invalid_node_url')
        return JSONResponse({node.url: node.status()})

    @app.post('/nodes/remove')
    async def remove_node(req: NodeRequest) -> Response:
        """Removes a node; its requests in flight run to their end."""
        try:
            removed = await registry.remove(req.url)
        except ValueError as exc:
            return proxy_error(400, str(exc), 'invalid_node_url')
        return JSONResponse({'success': True}) if removed else proxy_error(404, f'no node {req.url}',
                                                                           'unknown_node')

    @app.get('/v1/models')
    async def models(request: Request) -> Response:
        """The models of all healthy nodes."""
        return await list_models(registry, _onward_headers(request, registry.via))

    @app.get('/metrics')
    async def node_metrics(request: Request) -> Response:
        """Every healthy node's metrics (label ``node``) and the proxy's per-node gauges."""
        return await metrics(registry, _onward_headers(request, registry.via))

    @app.post('/abort_request')
    async def abort_request(request: Request) -> Response:
        """Sent on to every healthy node; the first answer that is not a 200 comes back, else success. A 508
        ``loop_detected`` is the answer of a node that leads back to a proxy the abort already passed: it counts
        only when no node aborted."""
        body = await request.body()
        headers = {**_onward_headers(request, registry.via), 'content-type': 'application/json'}
        nodes = registry.healthy()
        if not nodes:
            return proxy_error(503, NO_NODE, 'no_healthy_node')
        answers = await asyncio.gather(*(node.client.post('/abort_request', content=body, headers=headers)
                                         for node in nodes), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                return proxy_error(502, f'a node failed to abort: {answer!r}', 'node_failed')
        refused = [answer for answer in answers if answer.status_code not in (200, 508)]
        if refused or all(answer.status_code == 508 for answer in answers):
            first = (refused or answers)[0]
            return Response(first.content, first.status_code, media_type=first.headers.get('content-type'))
        return JSONResponse({'success': True})

    app.add_middleware(ForwardOthers, registry=registry, strategy=strategy,
                       own_paths=frozenset(route.path for route in app.routes))
    app.add_middleware(LoopGuard, via=registry.via)
    if max_request_body_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_keys or admin_api_keys:
        app.add_middleware(ProxyAuth, api_keys=list(api_keys or ()), admin_keys=list(admin_api_keys or ()))
    return app


def quiet_signal(signum: int, _frame: object) -> None:
    """A signal handler for after uvicorn's own: uvicorn raises the signal it handled again once it is done."""
    logger.info('signal %d handled: the server has shut down', signum)


def run_proxy(app: FastAPI, host: str = '127.0.0.1', port: int = 8000, log_level: str = 'info',
              shutdown_timeout: float = 30.0, proxy_url: str | None = None, proxy_api_key: str | None = None) -> None:
    """Serves ``app`` until SIGINT/SIGTERM, then lets requests in flight finish for ``shutdown_timeout`` s and
    returns. With ``proxy_url``, it joins that (outer) proxy as a node while it runs."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=shutdown_timeout)
    signal.signal(signal.SIGTERM, quiet_signal)
    server = NodeServer(config, proxy_url, None, proxy_api_key) if proxy_url else uvicorn.Server(config)
    server.run()
