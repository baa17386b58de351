"""The routes and their answers (:func:`build_app`); the handlers read the lease states
and call back into the runtime, they hold no state of their own. Routing is an exact
path, or a first segment and a ``{name}`` (``/leader/{name}``); ``HEAD`` is served
wherever ``GET`` is; a known path with another method is ``405`` with ``Allow``."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from sidecar.publish.http import longpoll, shardpoll
from sidecar.publish.http.access import ControlToken, refusal
from sidecar.publish.http.limits import Limits
from sidecar.publish.http.server import Handler, HttpError, Request, Response
from sidecar.publish.shards import ShardBoard
from sidecar.state import LeaseState

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

ReleaseOutcome = Literal["released", "not-holding", "no-such-lease"]
# POST /handover: "handing-over" (202) or "refused" (409), with the JSON that says what
# was done or why not; "no-such-lease" (404).
HandoverAnswer = tuple[Literal["handing-over", "refused", "no-such-lease"], dict[str, Any]]
# (lease name or None, successor identity or None) -> answer.
Handover = Callable[[str | None, str | None], Awaitable[HandoverAnswer]]
# "beat" with the JSON to answer, "not-leading" (409), "no-such-lease" (404).
HeartbeatAnswer = tuple[Literal["beat", "not-leading", "no-such-lease"], dict[str, Any]]



class App:
    """The routes: ``(method, path)`` to a handler, ``path`` either exact or
    ``/<segment>/{name}``."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._routes: dict[str, dict[str, Handler]] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        self._routes.setdefault(path, {})[method] = handler

    async def handle(self, request: Request) -> Response:
        route = self._routes.get(request.path)
        if route is None:
            first, _, name = request.path[1:].partition("/")
            route = self._routes.get(f"/{first}/{{name}}") if name and "/" not in name else None
            if route is None:
                raise HttpError(404, "404: Not Found")
            request.name = name
        handler = route.get("GET" if request.method == "HEAD" else request.method)
        if handler is None:
            allowed = sorted({*route, *(["HEAD"] if "GET" in route else [])})
            raise HttpError(405, "405: Method Not Allowed", {"Allow": ",".join(allowed)})
        return await handler(request)


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data).encode(), status)


def _probe(check: Callable[[], bool],
           *reasons: Callable[[], str | None] | None) -> Handler:
    """``200 {"ok": true}`` or ``503 {"ok": false}``; also ``503`` with the first of
    ``reasons`` that has one (this contender can never lead as configured, a watch is
    restarting after an error)."""
    async def handler(request: Request) -> Response:
        reason = next((why for found in reasons if found and (why := found())), None)
        if reason:
            return _json({"ok": False, "reason": reason}, 503)
        ok = check()
        return _json({"ok": ok}, 200 if ok else 503)
    return handler


def _local_post(what: str, limits: Limits, answer: Callable[..., Awaitable[Response]],
                token: ControlToken | None, with_query: bool = False) -> Handler:
    """A ``POST`` that makes a leader step down or keep leading: ``403`` unless it comes
    from a process of this pod (see :mod:`.access`) carrying the control ``token`` where
    one is set, else ``answer`` for the lease named in the path (None: the first)."""
    async def handler(request: Request) -> Response:
        error = refusal(request.remote, request.headers, limits.release_hosts, what)
        if error is None and token is not None:
            error = token.refusal(request.headers, what)
        if error is not None:
            return _json({"error": error}, 403)
        if with_query:
            return await answer(request.name, request.query)
        return await answer(request.name)
    return handler


def _no_heartbeat(name: str | None) -> HeartbeatAnswer:
    return "not-leading", {}


async def _no_handover(name: str | None, to: str | None) -> HandoverAnswer:
    return "refused", {"error": "this contender does not hold the lease"}


def build_app(states: list[LeaseState],
              status: Callable[[], dict[str, Any]], alive: Callable[[], bool],
              ready: Callable[[], bool],
              release: Callable[[str | None], ReleaseOutcome],
              limits: Limits | None = None,
              cannot_lead: Callable[[], str | None] | None = None,
              heartbeat: Callable[[str | None], HeartbeatAnswer] = _no_heartbeat,
              handover: Handover = _no_handover,
              degraded: Callable[[], str | None] | None = None,
              control_token: ControlToken | None = None,
              shards: ShardBoard | None = None,
              ) -> App:
    # 404/405 are short text and an unexpected error a bare 500 (the traceback goes to
    # the log, never to the client): see .server.
    app = App(limits := limits or Limits())
    leases = {s.lease: longpoll.ServedLease(s) for s in states}
    if shards is not None:  # /leader/{shard}; /metrics and /status count them apart
        leases.update((s.lease, longpoll.ServedLease(s)) for s in shards.states)
    registry: CollectorRegistry | None = None

    async def metrics_handler(request: Request) -> Response:
        # The registry is built at the first scrape: prometheus_client would be a tenth
        # of the imports before the first /healthz, and the collectors read everything
        # off the states and limits when scraped, so a late registry misses nothing.
        nonlocal registry
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from sidecar.metrics import registry_for

        if registry is None:
            registry = registry_for(states, limits, shards)
        return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)

    async def status_handler(request: Request) -> Response:
        return _json(status())

    async def released(name: str | None) -> Response:
        outcome = release(name)
        if outcome == "no-such-lease":
            raise longpoll.no_such_lease(name)
        if outcome == "not-holding":
            # Refused, not remembered: a remembered request would end this contender's
            # next term right after it began, and nobody would lead for a lease duration.
            return _json({"released": False,
                          "error": "this contender does not hold the lease"}, 409)
        return _json({"released": True, "at": time.time()}, 202)

    async def handed(name: str | None, query: Any) -> Response:
        to = query.get("to") or None
        outcome, detail = await handover(name, to)
        if outcome == "no-such-lease":
            raise longpoll.no_such_lease(name)
        if outcome == "refused":
            return _json({"handed_over": False, **detail}, 409)
        return _json({"handed_over": True, "to": to, **detail, "at": time.time()}, 202)

    async def beat(name: str | None) -> Response:
        outcome, answer = heartbeat(name)
        if outcome == "no-such-lease":
            raise longpoll.no_such_lease(name)
        if outcome == "not-leading":
            return _json({"ok": False, "error": "this contender does not lead: there is "
                                                "no work to vouch for"}, 409)
        return _json({"ok": True, **answer})

    # Same rules for both: a beat keeps a leader leading, which a web page must not be
    # able to do for a stalled application.
    release_handler = _local_post("release", limits, released, control_token)
    heartbeat_handler = _local_post("heartbeat", limits, beat, control_token)
    handover_handler = _local_post("handover", limits, handed, control_token,
                                   with_query=True)
    # /livez: the loop runs (liveness: a restart can help). /healthz: that, and nothing
    # keeps this contender from ever leading (the chart's readiness), and no watch is
    # restarting after an unexpected error (``degraded``: it restarts by itself, so a
    # restart of the sidecar would not help). /readyz: that, and the backend answers now.
    livez = _probe(alive)
    healthz, readyz = _probe(alive, cannot_lead, degraded), _probe(ready, cannot_lead)

    async def leader_handler(request: Request) -> Response:
        return await longpoll.leader(request, leases, limits)

    for path, get in (("/livez", livez), ("/healthz", healthz), ("/readyz", readyz),
                      ("/metrics", metrics_handler), ("/status", status_handler)):
        app.add("GET", path, get)
    for path in ("/leader", "/leader/{name}"):
        app.add("GET", path, leader_handler)
    if shards is not None:
        board = shards

        async def shards_handler(request: Request) -> Response:
            return await shardpoll.shards(request, board, limits)

        app.add("GET", "/shards", shards_handler)
    for path, post in (("/release", release_handler), ("/handover", handover_handler),
                       ("/heartbeat", heartbeat_handler)):
        app.add("POST", path, post)
        app.add("POST", path + "/{name}", post)
    return app
