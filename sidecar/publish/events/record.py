"""What to report, and how repeats fold into one Event object.

Rate limit: the Python client has no counterpart of client-go's event correlator, and
kopf's poster creates one object per call with no limit, so this module folds repeats
into a count as the correlator does, but keyed without the note (the fencing token in it
changes every term). Occurrences with the same regarding pod, lease, reason and type
form a *series* while each comes within :data:`WINDOW` of the previous one: one
Event object whose ``count``, ``lastTimestamp`` and note follow the latest occurrence.
The first occurrence is written at once; a series is written at most once per
:data:`MIN_WRITE_INTERVAL`, repeats in between only raise the count the next write
carries. So a flapping lease costs at most one write per series per interval (a handful
of series per pod), however fast it flaps, and no occurrence is dropped from the counts.
A hand-written limiter, then, but one that coalesces instead of dropping (client-go's
spam filter, a token bucket, drops events once its burst is spent).

A failed write is tried again after the interval, at most :data:`MAX_TRIES` times in a
row (the events that matter most, a lost lease, come when the apiserver is in trouble);
its count travels with the next write of its series in any case.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sidecar.base.redact import redact

WINDOW = 600.0  # seconds: a repeat this close to the previous occurrence joins its series
MIN_WRITE_INTERVAL = 30.0  # seconds between two writes of one series
MAX_SERIES = 128  # series remembered (a few per lease, one per demoted pod)
MAX_TRIES = 5  # write attempts in a row for one series before it waits for a new occurrence
NOTE_LIMIT = 1024  # the apiserver's limit for a note
# Step-down reasons the elector uses when it leaves on purpose (sidecar.elector).
VOLUNTARY = frozenset({"shutdown", "released on request"})
HANDED_OVER = "handed over"
APP_UNREADY = "(app-unready)"


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


def token_note(token: int | None) -> str:
    """How a note names the term's fencing token (nothing when there is none)."""
    return f", fencing token {token}" if token is not None else ""


def from_transition(transition: dict[str, Any], lease: str,
                    token: int | None) -> Occurrence | None:
    """The Event for one entry of ``LeaseState.transitions`` (None: not reported)."""
    event, reason = transition.get("event"), str(transition.get("reason") or "")
    if event == "acquired":
        occurrence = ("LeaderElected", "Normal", "Acquire",
                      f"acquired lease {lease}{token_note(token)}")
    elif event == "lost":
        occurrence = ("LeaseLost", "Warning", "Renew",
                      f"lost lease {lease}{token_note(token)}: {reason}")
    elif event == "released" and reason.startswith(HANDED_OVER):
        # A deliberate hand-over (sidecar.elector.Elector.request_handover); one whose
        # application was not ready is worth a look.
        occurrence = ("LeaseHandedOver", "Warning" if APP_UNREADY in reason else "Normal",
                      "Handover", f"released lease {lease}{token_note(token)}: {reason}")
    elif event == "released":
        occurrence = ("LeaseReleased", "Normal" if reason in VOLUNTARY else "Warning",
                      "Release", f"released lease {lease}{token_note(token)}: {reason}")
    else:
        return None  # "api role" and anything not about leadership
    name, kind, action, note = occurrence
    at = _wall(transition.get("at"))
    return Occurrence(name, kind, action, lease, redact(note)[:NOTE_LIMIT], at)


def _wall(at: Any) -> float:
    with contextlib.suppress(TypeError, ValueError, AttributeError):
        return datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
    return time.time()
