"""Lead only when the application can work (``LEASE_APP_READY_URL``, opt-in).

A sidecar can be healthy while its application is not (crash-looping, still warming
up, lost its own backend): the singleton work then runs nowhere. With
``LEASE_APP_READY_URL`` set, this watcher GETs that URL every renew interval:

- a standby campaigns only while the last answer was 2xx (the elector asks
  :meth:`AppReadiness.why_not`), so an application that never becomes ready never leads;
- a leader whose application has not answered 2xx for ``LEASE_APP_UNREADY_AFTER`` hands
  over (``app-unready``), the safe way a ``POST /handover`` does.

The time spent leading while not ready is summed into each lease's state for the metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from sidecar.durations import format_duration
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.appready")


class AppReadiness:
    """Polls one URL; tells the electors whether to campaign, and when to hand over."""

    def __init__(self, url: str, unready_after: float, period: float,
                 states: list[LeaseState],
                 hand_over: Callable[[str], bool]) -> None:
        self.url = url
        self.unready_after = unready_after
        self.period = period
        self.states = states
        self._hand_over = hand_over  # (lease name) -> asked; the elector's request
        self._clock = states[0].clock
        self.ready = False
        self.why = "application readiness not checked yet"
        self._unready_since: float | None = self._clock.monotonic()
        self._last_seen = self._clock.monotonic()

    def why_not(self) -> str | None:
        """None while the application is ready; else why this contender sits out."""
        return None if self.ready else f"not campaigning: {self.why}"

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=max(0.2, min(self.period, 2.0)))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                self._observe(await self._probe(session))
                await asyncio.sleep(self.period)

    async def _probe(self, session: aiohttp.ClientSession) -> str | None:
        """None when the URL answered 2xx; else what it did."""
        try:
            async with session.get(self.url, allow_redirects=False) as answer:
                await answer.read()
                return None if 200 <= answer.status < 300 else f"answered {answer.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return f"unreachable ({str(exc) or type(exc).__name__})"

    def _observe(self, problem: str | None) -> None:
        now = self._clock.monotonic()
        elapsed, self._last_seen = now - self._last_seen, now
        for state in self.states:
            if not self.ready and state.facts.holding:
                state.unready_leading_seconds += elapsed
        if problem is None:
            if not self.ready:
                log.info("application ready", extra={"url": self.url})
            self.ready, self.why, self._unready_since = True, "", None
            return
        if self.ready or self._unready_since is None:
            log.warning("application not ready", extra={"url": self.url, "error": problem})
            self._unready_since = now
        self.ready = False
        self.why = f"the application is not ready: {self.url} {problem}"
        if now - self._unready_since < self.unready_after:
            return
        for state in self.states:
            if state.facts.holding and not state.facts.released and self._hand_over(
                    state.lease):
                log.warning("application not ready for LEASE_APP_UNREADY_AFTER; handing over",
                            extra={"lease": state.lease, "url": self.url,
                                   "unready_after": format_duration(self.unready_after)})
