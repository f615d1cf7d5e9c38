"""An api_server that joins a proxy: :class:`NodeServer` registers at the proxy once it listens and
deregisters when it begins to shut down. A failure either way is logged; the server runs on."""
from __future__ import annotations

import logging
import socket

import httpx
import uvicorn

logger = logging.getLogger('lmdeploy')
WILDCARD_HOSTS = frozenset({'', '0.0.0.0', '::'})
REGISTER_TIMEOUT = 10.0


def advertised_url(host: str, port: int, proxy_url: str) -> str:
    """The URL the proxy can reach this server at: for a wildcard ``host``, the local address of the route
    to the proxy."""
    if host in WILDCARD_HOSTS:
        proxy = httpx.URL(proxy_url)
        family = socket.AF_INET6 if ':' in (proxy.host or '') else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((proxy.host, proxy.port or 80))  # a UDP connect sends nothing; it only picks a route
            host = probe.getsockname()[0]
    return f'http://[{host}]:{port}' if ':' in host else f'http://{host}:{port}'


class NodeServer(uvicorn.Server):
    """A uvicorn server that registers at ``proxy_url`` (``POST /nodes/add`` with its URL and ``models``)
    after it starts listening, and deregisters (``POST /nodes/remove``) before it drains. ``api_key``, when
    given, is sent as the proxy's Bearer key (an admin key of a proxy that has keys)."""

    def __init__(self, config: uvicorn.Config, proxy_url: str, models: list[str] | None, api_key: str | None = None):
        super().__init__(config)
        self.proxy_url = proxy_url.rstrip('/')
        self.models = models
        self.headers = {'Authorization': f'Bearer {api_key}'} if api_key else {}
        self.node_url: str | None = None

    async def _call_proxy(self, path: str, body: dict) -> bool:
        try:
            async with httpx.AsyncClient(timeout=REGISTER_TIMEOUT) as client:
                resp = await client.post(f'{self.proxy_url}{path}', json=body, headers=self.headers)
        except httpx.HTTPError as exc:
            logger.warning('proxy %s%s failed: %r', self.proxy_url, path, exc)
            return False
        if resp.status_code != 200:
            logger.warning('proxy %s%s answered %d: %s', self.proxy_url, path, resp.status_code, resp.text[:500])
        return resp.status_code == 200

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.started:
            return
        port = self.servers[0].sockets[0].getsockname()[1]
        try:
            url = advertised_url(self.config.host, port, self.proxy_url)
        except (OSError, httpx.InvalidURL) as exc:
            logger.warning('not registering at proxy %s: %r', self.proxy_url, exc)
            return
        if await self._call_proxy('/nodes/add', {'url': url, 'models': self.models}):
            self.node_url = url
            logger.info('registered at proxy %s as %s', self.proxy_url, url)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.node_url is not None:
            await self._call_proxy('/nodes/remove', {'url': self.node_url})
        await super().shutdown(sockets)
