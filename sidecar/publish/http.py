"""The HTTP endpoint (aiohttp): ``/leader``, ``/healthz``, ``/readyz``, ``/metrics``,
``/status``, ``POST /release`` and ``POST /heartbeat`` (the work watchdog's input).

``/leader`` is answered from :meth:`LeaseState.claim` at request time. A blocking query
(``?wait=SECONDS`` with ``If-None-Match``) parks the request until the answer's
leadership changes (leader, holder, fencing token, role: the ETag) or ``wait`` runs out;
renews do not end it, so applications need not poll hard and are not woken for nothing.

Bounds, because anything on the host (or, with a non-loopback bind, the network) can
connect:

- at most ``MAX_CONNECTIONS`` open connections; one more is answered ``503`` with
  ``Retry-After`` and closed, without reading it;
- at most ``MAX_WAITERS`` parked blocking queries; one more is answered at once with
  the current state (the same truthful claim a query without ``wait`` gets) and the
  header ``Lease-Wait: full`` — never a made-up "not leader" or "leader";
- a request head must arrive within ``HEADER_TIMEOUT`` of the connection opening (or of
  the previous answer on a kept-alive connection), else the connection is closed; a
  client that goes away cancels its parked query at once;
- request line and header sizes are capped, so a slow client cannot make us buffer much;
- a malformed request gets aiohttp's ``400`` and one debug log line, not a traceback.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.state import Claim, LeaseState

MAX_WAIT = 300.0
# An app's processes long-polling one sidecar number in the tens; these caps keep a
# flood far below the chart's 128 Mi memory limit (bench/bench_http_limits.py).
MAX_CONNECTIONS = 512
MAX_WAITERS = 256
# Connect → complete request head; also how long an idle kept-alive connection stays.
HEADER_TIMEOUT = 5.0
RETRY_AFTER = 1
# Request line ("GET /leader/<name>?wait=30") and one header line; 24 header lines. A
# slow client can make us hold at most about MAX_LINE + MAX_HEADERS * MAX_FIELD bytes
# (about twice that in Python objects): 25 KiB, 13 MiB over all connections.
MAX_LINE = 1024
MAX_FIELD = 1024
MAX_HEADERS = 24
# Unread request body after an answer (no endpoint reads one): wait this long, then close.
LINGER = 1.0
SHUTDOWN_TIMEOUT = 2.0

ReleaseOutcome = Literal["released", "not-holding", "no-such-lease"]
# "beat" with the JSON to answer, "not-leading" (409), "no-such-lease" (404).
HeartbeatAnswer = tuple[Literal["beat", "not-leading", "no-such-lease"], dict[str, Any]]

_STATES = web.AppKey("states", dict)
_LIMITS = web.AppKey("limits", object)

log = logging.getLogger("sidecar.http")


@dataclass
class Limits:
    """Counters of the bounds above, shared by the app and the server (and /metrics)."""

    max_connections: int = MAX_CONNECTIONS
    max_waiters: int = MAX_WAITERS
    waiters: int = 0
    refused_connections: int = 0
    waits_refused: int = 0
    # "host:port" forms a POST /release may name in its Host header (set once bound).
    release_hosts: frozenset[tuple[str, int]] = frozenset()
    open_connections: Callable[[], int] = lambda: 0


class LimitsCollector(Collector):
    def __init__(self, limits: Limits) -> None:
        self._limits = limits

    def collect(self) -> Iterator[Metric]:
        limits = self._limits
        yield GaugeMetricFamily("lease_http_connections", "open HTTP connections",
                                value=limits.open_connections())
        yield GaugeMetricFamily("lease_http_waiters", "parked blocking queries",
                                value=limits.waiters)
        refused = CounterMetricFamily("lease_http_refused",
                                      "requests turned away by a bound", labels=["bound"])
        refused.add_metric(["connections"], limits.refused_connections)
        refused.add_metric(["waiters"], limits.waits_refused)
        yield refused


def is_loopback(remote: str | None) -> bool:
    """Only a process in this pod (or on this host) may make us step down."""
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%")[0]).is_loopback
    except ValueError:
        return False


def release_hosts(bound_host: str, port: int) -> frozenset[tuple[str, int]]:
    """(host, port) pairs a ``POST /release`` may carry in ``Host``: the loopback forms
    of our port, and the bound address itself unless it is a wildcard."""
    hosts = {"localhost", "127.0.0.1", "::1"}
    if bound_host and bound_host not in ("0.0.0.0", "::"):
        hosts.add(bound_host.lower())
    return frozenset((host, port) for host in hosts)


def host_allowed(header: str | None, allowed: frozenset[tuple[str, int]]) -> bool:
    """``Host`` names this endpoint, not some other name that resolves here (DNS
    rebinding: a web page on ``evil.example`` re-pointed at 127.0.0.1)."""
    if not header:
        return False
    try:
        parts = urlsplit(f"//{header}")
        host, port = parts.hostname, parts.port or 80
    except ValueError:
        return False
    if host is None or parts.username is not None or parts.path:
        return False
    return (host, port) in allowed or (is_loopback(host) and ("127.0.0.1", port) in allowed)


def etag(state: LeaseState, claim: Claim | None = None) -> str:
    """Follows leadership only (leader, holder, fencing token, role), not renews."""
    return state.leadership_tag(claim or state.claim())


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=json.dumps(data).encode(), status=status, headers=headers,
                        content_type="application/json")


def _wait_seconds(request: web.Request) -> float:
    raw = request.query.get("wait")
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        raise web.HTTPBadRequest(text="wait must be a number of seconds\n") from None
    if not 0 <= seconds <= MAX_WAIT:
        raise web.HTTPBadRequest(text=f"wait must be between 0 and {MAX_WAIT:g}\n")
    return seconds


async def leader(request: web.Request) -> web.Response:
    states: dict[str, LeaseState] = request.app[_STATES]
    name = request.match_info.get("name")
    state = states.get(name) if name else next(iter(states.values()))
    if state is None:
        raise web.HTTPNotFound(text=f"no lease named {name!r}\n")
    # The hot path: skip query parsing when there is no query string.
    wait = _wait_seconds(request) if request.query_string else 0.0
    headers = {"ETag": ""}
    if wait:
        seen = request.headers.get("If-None-Match")
        current = etag(state)
        # Weak comparison (RFC 9110 for If-None-Match): a client that drops the W/ of
        # the tag it echoes still parks.
        if seen is None or seen.removeprefix("W/") == current.removeprefix("W/"):
            limits: Limits = request.app[_LIMITS]
            if limits.waiters >= limits.max_waiters:
                # Full: answer now with what a query without wait gets. The claim is
                # computed below, like any other, so it is never a made-up answer.
                limits.waits_refused += 1
                headers["Lease-Wait"] = "full"
                headers["Retry-After"] = str(RETRY_AFTER)
            else:
                limits.waiters += 1
                try:
                    await state.wait_for_leadership_change(current, wait)
                finally:
                    limits.waiters -= 1
    claim = state.claim()
    headers["ETag"] = etag(state, claim)
    return web.Response(body=state.encoded(claim), status=200 if claim.leader else 503,
                        headers=headers, content_type="application/json")


def _not_local(request: web.Request, limits: Limits, what: str) -> web.Response | None:
    """``403`` unless the request comes from a process of this pod, never a web page.

    Browsers send Origin with every POST, and a page that re-points its own name at
    127.0.0.1 (DNS rebinding) still sends that name as Host.
    """
    if not is_loopback(request.remote):
        return _json({"error": f"{what} is accepted only from loopback"}, 403)
    if "Origin" in request.headers:
        return _json({"error": f"{what} is refused to requests with an Origin header"}, 403)
    if not host_allowed(request.headers.get("Host"), limits.release_hosts):
        return _json({"error": f"{what} needs Host: localhost or 127.0.0.1 with this "
                               "endpoint's port"}, 403)
    return None


def _no_heartbeat(name: str | None) -> HeartbeatAnswer:
    return "not-leading", {}


def build_app(states: list[LeaseState], registry: CollectorRegistry,
              status: Callable[[], dict[str, Any]], alive: Callable[[], bool],
              ready: Callable[[], bool],
              release: Callable[[str | None], ReleaseOutcome],
              limits: Limits | None = None,
              heartbeat: Callable[[str | None], HeartbeatAnswer] = _no_heartbeat,
              ) -> web.Application:
    # No middleware: aiohttp already answers 404/405 as short text and an unexpected
    # error as a bare 500 (the traceback goes to the log, never to the client), and any
    # middleware costs a third of /leader's throughput.
    app = web.Application()
    app[_STATES] = {s.lease: s for s in states}
    app[_LIMITS] = limits = limits or Limits()
    registry.register(LimitsCollector(limits))

    async def healthz(request: web.Request) -> web.Response:
        ok = alive()
        return _json({"ok": ok}, 200 if ok else 503)

    async def readyz(request: web.Request) -> web.Response:
        ok = ready()
        return _json({"ok": ok}, 200 if ok else 503)

    async def metrics_handler(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status_handler(request: web.Request) -> web.Response:
        return _json(status())

    async def release_handler(request: web.Request) -> web.Response:
        refused = _not_local(request, limits, "release")
        if refused is not None:
            return refused
        name = request.match_info.get("name")
        outcome = release(name)
        if outcome == "no-such-lease":
            raise web.HTTPNotFound(text=f"no lease named {name!r}\n")
        if outcome == "not-holding":
            # Refused, not remembered: a remembered request would end this contender's
            # next term right after it began, and nobody would lead for a lease duration.
            return _json({"released": False,
                          "error": "this contender does not hold the lease"}, 409)
        return _json({"released": True, "at": time.time()}, 202)

    async def heartbeat_handler(request: web.Request) -> web.Response:
        # Same rules as a release: a beat keeps a leader leading, which a web page must
        # not be able to do for a stalled application.
        refused = _not_local(request, limits, "heartbeat")
        if refused is not None:
            return refused
        name = request.match_info.get("name")
        outcome, answer = heartbeat(name)
        if outcome == "no-such-lease":
            raise web.HTTPNotFound(text=f"no lease named {name!r}\n")
        if outcome == "not-leading":
            return _json({"ok": False, "error": "this contender does not lead: there is "
                                                "no work to vouch for"}, 409)
        return _json({"ok": True, **answer})

    app.router.add_get("/leader", leader, allow_head=True)
    app.router.add_get("/leader/{name}", leader, allow_head=True)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/status", status_handler)
    app.router.add_post("/release", release_handler)
    app.router.add_post("/release/{name}", release_handler)
    app.router.add_post("/heartbeat", heartbeat_handler)
    app.router.add_post("/heartbeat/{name}", heartbeat_handler)
    return app


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
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
    """Runs the app on ``host:port``; ``port`` 0 picks a free one (see ``bound_port``)."""

    def __init__(self, app: web.Application, host: str, port: int,
                 header_timeout: float = HEADER_TIMEOUT) -> None:
        self._limits: Limits = app[_LIMITS]
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
        sockets = self._server.sockets or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self._port
        limits.release_hosts = release_hosts(self._host, self.bound_port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()  # stop accepting; the runner then closes connections
        await self._runner.cleanup()
        if self._server is not None:
            await self._server.wait_closed()
