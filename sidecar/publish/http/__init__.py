"""The HTTP endpoint (h11 on asyncio, see :mod:`.server` for why): ``/leader``,
``/livez``, ``/healthz``, ``/readyz``, ``/metrics``, ``/status``, ``POST /release``,
``POST /handover`` and ``POST /heartbeat`` (the work watchdog's input).

``/leader`` is answered from :meth:`LeaseState.claim` at request time. A blocking query
(``?wait=SECONDS`` with ``If-None-Match``) parks the request until the answer's
leadership changes (leader, holder, fencing token, role: the ETag) or ``wait`` runs out;
renews do not end it, so applications need not poll hard and are not woken for nothing.

One job a module:

- :mod:`.app`: the routes and their answers (:func:`build_app`, :class:`App`);
- :mod:`.longpoll`: ``GET /leader``, plain or blocking;
- :mod:`.access`: who may ``POST`` (loopback, no ``Origin``, our own ``Host``, and the
  control token where one is set);
- :mod:`.limits`: the bounds on connections, waiters and request heads, and their metrics;
- :mod:`.server`: the listening socket and HTTP/1.1 on it, which enforces the connection
  and request-head bounds (:class:`HttpServer`).
"""

from sidecar.publish.http.access import ControlToken, host_allowed, is_loopback, release_hosts
from sidecar.publish.http.app import (
    App,
    HandoverAnswer,
    HeartbeatAnswer,
    ReleaseOutcome,
    build_app,
)
from sidecar.publish.http.limits import (
    HEADER_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_FIELD,
    MAX_HEADERS,
    MAX_LINE,
    MAX_WAITERS,
    Limits,
)
from sidecar.publish.http.longpoll import MAX_WAIT
from sidecar.publish.http.server import HttpServer, Request, Response

__all__ = [
    "HEADER_TIMEOUT", "MAX_CONNECTIONS", "MAX_FIELD", "MAX_HEADERS", "MAX_LINE", "MAX_WAIT",
    "MAX_WAITERS", "App", "ControlToken", "HandoverAnswer", "HeartbeatAnswer", "HttpServer",
    "Limits", "ReleaseOutcome",
    "Request", "Response", "build_app",
    "host_allowed", "is_loopback", "release_hosts",
]
