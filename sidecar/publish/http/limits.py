"""Bounds, because anything on the host (or, with a non-loopback bind, the network) can
connect:

- at most ``MAX_CONNECTIONS`` open connections; one more is answered ``503`` with
  ``Retry-After`` and closed, without reading it (:mod:`.server`);
- at most ``MAX_WAITERS`` parked blocking queries; one more is answered at once with
  the current state (the same truthful claim a query without ``wait`` gets) and the
  header ``Lease-Wait: full`` — never a made-up "not leader" or "leader" (:mod:`.longpoll`);
- a request head must arrive within ``HEADER_TIMEOUT`` of the connection opening (or of
  the previous answer on a kept-alive connection), else the connection is closed; a
  client that goes away cancels its parked query at once;
- request line and header sizes are capped, so a slow client cannot make us buffer much;
- a malformed request gets a ``400`` and one debug log line (``sidecar.http``), not a
  traceback.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

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


@dataclass
class Limits:
    """Counters of the bounds above, shared by the app and the server (and /metrics:
    :class:`sidecar.metrics.LimitsCollector`)."""

    max_connections: int = MAX_CONNECTIONS
    max_waiters: int = MAX_WAITERS
    waiters: int = 0
    refused_connections: int = 0
    waits_refused: int = 0
    # "host:port" forms a POST /release may name in its Host header (set once bound).
    release_hosts: frozenset[tuple[str, int]] = frozenset()
    open_connections: Callable[[], int] = lambda: 0

    async def park(self, wait: Callable[[], Awaitable[object]], headers: dict[str, str]) -> None:
        """Run one blocking query's ``wait`` within ``max_waiters``; when full, return at
        once and say so in ``headers`` (the caller answers with what a query without
        ``wait`` gets: never a made-up answer)."""
        if self.waiters >= self.max_waiters:
            self.waits_refused += 1
            headers["Lease-Wait"] = "full"
            headers["Retry-After"] = str(RETRY_AFTER)
            return
        self.waiters += 1
        try:
            await wait()
        finally:
            self.waiters -= 1
