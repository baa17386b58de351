"""The routes and their answers (:func:`build_app`); the handlers read the lease states
and call back into the runtime, they hold no state of their own."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web

from sidecar.publish.http import longpoll
from sidecar.publish.http.access import refusal
from sidecar.publish.http.limits import LIMITS, Limits
from sidecar.state import LeaseState

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

ReleaseOutcome = Literal["released", "not-holding", "no-such-lease"]
# POST /handover: (lease name or None, successor identity or None) -> outcome.
Handover = Callable[[str | None, str | None], ReleaseOutcome]
# "beat" with the JSON to answer, "not-leading" (409), "no-such-lease" (404).
HeartbeatAnswer = tuple[Literal["beat", "not-leading", "no-such-lease"], dict[str, Any]]

Handler = Callable[[web.Request], Awaitable[web.Response]]

def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=json.dumps(data).encode(), status=status, headers=headers,
                        content_type="application/json")


def _probe(check: Callable[[], bool],
           cannot_lead: Callable[[], str | None] | None = None) -> Handler:
    """``200 {"ok": true}`` or ``503 {"ok": false}``; with ``cannot_lead``, also ``503``
    with its reason while this contender can never lead as configured."""
    async def handler(request: web.Request) -> web.Response:
        reason = cannot_lead() if cannot_lead else None
        if reason:
            return _json({"ok": False, "reason": reason}, 503)
        ok = check()
        return _json({"ok": ok}, 200 if ok else 503)
    return handler


def _local_post(what: str, limits: Limits,
                answer: Callable[..., web.Response], with_query: bool = False) -> Handler:
    """A ``POST`` that makes a leader step down or keep leading: ``403`` unless it comes
    from a process of this pod (see :mod:`.access`), else ``answer`` for the lease named
    in the path (None: the first)."""
    async def handler(request: web.Request) -> web.Response:
        error = refusal(request.remote, request.headers, limits.release_hosts, what)
        if error is not None:
            return _json({"error": error}, 403)
        if with_query:
            return answer(request.match_info.get("name"), request.query)
        return answer(request.match_info.get("name"))
    return handler


def _no_heartbeat(name: str | None) -> HeartbeatAnswer:
    return "not-leading", {}


def _no_handover(name: str | None, to: str | None) -> ReleaseOutcome:
    return "not-holding"


def build_app(states: list[LeaseState],
              status: Callable[[], dict[str, Any]], alive: Callable[[], bool],
              ready: Callable[[], bool],
              release: Callable[[str | None], ReleaseOutcome],
              limits: Limits | None = None,
              cannot_lead: Callable[[], str | None] | None = None,
              heartbeat: Callable[[str | None], HeartbeatAnswer] = _no_heartbeat,
              handover: Handover = _no_handover,
              ) -> web.Application:
    # No middleware: aiohttp already answers 404/405 as short text and an unexpected
    # error as a bare 500 (the traceback goes to the log, never to the client), and any
    # middleware costs a third of /leader's throughput.
    app = web.Application()
    app[longpoll.LEASES] = {s.lease: longpoll.ServedLease(s) for s in states}
    app[LIMITS] = limits = limits or Limits()
    registry: CollectorRegistry | None = None

    async def metrics_handler(request: web.Request) -> web.Response:
        # The registry is built at the first scrape: prometheus_client would be a tenth
        # of the imports before the first /healthz, and the collectors read everything
        # off the states and limits when scraped, so a late registry misses nothing.
        nonlocal registry
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from sidecar.metrics import registry_for

        if registry is None:
            registry = registry_for(states, limits)
        return web.Response(body=generate_latest(registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status_handler(request: web.Request) -> web.Response:
        return _json(status())

    def released(name: str | None) -> web.Response:
        outcome = release(name)
        if outcome == "no-such-lease":
            raise longpoll.no_such_lease(name)
        if outcome == "not-holding":
            # Refused, not remembered: a remembered request would end this contender's
            # next term right after it began, and nobody would lead for a lease duration.
            return _json({"released": False,
                          "error": "this contender does not hold the lease"}, 409)
        return _json({"released": True, "at": time.time()}, 202)

    def handed(name: str | None, query: Any) -> web.Response:
        to = query.get("to") or None
        outcome = handover(name, to)
        if outcome == "no-such-lease":
            raise longpoll.no_such_lease(name)
        if outcome == "not-holding":
            return _json({"handed_over": False,
                          "error": "this contender does not hold the lease"
                          + (" (or --to names this contender)" if to else "")}, 409)
        return _json({"handed_over": True, "to": to, "at": time.time()}, 202)

    def beat(name: str | None) -> web.Response:
        outcome, answer = heartbeat(name)
        if outcome == "no-such-lease":
            raise longpoll.no_such_lease(name)
        if outcome == "not-leading":
            return _json({"ok": False, "error": "this contender does not lead: there is "
                                                "no work to vouch for"}, 409)
        return _json({"ok": True, **answer})

    # Same rules for both: a beat keeps a leader leading, which a web page must not be
    # able to do for a stalled application.
    release_handler = _local_post("release", limits, released)
    heartbeat_handler = _local_post("heartbeat", limits, beat)
    handover_handler = _local_post("handover", limits, handed, with_query=True)
    # /livez: the loop runs (liveness: a restart can help). /healthz: that, and nothing
    # keeps this contender from ever leading (the chart's readiness). /readyz: that, and
    # the backend answers now.
    livez = _probe(alive)
    healthz, readyz = _probe(alive, cannot_lead), _probe(ready, cannot_lead)

    app.router.add_get("/leader", longpoll.leader, allow_head=True)
    app.router.add_get("/leader/{name}", longpoll.leader, allow_head=True)
    app.router.add_get("/livez", livez)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/status", status_handler)
    app.router.add_post("/release", release_handler)
    app.router.add_post("/release/{name}", release_handler)
    app.router.add_post("/handover", handover_handler)
    app.router.add_post("/handover/{name}", handover_handler)
    app.router.add_post("/heartbeat", heartbeat_handler)
    app.router.add_post("/heartbeat/{name}", heartbeat_handler)
    return app
