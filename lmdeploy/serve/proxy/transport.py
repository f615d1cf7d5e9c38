"""The proxy's connections to a node: an httpcore pool whose connections send a request's head and body
in one write, so that the node wakes once for it, not once for each."""
from __future__ import annotations

import ssl
from collections.abc import Iterable

import httpcore

# what a forwarded request may raise once it left the pool (all but PoolTimeout and ConnectError say that
# the node may have seen it)
NODE_ERRORS = (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError)
KEEPALIVE_EXPIRY = 4.0


class FlushOnReadStream(httpcore.AsyncNetworkStream):
    """A connection's stream that keeps what is written until the connection next reads (HTTP/1.1 reads
    only once the request is written)."""

    def __init__(self, stream: httpcore.AsyncNetworkStream):
        self._stream = stream
        self._pending: list[bytes] = []
        self._write_timeout: float | None = None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            self._pending.append(buffer)
            self._write_timeout = timeout

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        await self._flush()
        return await self._stream.read(max_bytes, timeout)

    async def _flush(self) -> None:
        if self._pending:
            data, self._pending = b''.join(self._pending), []
            await self._stream.write(data, self._write_timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> FlushOnReadStream:
        await self._flush()
        return FlushOnReadStream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> object:
        return self._stream.get_extra_info(info)


class FlushOnReadBackend(httpcore.AsyncNetworkBackend):
    """httpcore's own asyncio backend, with :class:`FlushOnReadStream` streams."""

    def __init__(self):
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Iterable[tuple] | None = None) -> FlushOnReadStream:
        return FlushOnReadStream(await self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[tuple] | None = None) -> FlushOnReadStream:
        return FlushOnReadStream(await self._backend.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


def node_pool(max_connections: int) -> httpcore.AsyncConnectionPool:
    """A pool of at most ``max_connections`` keep-alive HTTP/1.1 connections to one node. An idle connection
    is dropped after :data:`KEEPALIVE_EXPIRY` seconds, before the node's uvicorn closes it (after 5 s), so
    that a request never goes out on a connection the node is closing."""
    return httpcore.AsyncConnectionPool(max_connections=max_connections, max_keepalive_connections=max_connections,
                                        keepalive_expiry=KEEPALIVE_EXPIRY, network_backend=FlushOnReadBackend())
