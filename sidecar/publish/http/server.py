"""The listening socket: aiohttp's request handling behind a protocol factory of our own,
which turns away connections over :data:`~.limits.MAX_CONNECTIONS` before aiohttp reads
a byte of them, and a server log that keeps client garbage out of the error log."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from sidecar.publish.http.access import release_hosts
from sidecar.publish.http.limits import (
    HEADER_TIMEOUT,
    LIMITS,
    MAX_FIELD,
    MAX_HEADERS,
    MAX_LINE,
    RETRY_AFTER,
)

# Unread request body after an answer (no endpoint reads one): wait this long, then close.
LINGER = 1.0
SHUTDOWN_TIMEOUT = 2.0


class _ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log: a malformed request is the client's fault, logged as one
    debug line; anything else (a bug of ours: a 500) keeps its error and traceback."""

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError | ConnectionError):
            self.debug(msg, *args, exc_info=exc)
            return
        self.logger.error(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg: object, *args: object, **kwargs: Any) -> None:
        # aiohttp logs non-HTTP bytes on a fresh connection at debug, with a traceback.
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError | ConnectionError):
            kwargs.pop("exc_info")
            text = str(msg) % args if args else str(msg)
            msg, args = "%s: %s", (text, " ".join(str(exc).split())[:300])
        self.logger.debug(msg, *args, **kwargs)


_FULL = json.dumps({"error": "too many connections"})
_FULL_RESPONSE = (
    "HTTP/1.1 503 Service Unavailable\r\n"
    f"Retry-After: {RETRY_AFTER}\r\n"
    "Content-Type: application/json\r\n"
    f"Content-Length: {len(_FULL)}\r\n"
    "Connection: close\r\n\r\n"
    f"{_FULL}").encode()


class _Refuse(asyncio.Protocol):
    """One connection over the cap: answer 503 at once and close, reading nothing.

    The write side is shut first and what the client sends is drained for a moment, so
    a request arriving after the answer does not turn our close into a reset that would
    hide the 503 from the client.
    """

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(_FULL_RESPONSE)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(LINGER, transport.abort)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        self._transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()


class HttpServer:
    """Runs the app on ``host:port``; ``port`` 0 picks a free one (see ``bound_port``).

    The socket is our own ``loop.create_server`` rather than an aiohttp site, because
    only a protocol factory of our own can refuse a connection before aiohttp handles
    it; so the bound port comes from that server's sockets (``AppRunner.addresses``
    lists sites only).
    """

    def __init__(self, app: web.Application, host: str, port: int,
                 header_timeout: float = HEADER_TIMEOUT) -> None:
        self._limits = app[LIMITS]
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_TIMEOUT,
            # A client that goes away ends its parked query (and frees its slot) at once.
            handler_cancellation=True,
            # aiohttp's keep-alive timer is armed when a connection opens and after each
            # answer, and closes the connection if no complete request head arrived by
            # then: a header timeout against slowloris, and the idle keep-alive time.
            keepalive_timeout=header_timeout, lingering_time=LINGER,
            max_line_size=MAX_LINE, max_field_size=MAX_FIELD, max_headers=MAX_HEADERS,
            logger=_ServerLog(logging.getLogger("aiohttp.server"), {}))
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self.bound_port: int | None = None

    async def start(self) -> None:
        await self._runner.setup()
        handlers = self._runner.server
        assert handlers is not None
        limits = self._limits

        def connection() -> asyncio.BaseProtocol:
            if len(handlers.connections) >= limits.max_connections:
                limits.refused_connections += 1
                return _Refuse()
            return handlers()

        limits.open_connections = lambda: len(handlers.connections)
        self._server = await asyncio.get_running_loop().create_server(
            connection, self._host or None, self._port, reuse_address=True)
        sockets = self._server.sockets or ()
        self.bound_port = sockets[0].getsockname()[1] if sockets else self._port
        limits.release_hosts = release_hosts(self._host, self.bound_port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()  # stop accepting; the runner then closes connections
        await self._runner.cleanup()
        if self._server is not None:
            await self._server.wait_closed()
