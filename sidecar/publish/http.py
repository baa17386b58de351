"""The HTTP endpoint (aiohttp): ``/leader``, ``/healthz``, ``/readyz``, ``/metrics``,
``/status`` and ``POST /release``.

``/leader`` is answered from :meth:`LeaseState.claim` at request time. A blocking query
(``?wait=SECONDS`` with ``If-None-Match``) parks the request until the state version
changes, so applications need not poll hard.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from sidecar.state import LeaseState

MAX_WAIT = 300.0

_STATES = web.AppKey("states", dict)
_RELEASE = web.AppKey("release", object)


def is_loopback(remote: str | None) -> bool:
    """Only a process in this pod (or on this host) may make us step down."""
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%")[0]).is_loopback
    except ValueError:
        return False


def etag(state: LeaseState) -> str:
    return f'"{state.lease}-{state.facts.version}"'


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
    if wait:
        seen = request.headers.get("If-None-Match")
        if seen is None or seen == etag(state):
            await state.wait_for_change(state.facts.version, wait)
    claim = state.claim()
    return web.Response(body=state.encoded(claim), status=200 if claim.leader else 503,
                        headers={"ETag": etag(state)}, content_type="application/json")


def build_app(states: list[LeaseState], registry: CollectorRegistry,
              status: Callable[[], dict[str, Any]], alive: Callable[[], bool],
              ready: Callable[[], bool],
              release: Callable[[str | None], bool]) -> web.Application:
    # No middleware: aiohttp already answers 404/405 as short text and an unexpected
    # error as a bare 500 (the traceback goes to the log, never to the client), and any
    # middleware costs a third of /leader's throughput.
    app = web.Application()
    app[_STATES] = {s.lease: s for s in states}

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
        if not is_loopback(request.remote):
            return _json({"error": "release is accepted only from loopback"}, 403)
        name = request.match_info.get("name")
        if not release(name):
            raise web.HTTPNotFound(text=f"no lease named {name!r}\n")
        return _json({"released": True, "at": time.time()}, 202)

    app.router.add_get("/leader", leader, allow_head=True)
    app.router.add_get("/leader/{name}", leader, allow_head=True)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/status", status_handler)
    app.router.add_post("/release", release_handler)
    app.router.add_post("/release/{name}", release_handler)
    return app


class HttpServer:
    """Runs the app on ``host:port``; ``port`` 0 picks a free one (see ``bound_port``)."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._host = host
        self._port = port
        self.bound_port: int | None = None

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        server = site._server  # aiohttp exposes the bound socket only here
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self._port

    async def stop(self) -> None:
        await self._runner.cleanup()
