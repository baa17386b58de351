"""Kubernetes Events on the pod, so ``kubectl describe pod`` and event exporters show
when this sidecar became leader, lost or released the lease, or demoted a stale label.

========================  =======  =======================================================
reason                    type     when
========================  =======  =======================================================
``LeaderElected``         Normal   the backend granted us the lease (a new term)
``LeaseLost``             Warning  a renew was refused: someone else holds the lease
``LeaseReleased``         Normal   we gave the lease back on SIGTERM or ``POST /release``
``LeaseReleased``         Warning  we gave it back because its validity ran out first
``StaleLabelDemoted``     Normal   while leading, we set another pod's ``lease-role``
                                   from ``leader`` to ``standby`` (on *that* pod, with our
                                   pod as ``related``)
========================  =======  =======================================================

The note names the lease, the fencing token of the term and the elector's reason.

Which API: core ``v1`` Events, as client-go's ``record.EventRecorder`` writes them (the
recorder its ``leaderelection`` package reports to) and as ``kubectl describe`` reads
them. ``events.k8s.io/v1`` is the same object under another view, but makes the note
immutable, so a repeated event could not show the latest fencing token.

Rate limit: the Python client has no counterpart of client-go's event correlator, and
kopf's poster creates one object per call with no limit, so this file folds repeats into
a count as the correlator does, but keyed without the note (the fencing token in it
changes every term). Occurrences with the same regarding pod, lease, reason and type
form a *series* while each comes within :data:`WINDOW` of the previous one: one
Event object whose ``count``, ``lastTimestamp`` and note follow the latest occurrence.
The first occurrence is written at once; a series is written at most once per
:data:`MIN_WRITE_INTERVAL`, repeats in between only raise the count the next write
carries. So a flapping lease costs at most one write per series per interval (a handful
of series per pod), however fast it flaps, and no occurrence is dropped from the counts.
A hand-written limiter, then, but one that coalesces instead of dropping (client-go's
spam filter, a token bucket, drops events once its burst is spent).

Never in the elector's way: ``changed`` does nothing. Tasks on the event loop follow each
state's ``transitions`` and hand occurrences to a bounded queue (``put_nowait``: a full
queue drops, never waits); one worker thread aggregates and talks to the apiserver. A
failed write is tried again after the interval, at most :data:`MAX_TRIES` times in a row
(the events that matter most, a lost lease, come when the apiserver is in trouble); its
count travels with the next write of its series in any case. Failures are logged once,
and once more when posting works again, not per event: a Role without ``events create``
costs one warning line and changes nothing else.

On ``stop`` the series with unwritten occurrences are written at once (the SIGTERM's
``LeaseReleased`` among them), bounded by :data:`STOP_TIMEOUT`. A killed sidecar posts
nothing more; its successor's ``StaleLabelDemoted`` on the dead pod tells the story.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from kubernetes.client.exceptions import ApiException

from sidecar.config import Settings
from sidecar.kube import KubeAccess, connect, one_line, request
from sidecar.redact import redact
from sidecar.state import LeaseState

if TYPE_CHECKING:
    from sidecar.publish.pod_label import PodLabelPublisher

log = logging.getLogger("sidecar.publish.events")

COMPONENT = "lease-sidecar"  # source.component / reportingComponent ("From" in describe)
WINDOW = 600.0  # seconds: a repeat this close to the previous occurrence joins its series
MIN_WRITE_INTERVAL = 30.0  # seconds between two writes of one series
QUEUE_SIZE = 64  # occurrences waiting for the worker; transitions are seconds apart
MAX_SERIES = 128  # series remembered (a few per lease, one per demoted pod)
MAX_TRIES = 5  # write attempts in a row for one series before it waits for a new occurrence
STOP_TIMEOUT = 2.0  # seconds stop() waits for the last writes
FOLLOW_POLL = 5.0  # seconds: re-read the transitions even if no change was signalled
NOTE_LIMIT = 1024  # the apiserver's limit for a note
MERGE_PATCH = "application/merge-patch+json"
# Step-down reasons the elector uses when it leaves on purpose (sidecar.elector).
VOLUNTARY = frozenset({"shutdown", "released on request"})


@dataclass(frozen=True)
class Occurrence:
    """One thing to report; ``regarding`` is None for our own pod."""

    reason: str
    type: str
    action: str
    lease: str
    note: str
    at: float  # wall time it happened
    regarding: dict[str, str] | None = None  # an ObjectReference (another pod)
    related: bool = False  # name our own pod as ``related``

    @property
    def key(self) -> tuple[str, ...]:
        uid = (self.regarding or {}).get("uid", "")
        return (uid, self.lease, self.reason, self.type)


@dataclass
class Series:
    """One Event object: the first occurrence of a key and the repeats that joined it."""

    first: Occurrence
    last: Occurrence
    last_seen: float  # monotonic
    count: int = 1
    dirty: bool = True  # holds occurrences no write has carried yet
    attempted: float = -math.inf  # monotonic: the last write attempt
    tries: int = 0  # failed write attempts in a row
    name: str | None = None  # the Event object, once created


class Aggregator:
    """Which series to write when; pure bookkeeping (the worker thread owns it)."""

    def __init__(self, window: float = WINDOW, interval: float = MIN_WRITE_INTERVAL,
                 capacity: int = MAX_SERIES) -> None:
        # A series must be written (or given up) before it may expire, or its last
        # count is lost.
        assert window > interval * MAX_TRIES
        self.window, self.interval, self.capacity = window, interval, capacity
        self.series: dict[tuple[str, ...], Series] = {}

    def add(self, occurrence: Occurrence, now: float) -> bool:
        """Fold one occurrence in; False if it had to be dropped (too many series)."""
        key = occurrence.key
        found = self.series.get(key)
        if found is not None and now - found.last_seen <= self.window:
            found.count += 1
            found.last, found.last_seen, found.dirty = occurrence, now, True
            return True
        if found is None and not self._room(now):
            return False
        self.series[key] = Series(occurrence, occurrence, now)
        return True

    def due(self, now: float, force: bool = False) -> list[Series]:
        return [s for s in self.series.values()
                if s.dirty and (force or now >= s.attempted + self.interval)]

    def wrote(self, series: Series, now: float, ok: bool) -> None:
        """Book one write attempt (the worker folds no occurrence in meanwhile)."""
        series.attempted = now
        series.tries = 0 if ok else series.tries + 1
        series.dirty = not ok and series.tries < MAX_TRIES

    def next_due(self) -> float | None:
        """Monotonic time of the next write, None if nothing waits."""
        return min((s.attempted + self.interval for s in self.series.values() if s.dirty),
                   default=None)

    def _room(self, now: float) -> bool:
        for key, series in list(self.series.items()):
            if not series.dirty and now - series.last_seen > self.window:
                del self.series[key]
        if len(self.series) < self.capacity:
            return True
        idle = [(s.last_seen, k) for k, s in self.series.items() if not s.dirty]
        if not idle:
            return False
        del self.series[min(idle)[1]]  # its object stays; a repeat starts a new one
        return True


class Outage:
    """One log line when something starts failing, one when it works again."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.failures = 0
        self._lock = threading.Lock()

    def failed(self, error: str, **fields: Any) -> None:
        with self._lock:
            self.failures += 1
            first = self.failures == 1
        if first:
            log.warning(f"{self.what} failed; further failures are not logged until it works",
                        extra={**fields, "error": error})

    def ok(self) -> None:
        with self._lock:
            failures, self.failures = self.failures, 0
        if failures:
            log.info(f"{self.what} works again", extra={"failures": failures})


def timestamp(wall: float) -> str:
    """metav1.Time: RFC 3339 in whole seconds."""
    return datetime.fromtimestamp(int(wall), tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_name(regarding: str) -> str:
    """``<object>.<hex nanoseconds>``, as client-go names Events (at most 253 chars)."""
    return f"{regarding[:236]}.{time.time_ns():x}"


def _token(token: int | None) -> str:
    return f", fencing token {token}" if token is not None else ""


def from_transition(transition: dict[str, Any], lease: str,
                    token: int | None) -> Occurrence | None:
    """The Event for one entry of ``LeaseState.transitions`` (None: not reported)."""
    event, reason = transition.get("event"), str(transition.get("reason") or "")
    if event == "acquired":
        occurrence = ("LeaderElected", "Normal", "Acquire",
                      f"acquired lease {lease}{_token(token)}")
    elif event == "lost":
        occurrence = ("LeaseLost", "Warning", "Renew",
                      f"lost lease {lease}{_token(token)}: {reason}")
    elif event == "released":
        occurrence = ("LeaseReleased", "Normal" if reason in VOLUNTARY else "Warning",
                      "Release", f"released lease {lease}{_token(token)}: {reason}")
    else:
        return None  # "api role" and anything not about leadership
    name, kind, action, note = occurrence
    at = _wall(transition.get("at"))
    return Occurrence(name, kind, action, lease, redact(note)[:NOTE_LIMIT], at)


def _wall(at: Any) -> float:
    with contextlib.suppress(TypeError, ValueError, AttributeError):
        return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
    return time.time()


class EventPublisher:
    def __init__(self, settings: Settings, states: list[LeaseState],
                 labels: PodLabelPublisher | None = None) -> None:
        if not (settings.pod_name and settings.pod_namespace):
            raise ValueError("pod events need POD_NAME and POD_NAMESPACE")
        self._settings = settings
        self._states = states
        self._pod = settings.pod_name
        self._namespace = settings.pod_namespace
        self._instance = settings.identity[:128]  # the apiserver's limit
        self._queue: queue.Queue[Occurrence | None] = queue.Queue(maxsize=QUEUE_SIZE)
        self._aggregator = Aggregator()
        # Transitions already handed on, per state (event_counts only ever grow).
        self._seen = [sum(state.event_counts.values()) for state in states]
        self._tokens: dict[str, int | None] = {}  # lease -> token of the current term
        self._followers: list[asyncio.Task[None]] = []
        self._worker: threading.Thread | None = None
        self._stopping = threading.Event()
        self._access: KubeAccess | None = None
        self._own: dict[str, str] | None = None  # ObjectReference of our pod
        self._posting = Outage("posting pod events")
        self._queueing = Outage("queueing pod events")
        if labels is not None:
            labels.on_demoted = self.demoted

    # -- Publisher -----------------------------------------------------------------------
    async def start(self) -> None:
        self._worker = threading.Thread(target=self._run, daemon=True, name="pod-events")
        self._worker.start()
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
        self._stopping.set()
        with contextlib.suppress(queue.Full):  # full: the worker is awake anyway
            self._queue.put_nowait(None)
        worker = self._worker
        if worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, worker.join, STOP_TIMEOUT)
        if (worker is None or not worker.is_alive()) and self._access is not None:
            self._access.api.close()

    # -- producers (event loop; ``demoted`` on kopf's threads) ---------------------------
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
                    f"{state.lease}{_token(state.facts.fencing_token)}")
            self._offer(Occurrence(
                "StaleLabelDemoted", "Normal", "Relabel", state.lease, redact(note),
                time.time(), regarding=_reference(meta, self._namespace), related=True))
        except Exception as exc:  # never disturb kopf's handler
            self._queueing.failed(one_line(exc))

    def _offer(self, occurrence: Occurrence) -> None:
        try:
            self._queue.put_nowait(occurrence)
        except queue.Full:
            self._queueing.failed("queue full", reason=occurrence.reason)

    # -- the worker thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            due = self._aggregator.next_due()
            self._take(None if due is None else max(0.0, due - time.monotonic()))
            self._flush(force=False)
        while self._take(0.0):
            pass
        # Stopping: no later write would carry what is still unwritten.
        self._flush(force=True)

    def _take(self, timeout: float | None) -> bool:
        try:
            item = self._queue.get(timeout=timeout) if timeout != 0.0 else (
                self._queue.get_nowait())
        except queue.Empty:
            return False
        if item is not None:
            if self._aggregator.add(item, time.monotonic()):
                self._queueing.ok()
            else:
                self._queueing.failed("too many event series", reason=item.reason)
        return True

    def _flush(self, force: bool) -> None:
        now = time.monotonic()
        for series in self._aggregator.due(now, force):
            try:
                self._write(series)
            except Exception as exc:
                self._aggregator.wrote(series, now, ok=False)
                self._posting.failed(one_line(exc), reason=series.last.reason,
                                     namespace=self._namespace)
            else:
                self._aggregator.wrote(series, now, ok=True)
                self._posting.ok()

    def _write(self, series: Series) -> None:
        if self._access is None:
            self._access = connect(self._settings)
        api = self._access.api
        last = series.last
        if series.name is not None:
            patch = {"count": series.count, "lastTimestamp": timestamp(last.at),
                     "message": last.note}
            try:
                request(api, "PATCH", self._events_path(series.name), patch,
                        content_type=MERGE_PATCH)
                return
            except ApiException as exc:
                if exc.status != 404:
                    raise
                # Gone (the apiserver keeps Events an hour by default): a new object.
        regarding = last.regarding or self._own_reference()
        body: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"name": event_name(regarding["name"]),
                         "namespace": self._namespace},
            "involvedObject": regarding,
            "reason": last.reason, "message": last.note, "type": last.type,
            "action": last.action,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT, "reportingInstance": self._instance,
            "firstTimestamp": timestamp(series.first.at),
            "lastTimestamp": timestamp(last.at), "count": series.count,
        }
        if last.related:
            body["related"] = self._own_reference()
        created = request(api, "POST", self._events_path(), body)
        series.name = created["metadata"]["name"]

    def _own_reference(self) -> dict[str, str]:
        """Our pod with its uid (``kubectl describe`` matches on it); fetched once."""
        if self._own is None:
            assert self._access is not None
            pod = request(self._access.api, "GET",
                          f"/api/v1/namespaces/{self._namespace}/pods/{quote(self._pod)}")
            self._own = _reference(pod["metadata"], self._namespace)
        return self._own

    def _events_path(self, name: str | None = None) -> str:
        path = f"/api/v1/namespaces/{self._namespace}/events"
        return f"{path}/{quote(name)}" if name else path


def _reference(meta: dict[str, Any], namespace: str) -> dict[str, str]:
    return {"apiVersion": "v1", "kind": "Pod", "namespace": meta.get("namespace") or namespace,
            "name": meta["name"], "uid": meta["uid"]}


def create(settings: Settings, states: list[LeaseState],
           labels: PodLabelPublisher | None = None) -> EventPublisher:
    return EventPublisher(settings, states, labels)
