"""The events publisher: follows the lease states and writes their series of Events.

Never in the elector's way: ``changed`` does nothing. Tasks on the event loop follow each
state's ``transitions`` and hand occurrences to a bounded queue (``put_nowait``: a full
queue drops, never waits); one writer task aggregates (:mod:`.record`) and talks to the
apiserver (:mod:`sidecar.kubeapi`). Failures are logged once, and once more when posting
works again, not per event: a Role without ``events create`` costs one warning line and
changes nothing else.

On ``stop`` the series with unwritten occurrences are written at once (the SIGTERM's
``LeaseReleased`` among them), bounded by :data:`STOP_TIMEOUT`. A killed sidecar posts
nothing more; its successor's ``StaleLabelDemoted`` on the dead pod tells the story.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sidecar.base.redact import redact
from sidecar.kubeapi import KubeClient, KubeError, one_line
from sidecar.publish.events.record import (
    Aggregator,
    Occurrence,
    Series,
    from_transition,
    token_note,
)
from sidecar.publish.own_pod import OwnPod
from sidecar.settings import Settings
from sidecar.state import LeaseState

if TYPE_CHECKING:
    from sidecar.publish.pod_label import PodLabelPublisher

log = logging.getLogger("sidecar.publish.events")

COMPONENT = "lease-sidecar"  # source.component / reportingComponent ("From" in describe)
QUEUE_SIZE = 64  # occurrences waiting for the worker; transitions are seconds apart
STOP_TIMEOUT = 2.0  # seconds stop() waits for the last writes
FOLLOW_POLL = 5.0  # seconds: re-read the transitions even if no change was signalled


class Outage:
    """One log line when something starts failing, one when it works again."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures = 0

    def failed(self, error: str, **fields: Any) -> None:
        self.failures += 1
        if self.failures == 1:
            log.warning(f"{self.what} failed; further failures are not logged until it works",
                        extra={**fields, "error": error})

    def ok(self) -> None:
        failures, self.failures = self.failures, 0
        if failures:
            log.info(f"{self.what} works again", extra={"failures": failures})


def timestamp(wall: float) -> str:
    """metav1.Time: RFC 3339 in whole seconds."""
    return datetime.fromtimestamp(int(wall), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_name(regarding: str) -> str:
    """``<object>.<hex nanoseconds>``, as client-go names Events (at most 253 chars)."""
    return f"{regarding[:236]}.{time.time_ns():x}"


class EventPublisher:
    def __init__(self, settings: Settings, states: list[LeaseState],
                 labels: PodLabelPublisher | None = None) -> None:
        self._pod = OwnPod.of(settings, "pod events need")
        self._settings = settings
        self._states = states
        self._instance = settings.identity[:128]  # the apiserver's limit
        self._queue: asyncio.Queue[Occurrence | None] = asyncio.Queue(maxsize=QUEUE_SIZE)
        self._aggregator = Aggregator()
        # Transitions already handed on, per state (event_counts only ever grow).
        self._seen = [sum(state.event_counts.values()) for state in states]
        self._tokens: dict[str, int | None] = {}  # lease -> token of the current term
        self._followers: list[asyncio.Task[None]] = []
        self._writer: asyncio.Task[None] | None = None
        self._stopping = False
        self._client: KubeClient | None = None
        self._own_ref: dict[str, str] | None = None  # ObjectReference of our pod
        self._posting = Outage("posting pod events")
        self._queueing = Outage("queueing pod events")
        if labels is not None:
            labels.on_demoted = self.demoted

    # -- Publisher -----------------------------------------------------------------------
    async def start(self) -> None:
        self._writer = asyncio.create_task(self._run(), name="pod-events")
        if self._settings.role == "api":
            return  # never leads, never demotes: nothing to report
        for index, state in enumerate(self._states):
            self._followers.append(asyncio.create_task(
                self._follow(index, state), name=f"events-{state.lease}"))

    async def changed(self, state: LeaseState) -> None:
        """Nothing to do on the elector's path: the followers read the transitions."""

    async def stop(self) -> None:
        for task in self._followers:
            task.cancel()
        for task in self._followers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # The elector's last transition (the step-down of a SIGTERM) lands after its
        # final notify; pick it up here, the followers may not have run since.
        for index, state in enumerate(self._states):
            self._catch_up(index, state)
        self._stopping = True
        with contextlib.suppress(asyncio.QueueFull):  # full: the writer is awake anyway
            self._queue.put_nowait(None)
        if self._writer is not None:
            try:
                async with asyncio.timeout(STOP_TIMEOUT):
                    await self._writer
            except TimeoutError:
                pass  # cancelled by the timeout: what is unwritten is lost
        if self._client is not None:
            await self._client.close()

    # -- producers (event loop) ----------------------------------------------------------
    async def _follow(self, index: int, state: LeaseState) -> None:
        while True:
            version = state.facts.version
            self._catch_up(index, state)
            await state.wait_for_change(version, FOLLOW_POLL)

    def _catch_up(self, index: int, state: LeaseState) -> None:
        total = sum(state.event_counts.values())
        new, self._seen[index] = total - self._seen[index], total
        if new <= 0:
            return
        for transition in list(state.transitions)[-new:]:
            token = transition.get("fencing_token")
            if transition.get("event") == "acquired":
                self._tokens[state.lease] = token
            elif token is None:  # a step-down records no token: name the term's
                token = self._tokens.get(state.lease)
            occurrence = from_transition(transition, state.lease, token)
            if occurrence is not None:
                self._offer(occurrence)

    def demoted(self, pod: dict[str, Any]) -> None:
        """The pod label publisher set ``pod`` (its PATCH answer) to standby."""
        try:
            meta = pod["metadata"]
            state = self._states[0]  # the label follows the first lease
            note = (f"lease-role leader -> standby: {state.identity} holds lease "
                    f"{state.lease}{token_note(state.facts.fencing_token)}")
            self._offer(Occurrence(
                "StaleLabelDemoted", "Normal", "Relabel", state.lease, redact(note),
                time.time(), regarding=self._pod.reference(meta), related=True))
        except Exception as exc:  # never disturb the label publisher
            self._queueing.failed(one_line(str(exc)))

    def _offer(self, occurrence: Occurrence) -> None:
        try:
            self._queue.put_nowait(occurrence)
        except asyncio.QueueFull:
            self._queueing.failed("queue full", reason=occurrence.reason)

    # -- the writer task -----------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stopping:
            due = self._aggregator.next_due()
            await self._take(None if due is None else max(0.0, due - time.monotonic()))
            await self._flush(force=False)
        while await self._take(0.0):
            pass
        # Stopping: no later write would carry what is still unwritten.
        await self._flush(force=True)

    async def _take(self, timeout: float | None) -> bool:
        try:
            if timeout == 0.0:
                item = self._queue.get_nowait()
            else:
                async with asyncio.timeout(timeout):
                    item = await self._queue.get()
        except (asyncio.QueueEmpty, TimeoutError):
            return False
        if item is not None:
            if self._aggregator.add(item, time.monotonic()):
                self._queueing.ok()
            else:
                self._queueing.failed("too many event series", reason=item.reason)
        return True

    async def _flush(self, force: bool) -> None:
        now = time.monotonic()
        for series in self._aggregator.due(now, force):
            try:
                await self._write(series)
            except KubeError as exc:
                self._aggregator.wrote(series, now, ok=False)
                self._posting.failed(str(exc), reason=series.last.reason,
                                     namespace=self._pod.namespace)
            else:
                self._aggregator.wrote(series, now, ok=True)
                self._posting.ok()

    async def _write(self, series: Series) -> None:
        if self._client is None:
            self._client = KubeClient.connect(self._pod.namespace)
        client = self._client
        last = series.last
        if series.name is not None:
            patch = {"count": series.count, "lastTimestamp": timestamp(last.at),
                     "message": last.note}
            try:
                await client.patch(self._pod.events_path(series.name), patch)
                return
            except KubeError as exc:
                if exc.status != 404:
                    raise
                # Gone (the apiserver keeps Events an hour by default): a new object.
        regarding = last.regarding or await self._own_reference()
        body: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": event_name(regarding["name"]),
                         "namespace": self._pod.namespace},
            "involvedObject": regarding,
            "reason": last.reason, "message": last.note, "type": last.type,
            "action": last.action,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT, "reportingInstance": self._instance,
            "firstTimestamp": timestamp(series.first.at),
            "lastTimestamp": timestamp(last.at), "count": series.count,
        }
        if last.related:
            body["related"] = await self._own_reference()
        created = await client.post(self._pod.events_path(), body)
        series.name = created["metadata"]["name"]

    async def _own_reference(self) -> dict[str, str]:
        """Our pod with its uid (``kubectl describe`` matches on it); fetched once."""
        if self._own_ref is None:
            assert self._client is not None
            pod = await self._client.get(self._pod.pods_path(self._pod.name))
            self._own_ref = self._pod.reference(pod["metadata"])
        return self._own_ref


def create(settings: Settings, states: list[LeaseState],
           labels: PodLabelPublisher | None = None) -> EventPublisher:
    return EventPublisher(settings, states, labels)
