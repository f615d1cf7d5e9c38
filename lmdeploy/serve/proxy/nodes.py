"""The proxy's nodes: the api_servers it fronts, their health and their requests in flight."""
from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass

import httpcore
import httpx

from lmdeploy.messages import ConfigError
from lmdeploy.serve.proxy.transport import node_pool

logger = logging.getLogger('lmdeploy')
CONNECT_TIMEOUT = 5.0
HOST = re.compile(r'[A-Za-z0-9._:-]+')  # a host name, an IPv4 address or an IPv6 one (without its brackets)


def normalize_url(url: str) -> str:
    """``url`` as the registry keys it (``http://host:port``, no trailing slash); :class:`ConfigError` (a
    ``ValueError``) if it is not one."""
    try:
        parsed = httpx.URL(url.strip())
    except (httpx.InvalidURL, TypeError) as exc:
        raise ConfigError(f'not a node URL: {url!r}') from exc
    if (parsed.scheme not in ('http', 'https') or not HOST.fullmatch(parsed.host) or parsed.query
            or parsed.path not in ('', '/') or not 0 < (80 if parsed.port is None else parsed.port) < 65536):
        raise ConfigError(f'a node URL is http(s)://host[:port], got {url!r}')
    return str(parsed.copy_with(path='/')).rstrip('/')


@dataclass(eq=False)
class Node:
    """One api_server. ``pool`` holds the bounded connection pool of forwarded requests (no cookies kept
    between clients, no redirects followed); ``client`` sends the proxy's own requests. ``models`` are the
    ids its ``/v1/models`` lists (None while unknown: it may serve any)."""

    url: str
    pool: httpcore.AsyncConnectionPool
    client: httpx.AsyncClient
    models: list[str] | None = None
    healthy: bool = False
    outstanding: int = 0
    error: str | None = 'not checked yet'
    checked: float | None = None
    removed: bool = False
    served: int = 0

    def status(self) -> dict:
        """What ``/nodes/status`` says of this node."""
        return {'healthy': self.healthy, 'outstanding': self.outstanding, 'served': self.served,
                'models': self.models, 'error': self.error, 'last_check': self.checked}

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models

    async def aclose(self) -> None:
        await self.pool.aclose()
        await self.client.aclose()


class NodeRegistry:
    """The nodes, keyed by URL, with a background task that checks each one's ``/health`` every
    ``health_interval`` seconds: a node that fails the check (or refuses a connection) takes no new
    requests until it passes again.

    Each node gets its own pool of at most ``max_connections`` connections, so that a slow node cannot
    starve the others; ``request_timeout`` bounds each wait on a node (for its answer, for its next
    streamed chunk, for a free connection)."""

    def __init__(self, urls: list[str] = (), health_interval: float = 5.0, request_timeout: float = 600.0,
                 max_connections: int = 1024):
        for name, value in (('health_interval', health_interval), ('request_timeout', request_timeout),
                            ('max_connections_per_node', max_connections)):
            if not value > 0:
                raise ConfigError(f'{name} must be positive, got {value}')
        self.health_interval = health_interval
        self.request_timeout = request_timeout
        self.timeout = httpx.Timeout(request_timeout, connect=CONNECT_TIMEOUT)
        self.max_connections = max_connections
        self.nodes: dict[str, Node] = {}
        # What this proxy's requests to its nodes carry in ``Via``: a request that comes back with it went round a loop.
        self.via = f'1.1 lmdeploy-proxy-{uuid.uuid4().hex[:16]}'
        # Health checks and metrics scrapes get a client of their own, so that full pools cannot hold them up.
        self.probe = httpx.AsyncClient(timeout=CONNECT_TIMEOUT, headers={'via': self.via})
        self._task: asyncio.Task | None = None
        for url in urls:
            self._new_node(url)

    def _new_node(self, url: str, models: list[str] | None = None) -> Node:
        url = normalize_url(url)
        node = self.nodes.get(url)
        if node is None:
            client = httpx.AsyncClient(base_url=url, timeout=self.timeout, headers={'via': self.via})
            node = self.nodes[url] = Node(url, node_pool(self.max_connections), client)
        if models:
            node.models = list(models)
        return node

    def healthy(self, model: str | None = None) -> list[Node]:
        """The nodes that take requests (for ``model``, when some healthy node lists it)."""
        alive = [node for node in self.nodes.values() if node.healthy]
        serving = [node for node in alive if node.serves(model)]
        return serving or alive

    async def add(self, url: str, models: list[str] | None = None) -> Node:
        """Adds the node at ``url`` (or refreshes it, when known) and checks it at once."""
        node = self._new_node(url, models)
        await self.check(node)
        return node

    async def remove(self, url: str) -> bool:
        """Drops the node; requests in flight on it run to their end. False when it was not known."""
        node = self.nodes.pop(normalize_url(url), None)
        if node is None:
            return False
        node.removed = True
        if not node.outstanding:
            await node.aclose()
        return True

    def acquire(self, node: Node) -> None:
        node.outstanding += 1
        node.served += 1

    async def release(self, node: Node) -> None:
        node.outstanding -= 1
        if node.removed and not node.outstanding:
            await node.aclose()

    def mark_down(self, node: Node, reason: str) -> None:
        """Takes ``node`` out of routing until its next passed health check."""
        if node.healthy:
            logger.warning('proxy: node %s is down: %s', node.url, reason)
        node.healthy, node.error = False, reason

    async def check(self, node: Node) -> None:
        """One health check: ``/health`` must answer 200; ``/v1/models`` refreshes what the node serves."""
        try:
            resp = await self.probe.get(f'{node.url}/health')
            ok, reason = resp.status_code == 200, f'/health answered {resp.status_code}'
            if ok:
                models = await self.probe.get(f'{node.url}/v1/models')
                if models.status_code == 200:
                    node.models = [card['id'] for card in models.json().get('data', ())]
        except Exception as exc:  # whatever a node does, a failed check only takes it out of routing
            ok, reason = False, f'{type(exc).__name__}: {exc}'
        node.checked = time.time()
        if ok:
            if not node.healthy:
                logger.info('proxy: node %s is up', node.url)
            node.healthy, node.error = True, None
        else:
            self.mark_down(node, reason)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(node) for node in list(self.nodes.values())))

    async def _check_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_all()

    async def start(self) -> None:
        """Checks every node once, then keeps checking them in the background."""
        await self.check_all()
        self._task = asyncio.create_task(self._check_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for node in self.nodes.values():
            await node.aclose()
        await self.probe.aclose()
