"""What this contender may claim, computed at the moment someone asks.

The elector writes facts here (we hold the lease until monotonic time T, we may publish
from time P); readers — the HTTP handler, the file and label publishers — ask for a
*claim* and get one only if the facts still prove leadership *now*. A process that was
frozen and resumes therefore answers "not leader" before the elector has even run.

Every claim handed out expires at ``min(lease validity, now + claim_horizon)``, so a
claim outlives the moment we stop handing them out by at most one horizon. The state
remembers the latest expiry it handed out (``issued_until``): a holder that steps down
waits until then before it gives the lease back, so a next holder that does not wait
(a client-go elector) never overlaps a claim of ours.

Two ways to wait: :meth:`LeaseState.wait_for_change` wakes on every update of the facts
(renews included); :meth:`LeaseState.wait_for_leadership_change` only when the answer a
reader gets changes — leader or not, holder, fencing token, role — including the moments
a claim becomes valid or lapses with no update at all (the first claim one horizon after
the acquire, a renew that hangs until validity runs out). The long-poll and its ETag
follow the latter, so an idle leader's waiters sleep through renews.

Why these rules keep two contenders' claims apart: ``docs/design.md`` (the safety model).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from sidecar.base.clock import Clock, SystemClock, rfc3339
from sidecar.base.stats import CallStats


@dataclass(frozen=True)
class Facts:
    """What the elector knows; replaced whole on every change (one version each)."""

    version: int = 0
    holding: bool = False  # the backend granted us the lease
    claim_from: float = 0.0  # monotonic: no claim before (advisory-lock handover)
    valid_until: float = 0.0  # monotonic: the backend's guarantee ends
    fencing_token: int | None = None
    holder: str | None = None
    since: float = 0.0  # wall time the current role began
    backend_ok: bool = False
    released: bool = False  # unpublished: no claims from here on, even while holding
    reason: str = "starting"
    # Why this contender does not campaign now (its application is not ready), or None:
    # the pod annotation says so, and hand-overs pick no successor that would not come.
    sitting_out: str | None = None

    # -- the claim rule: the one place that says whether these facts prove leadership --
    def leads_at(self, now: float) -> bool:
        """Whether these facts prove leadership at monotonic time ``now``.

        Fail closed: only while the backend grants us the lease, we have not unpublished,
        the first claim of the term is due (``claim_from``, one horizon after an acquire
        that may follow another holder's claims) and the proven validity has not ended.
        Pure, so any thread may ask (the kopf handlers of the pod label do).
        """
        return (self.holding and not self.released
                and self.claim_from <= now < self.valid_until)

    def next_flip(self, now: float) -> float | None:
        """The next monotonic moment :meth:`leads_at` changes with these facts as they
        are (the first claim of the term, or the end of validity); None: never."""
        if not self.holding or self.released:
            return None
        later = [t for t in (self.claim_from, self.valid_until) if t > now]
        return min(later) if later else None


# What a reader's answer says, renews aside: leader, holder, fencing token, role.
Leadership = tuple[bool, str | None, int | None, str]


@dataclass(frozen=True)
class Claim:
    leader: bool
    valid_until: float | None  # monotonic
    facts: Facts


@dataclass
class WorkBeats:
    """The application's ``POST /heartbeat``s and what the work watchdog made of them
    (:mod:`sidecar.watchdog`); read by ``/status`` and the metrics."""

    stall_after: float | None = None  # LEASE_WORK_STALL_AFTER; None: no watchdog
    last_beat: float | None = None  # monotonic
    last_beat_wall: float = 0.0  # Unix time; 0: never
    stalls: int = 0
    last_stall: dict[str, Any] | None = None  # {"at": RFC 3339, "reason": ...}


@dataclass
class LeaseState:
    lease: str
    identity: str
    role: str
    claim_horizon: float
    clock: Clock = field(default_factory=SystemClock)
    facts: Facts = field(default_factory=Facts)
    transitions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=50))
    event_counts: dict[str, int] = field(default_factory=dict)
    stats: CallStats = field(default_factory=CallStats)
    # Monotonic: the latest ``valid_until`` of any claim handed out so far. Only the
    # event loop's thread asks for claims, so a plain compare-and-store is enough.
    issued_until: float = 0.0
    work: WorkBeats = field(default_factory=WorkBeats)
    # Deliberate hand-overs this contender made as the leader, by reason
    # (:data:`sidecar.elector.HANDOVER_REASONS`).
    handovers: dict[str, int] = field(default_factory=dict)
    # Seconds this contender held the lease while its application was not ready
    # (LEASE_APP_READY_URL), summed over terms: the cost the option bounds.
    unready_leading_seconds: float = 0.0
    # Acquire attempts that found a live holder with this contender's identity.
    duplicate_identity: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.facts = replace(self.facts, since=self.clock.wall())

    # -- written by the elector ------------------------------------------------------
    def update(self, event: str | None = None, **changes: Any) -> Facts:
        old = self.facts
        new = replace(old, version=old.version + 1, **changes)
        if new.holding != old.holding:
            new = replace(new, since=self.clock.wall())
        self.facts = new
        if event:
            self.event_counts[event] = self.event_counts.get(event, 0) + 1
            self.transitions.append({
                "at": rfc3339(self.clock.wall()), "event": event,
                "fencing_token": new.fencing_token, "holder": new.holder,
                "reason": new.reason,
            })
        # Wake every waiter of the old version, then arm a fresh event for the next.
        self._changed.set()
        self._changed = asyncio.Event()
        return new

    def observe_call(self, operation: str, seconds: float, outcome: str) -> None:
        """One backend round trip (see :mod:`sidecar.base.stats`), for the metrics."""
        self.stats.observe(operation, seconds, outcome, self.clock.wall())

    # -- read by publishers ----------------------------------------------------------
    def claim(self) -> Claim:
        """Leadership as of now, as a claim valid for at most one horizon.

        Every claim asked for counts as handed out (``issued_until``), whether it then
        goes to an HTTP client, the file, the pod label or ``/status``.
        """
        facts = self.facts
        now = self.clock.monotonic()
        if facts.leads_at(now):
            until = min(facts.valid_until, now + self.claim_horizon)
            if until > self.issued_until:
                self.issued_until = until
            return Claim(True, until, facts)
        return Claim(False, None, facts)

    def to_wall(self, monotonic: float | None) -> float | None:
        if monotonic is None:
            return None
        return self.clock.wall() + (monotonic - self.clock.monotonic())

    async def wait_for_change(self, version: int, timeout: float) -> None:
        """Block while the state still has ``version``, at most ``timeout`` seconds.

        Any update wakes it, renews included; a claim that lapses without an update does
        not (see :meth:`wait_for_leadership_change`).
        """
        if self.facts.version != version or timeout <= 0:
            return
        await self._next_update(timeout)

    async def _next_update(self, timeout: float) -> None:
        """Sleep until the next :meth:`update`, at most ``timeout`` seconds."""
        event = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()

    # -- leadership: what a reader's answer depends on, renews aside -----------------
    def leadership(self, claim: Claim) -> Leadership:
        """The parts of the answer that only a change of leadership changes (the body's
        ``valid_until`` moves with every claim; ``since`` moves with ``holding``, which
        changes ``holder`` or ``leader`` too)."""
        facts = claim.facts
        return (claim.leader, self.identity if claim.leader else facts.holder,
                facts.fencing_token if claim.leader else None, self.role)

    async def wait_for_leadership_change(self, seen: Leadership, timeout: float) -> None:
        """Block while :meth:`leadership` is still ``seen``, at most ``timeout`` s.

        Updates that leave the answer alone (renews, a standby's retries) wake this
        loop, not its caller. Between updates it sleeps at most until the claim rule's
        next boundary, since the answer can change there with no update at all.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.leadership(self.claim()) == seen:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            now = self.clock.monotonic()
            boundary = self.facts.next_flip(now)
            if boundary is not None:
                remaining = min(remaining, boundary - now)
            await self._next_update(remaining)
