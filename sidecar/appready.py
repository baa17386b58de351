"""Lead only when the application can work (opt-in: ``LEASE_APP_READY_URL`` or
``LEASE_APP_READY_CONTAINERS``).

A sidecar can be healthy while its application is not (crash-looping, still warming
up, lost its own backend): the singleton work then runs nowhere. Either this watcher
GETs ``LEASE_APP_READY_URL`` every renew interval (ready: a 2xx answer), or, in a pod,
it watches its own pod and reads the ``ready`` status of the containers named in
``LEASE_APP_READY_CONTAINERS`` (their readiness probes, as kubelet reports them):

- a standby campaigns only while the last answer was 2xx (the elector asks
  :meth:`AppReadiness.why_not`), so an application that never becomes ready never leads;
- a leader whose application has not answered 2xx for ``LEASE_APP_UNREADY_AFTER`` hands
  over (``app-unready``), the safe way a ``POST /handover`` does.

The own pod is followed by :class:`sidecar.kubewatch.Follower` (backoff, bookmarks, stall
checks, restarted on any error). An apiserver that cannot be reached says nothing about
the application: kubelet cannot report a change either. So while the watch is down, the
readiness last seen counts for ``LEASE_APP_READY_OUTAGE_GRACE``, and only then does the
outage count as "not ready". Without that, an apiserver outage would stop every standby
from campaigning and make the leader hand over: a group whose lease lives in a database
would have no leader for as long as the apiserver is away.

The time spent leading while not ready is summed into each lease's state for the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sidecar.base.clock import format_duration
from sidecar.kubeapi import KubeClient, KubeError, load_aiohttp
from sidecar.kubewatch import Follower
from sidecar.state import LeaseState

if TYPE_CHECKING:
    import aiohttp  # loaded by run() (kubeapi.load_aiohttp), after the sidecar serves

log = logging.getLogger("sidecar.appready")


# Seconds of silence on the own pod's watch before one look at the pod's metadata tells
# an idle watch (a pod changes rarely) from a stalled one; half-open connections are
# found sooner, by TCP keepalive (sidecar.kubeapi).
POD_WATCH_QUIET = 30.0
NOT_SEEN = "not seen yet"


def pod_problem(pod: dict[str, Any], containers: tuple[str, ...]) -> str | None:
    """None when every container named is Ready in ``pod``'s status; else which is not."""
    statuses = {s.get("name"): s for s in (pod.get("status") or {}).get(
        "containerStatuses") or []}
    for name in containers:
        status = statuses.get(name)
        if status is None:
            return f"container {name} has no status yet (or the pod has no such container)"
        if not status.get("ready"):
            return f"container {name} is not Ready"
    return None


class AppReadiness:
    """Polls one URL or watches the own pod; tells the electors whether to campaign, and
    when to hand over."""

    def __init__(self, url: str, unready_after: float, period: float,
                 states: list[LeaseState],
                 hand_over: Callable[[str], bool],
                 pod: tuple[str, str, tuple[str, ...]] | None = None,
                 outage_grace: float = 300.0, pod_quiet: float = POD_WATCH_QUIET) -> None:
        # ``url``: what the reasons name (the URL, or "pod <name>"); ``pod``: (namespace,
        # name, containers) to watch instead of polling ``url``; ``outage_grace``: how
        # long the pod's last readiness counts while its watch is down.
        self.url = url
        self.pod = pod
        self.outage_grace = outage_grace
        self._pod_quiet = pod_quiet
        self._follower: Follower | None = None
        self._outage_logged = False
        self._problem: str | None = NOT_SEEN  # what the pod's status last said
        self.unready_after = unready_after
        self.period = period
        self.states = states
        self._hand_over = hand_over  # (lease name) -> asked; the elector's request
        self._clock = states[0].clock
        self.ready = False
        self.why = "application readiness not checked yet"
        self._unready_since: float | None = self._clock.monotonic()
        self._last_seen = self._clock.monotonic()
        self._last_problem: str | None = None
        # Set when the application turns not ready: the look already scheduled was timed
        # for a ready one (a period away), and LEASE_APP_UNREADY_AFTER may end sooner.
        self._turned_unready = asyncio.Event()

    def why_not(self) -> str | None:
        """None while the application is ready; else why this contender sits out."""
        return None if self.ready else f"not campaigning: {self.why}"

    async def run(self) -> None:
        if self.pod is not None:
            await self._run_pod(*self.pod)
            return
        await load_aiohttp()
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=max(0.2, min(self.period, 2.0)))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                self._observe(await self._probe(session))
                await asyncio.sleep(self.next_look())

    async def _probe(self, session: aiohttp.ClientSession) -> str | None:
        """None when the URL answered 2xx; else what it did."""
        import aiohttp

        try:
            async with session.get(self.url, allow_redirects=False) as answer:
                await answer.read()
                return None if 200 <= answer.status < 300 else f"answered {answer.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return f"unreachable ({str(exc) or type(exc).__name__})"

    async def _run_pod(self, namespace: str, name: str, containers: tuple[str, ...]) -> None:
        """Follow the own pod; look at what it last said every period (so a leader hands
        over on time even when no event comes)."""
        ticker = asyncio.create_task(self._tick(), name="app-readiness-tick")
        client: KubeClient | None = None
        try:
            while client is None:
                try:
                    client = KubeClient.connect(namespace)
                except KubeError as exc:  # no credentials yet (a kubeconfig may appear)
                    self._problem = f"cannot watch the own pod ({exc})"
                    self._observe(self._problem)
                    await asyncio.sleep(max(self.period, 1.0))

            def changed(kind: str, pod: dict[str, Any]) -> None:
                self._problem = ("own pod deleted" if kind == "DELETED"
                                 else pod_problem(pod, containers))
                self._observe(self.pod_view())

            self._follower = Follower(client, f"/api/v1/namespaces/{namespace}/pods", name,
                                      changed, quiet=self._pod_quiet,
                                      what=f"the watch of pod {name}")
            await asyncio.Event().wait()  # until cancelled
        finally:
            ticker.cancel()
            if self._follower is not None:
                self._follower.stop()
            if client is not None:
                await client.close()

    def pod_view(self) -> str | None:
        """What the own pod says now: the readiness last seen, or, once its watch has
        been down for ``outage_grace``, that it cannot be watched."""
        follower = self._follower
        if follower is None or follower.up:
            self._outage_logged = False
            return self._problem
        down_for = follower.down_for()
        if self._problem == NOT_SEEN:
            return f"cannot watch the own pod ({follower.error})" if follower.error \
                else NOT_SEEN
        if down_for >= self.outage_grace:
            return (f"cannot watch the own pod for {format_duration(down_for)} "
                    f"({follower.error})")
        if not self._outage_logged and follower.error:
            self._outage_logged = True
            log.warning("cannot watch the own pod; its last readiness counts until "
                        "LEASE_APP_READY_OUTAGE_GRACE", extra={
                            "url": self.url, "error": follower.error,
                            "outage_grace": format_duration(self.outage_grace)})
        return self._problem

    async def _tick(self) -> None:
        while True:
            self._turned_unready.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.next_look()):
                    await self._turned_unready.wait()
            self._observe(self.pod_view())

    def next_look(self) -> float:
        """Seconds to the next look (at the last pod status, or a probe of the URL): a
        period, or less when an unready application's LEASE_APP_UNREADY_AFTER ends sooner
        (no event comes then, and waiting for the period would add up to one to the
        hand-over's bound)."""
        if self._unready_since is None:
            return self.period
        due = self._unready_since + self.unready_after - self._clock.monotonic()
        return min(self.period, due) if due > 0 else self.period

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
            self._turned_unready.set()
        elif problem != self._last_problem:
            log.info("application still not ready", extra={"url": self.url, "error": problem})
        self._last_problem = problem
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
