"""The listening socket and HTTP/1.1 on it: ``h11`` (sans-I/O) parses the requests under
an asyncio protocol of our own, which writes the answers and enforces :mod:`.limits`.

Why not ``aiohttp.web``: importing aiohttp took 200 to 260 ms of this machine's CPU (its
package imports the client and builds two TLS contexts), most of the 300 ms budget from
process start to the first ``/healthz`` 200; ``h11`` imports in about 25 ms (``import
sidecar.cli`` fell from about 240 to about 95 ms). The sidecar serves a dozen small JSON
routes and reads no request body, so what it needs of a web framework is a router
(:mod:`.app`) and the connection handling here: keep-alive and pipelining, the header
timeout, the connection cap, size caps on request heads, a ``400`` for garbage,
cancelling a parked query whose client left. aiohttp stays the apiserver client
(:mod:`sidecar.kubeapi`), imported in a thread at its first call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Protocol
from urllib.parse import parse_qsl, unquote

import h11

from sidecar.publish.http.access import release_hosts
from sidecar.publish.http.limits import (
    HEADER_TIMEOUT,
    MAX_FIELD,
    MAX_HEADERS,
    MAX_LINE,
    RETRY_AFTER,
    Limits,
)

log = logging.getLogger("sidecar.http")

# Unread request body after an answer (no endpoint reads one): wait this long, then close.
LINGER = 1.0
# On stop, answers in progress (parked queries woken by the step-down) may finish this long.
SHUTDOWN_TIMEOUT = 2.0
# What a slow client can make us buffer of one request head (see .limits).
MAX_HEAD = MAX_LINE + MAX_HEADERS * MAX_FIELD
# A request's first bytes: a method (letters), then a space. Anything else (a TLS
# hello) is refused at once rather than waited on until the header timeout.
_START = re.compile(rb"(?:\r?\n)*[A-Z]{0,20}(?: |\Z)")


@dataclass
class Request:
    method: str
    path: str  # percent-decoded
    query_string: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names, first value
    remote: str | None = None
    name: str | None = None  # the {name} of the matched route

    @property
    def query(self) -> dict[str, str]:
        found: dict[str, str] = {}
        for key, value in parse_qsl(self.query_string, keep_blank_values=True):
            found.setdefault(key, value)
        return found


@dataclass
class Response:
    body: bytes
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


class HttpError(Exception):
    """An answer with a short text body (``404``, ``405``, ``400``), raised by a handler."""

    def __init__(self, status: int, text: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(text)
        self.response = Response(text.encode(), status, headers or {},
                                 "text/plain; charset=utf-8")


Handler = Callable[[Request], Awaitable[Response]]


class App(Protocol):
    """What the server serves (:class:`.app.App`): its routes and its bounds."""

    limits: Limits

    async def handle(self, request: Request) -> Response: ...


_date: tuple[int, str] = (0, "")


def _http_date() -> str:
    """The ``Date`` header, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now)))
    return _date[1]


def _encode(response: Response, head_only: bool = False, close: bool = True) -> bytes:
    """An answer's bytes. Written by hand rather than through h11's ``send``: the headers
    are ours (no client text in them), and this is half the per-request cost it had."""
    head = [f"HTTP/1.1 {response.status} {HTTPStatus(response.status).phrase}",
            f"Content-Type: {response.content_type}",
            f"Content-Length: {len(response.body)}", f"Date: {_http_date()}",
            *(f"{name}: {value}" for name, value in response.headers.items())]
    if close:
        head.append("Connection: close")
    encoded = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
    return encoded if head_only else encoded + response.body


_BAD_RESPONSE = HttpError(400, "400: Bad Request").response
_FULL_RESPONSE = _encode(Response(json.dumps({"error": "too many connections"}).encode(),
                                  503, {"Retry-After": str(RETRY_AFTER)}))


def _too_large(event: h11.Request) -> str | None:
    if len(event.method) + len(event.target) + 10 > MAX_LINE:
        return "request line too long"
    if len(event.headers) > MAX_HEADERS:
        return "too many headers"
    if any(len(name) + len(value) + 2 > MAX_FIELD for name, value in event.headers):
        return "header line too long"
    return None


def _parser(data: bytes = b"") -> h11.Connection:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    if data:  # b"" would tell h11 the client closed
        conn.receive_data(data)
    return conn


def _keep_alive(event: h11.Request) -> bool:
    """HTTP/1.1 without ``Connection: close`` (h11's rule: no keep-alive for 1.0)."""
    if event.http_version != b"1.1":
        return False
    return not any(name == b"connection" and b"close" in value.lower().split(b",")
                   for name, value in event.headers)


class _Connection(asyncio.Protocol):
    """One client connection: requests in order, one answered at a time."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._h11 = _parser()
        self._answered = False  # this cycle's request was answered, its body may follow
        self._transport: asyncio.Transport | None = None
        self._remote: str | None = None
        self._task: asyncio.Task[None] | None = None  # the answer being made
        self._timer: asyncio.TimerHandle | None = None
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._remote = peer[0] if peer else None
        self._server.connections.add(self)
        self._close_in(self._server.header_timeout)

    def data_received(self, data: bytes) -> None:
        self._h11.receive_data(data)
        self._pump()

    def eof_received(self) -> bool | None:
        # A client that goes away ends its parked query (and frees its slot) at once.
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()

    def close(self) -> None:
        self.closing = True
        if self._transport is not None:
            self._transport.close()

    @property
    def busy(self) -> asyncio.Task[None] | None:
        return self._task

    def _close_in(self, delay: float) -> None:
        """Close unless a complete request head arrives within ``delay`` (a header timeout
        against slowloris, and how long an idle kept-alive connection stays)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(delay, self.close)

    def _bad(self, why: str) -> None:
        """A malformed request is the client's fault: one debug line, a 400, closed."""
        log.debug("bad request from %s: %s", self._remote, " ".join(why.split())[:300])
        assert self._transport is not None
        if self._task is None and not self._answered:
            self._transport.write(_encode(_BAD_RESPONSE))
        self.close()

    def _pump(self) -> None:
        """Take what h11 has parsed as far as it goes without waiting for an answer."""
        while not self.closing:
            if self._answered and self._h11.their_state is h11.DONE:
                # The next request: a fresh parser with what came after this one (h11
                # cycles only through its own send, which the answers do not use).
                self._h11, self._answered = _parser(self._h11.trailing_data[0]), False
                self._close_in(self._server.header_timeout)
                assert self._transport is not None
                self._transport.resume_reading()
            conn = self._h11
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._bad(str(exc))
                return
            if event is h11.NEED_DATA:
                if conn.their_state is h11.IDLE and not _START.match(conn.trailing_data[0]):
                    self._bad("not an HTTP request")
                return
            if event is h11.PAUSED:
                # A pipelined request waits for our answer: hold about one head of it.
                if len(conn.trailing_data[0]) > MAX_HEAD and self._transport is not None:
                    self._transport.pause_reading()
                return
            if isinstance(event, h11.Request):
                if (why := _too_large(event)) is not None:
                    self._bad(why)
                    return
                if self._timer is not None:
                    self._timer.cancel()
                self._task = asyncio.get_running_loop().create_task(self._answer(event))
            elif isinstance(event, h11.ConnectionClosed):
                self.close()
                return
            # Data, EndOfMessage: the body of a request, which no route reads.

    async def _answer(self, event: h11.Request) -> None:
        target = event.target.decode("ascii", "replace")
        path, _, query = target.partition("?")
        headers: dict[str, str] = {}
        for name, value in event.headers:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        request = Request(event.method.decode("ascii"), unquote(path), query, headers,
                          self._remote)
        try:
            response = await self._server.app.handle(request)
        except HttpError as exc:
            response = exc.response
        except Exception:
            # A bug of ours: its traceback goes to the log, never to the client.
            log.exception("error answering %s %s", request.method, path)
            response = HttpError(500, "500: Internal Server Error").response
        close = self._server.stopping or not _keep_alive(event)
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(_encode(response, request.method == "HEAD", close))
        self._task = None
        if self.closing:
            return
        if close:
            self.close()
            return
        self._answered = True
        if self._h11.their_state is not h11.DONE:
            self._close_in(LINGER)  # a body nobody reads: let it arrive for a moment
        self._pump()


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
    """Serves ``app`` on ``host:port``; ``port`` 0 picks a free one (see ``bound_port``)."""

    def __init__(self, app: App, host: str, port: int,
                 header_timeout: float = HEADER_TIMEOUT) -> None:
        self.app = app
        self.header_timeout = header_timeout
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None
        self.bound_port: int | None = None

    async def start(self) -> None:
        limits = self.app.limits

        def connection() -> asyncio.BaseProtocol:
            if len(self.connections) >= limits.max_connections:
                limits.refused_connections += 1
                return _Refuse()
            return _Connection(self)

        limits.open_connections = lambda: len(self.connections)
        self._server = await asyncio.get_running_loop().create_server(
            connection, self._host or None, self._port, reuse_address=True)
        sockets = self._server.sockets or ()
        self.bound_port = sockets[0].getsockname()[1] if sockets else self._port
        limits.release_hosts = release_hosts(self._host, self.bound_port)

    async def stop(self) -> None:
        """Stop accepting; answers in progress get :data:`SHUTDOWN_TIMEOUT` to finish
        (a parked query woken by the step-down answers "not leader"), then all close."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.busy is None:
                conn.close()
        busy = [task for conn in self.connections if (task := conn.busy) is not None]
        if busy:
            await asyncio.wait(busy, timeout=SHUTDOWN_TIMEOUT)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
