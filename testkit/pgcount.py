"""A TCP proxy in front of a real PostgreSQL that counts the round trips its clients make.

A round trip of the wire protocol ends with the client's ``Sync`` (extended protocol:
asyncpg's every statement) or is one ``Query`` message (simple protocol: scripts): the
proxy reads the messages each client sends (after the untyped start-up, SSL and cancel
requests) and counts those two kinds, per connection and in all. What the server
answers is passed on untouched. Used by the shard benchmarks and tests to show the cost
of a shard group per renew interval from outside the sidecar, where the server's own
transaction counts also see autovacuum.

Runs its own event loop in a thread, so a synchronous test can use it::

    with CountingProxy(("127.0.0.1", pg_port)) as proxy:
        dsn = proxy.dsn(pg_dsn)       # the same DSN, through the proxy
        ...
        proxy.round_trips             # so far, all connections
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
import urllib.parse

_SSL_REQUEST = 80877103
_GSS_REQUEST = 80877104
_PROTOCOL_3 = 196608


class CountingProxy:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._lock = threading.Lock()
        self._count = 0
        self.port = 0

    @property
    def round_trips(self) -> int:
        with self._lock:
            return self._count

    def dsn(self, dsn: str) -> str:
        """``dsn`` (a postgresql:// URL) pointed at this proxy."""
        parts = urllib.parse.urlsplit(dsn)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@127.0.0.1:{self.port}" if auth else f"127.0.0.1:{self.port}"
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    def __enter__(self) -> CountingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.close()
            return
        back = asyncio.ensure_future(self._pipe(up_reader, writer))
        try:
            await self._client(reader, up_writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            up_writer.close()
            with contextlib.suppress(BaseException):
                await back
            writer.close()

    async def _client(self, reader: asyncio.StreamReader, up: asyncio.StreamWriter) -> None:
        """Forward what the client sends, message by message, counting round trips."""
        while True:  # untyped start-up messages: SSL/GSS requests, then the start-up
            head = await reader.readexactly(4)
            (length,) = struct.unpack(">I", head)
            body = await reader.readexactly(length - 4)
            up.write(head + body)
            await up.drain()
            (code,) = struct.unpack(">I", body[:4])
            if code not in (_SSL_REQUEST, _GSS_REQUEST):
                break
        while True:
            head = await reader.readexactly(5)
            kind, length = head[:1], struct.unpack(">I", head[1:])[0]
            body = await reader.readexactly(length - 4)
            if kind in (b"S", b"Q"):
                with self._lock:
                    self._count += 1
            up.write(head + body)
            await up.drain()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
