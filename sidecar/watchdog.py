"""The work watchdog: a leader whose application stopped working steps down.

Holding the lease proves only that the sidecar is alive. With
``LEASE_WORK_STALL_AFTER`` set, the application proves its own work by ``POST
/heartbeat`` while it leads; when no beat came for that long — counted from the first
claim of the term, so a fresh leader gets the full period — the watchdog asks the
elector to step down exactly as ``POST /release`` does (unpublish, release, sit out one
lease duration), so another contender, whose application may work, takes over. Why is
kept in the state for ``/status`` and the metrics.

Beats are accepted only while this contender hands out leader claims: a standby's
application has no work to prove, and a beat from an earlier term never counts for a
later one (the deadline is measured from the later of the term's first claim and the
last beat).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

from sidecar.base.clock import format_duration, rfc3339
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.watchdog")

BeatOutcome = Literal["beat", "not-leading", "no-such-lease"]

# How long to wait, after asking for a step-down, for leadership to change before
# looking again (a step-down normally takes milliseconds).
RECHECK = 60.0
# Not leading: look again at least this often (a leadership change wakes it at once).
IDLE = 3600.0


def beat(state: LeaseState) -> tuple[BeatOutcome, dict[str, Any]]:
    """Record one heartbeat of the application, if this contender leads."""
    if not state.claim().leader:
        return "not-leading", {}
    work = state.work
    work.last_beat = state.clock.monotonic()
    work.last_beat_wall = state.clock.wall()
    answer: dict[str, Any] = {"lease": state.lease, "at": rfc3339(work.last_beat_wall),
                              "stall_after": work.stall_after, "stalls_at": None}
    if work.stall_after is not None:
        answer["stalls_at"] = rfc3339(work.last_beat_wall + work.stall_after)
    return "beat", answer


def status(state: LeaseState) -> dict[str, Any]:
    """The ``work`` part of a lease in ``/status``."""
    work = state.work
    return {"stall_after": work.stall_after,
            "last_heartbeat": rfc3339(work.last_beat_wall) if work.last_beat_wall else None,
            "stalls": work.stalls, "last_stall": work.last_stall}


class WorkWatchdog:
    """One lease's watchdog; ``step_down(reason)`` is the elector's ``request_release``."""

    def __init__(self, state: LeaseState, stall_after: float,
                 step_down: Callable[[str], bool]) -> None:
        self.state = state
        self.stall_after = stall_after
        self._step_down = step_down
        state.work.stall_after = stall_after
        self._stalled_term: float | None = None

    def _beat_this_term(self) -> float | None:
        """The last beat, if it came after this term's first claim (an earlier term's
        beat never counts for a later one)."""
        last = self.state.work.last_beat
        return last if last is not None and last > self.state.facts.claim_from else None

    def deadline(self) -> float:
        """Monotonic time this term stalls without another beat."""
        beat = self._beat_this_term()
        return (self.state.facts.claim_from if beat is None else beat) + self.stall_after

    async def run(self) -> None:
        state = self.state
        while True:
            claim = state.claim()
            seen = state.leadership(claim)
            if not claim.leader:
                await state.wait_for_leadership_change(seen, IDLE)
                continue
            term = claim.facts.claim_from
            if term == self._stalled_term:  # asked already; the step-down is under way
                await state.wait_for_leadership_change(seen, RECHECK)
                continue
            now = state.clock.monotonic()
            deadline = self.deadline()
            if now < deadline:
                # A beat meanwhile only moves the deadline later: look again then.
                await state.wait_for_leadership_change(seen, deadline - now)
                continue
            self._stalled_term = term
            self._stall(now - (deadline - self.stall_after))

    def _stall(self, silent: float) -> None:
        state, work = self.state, self.state.work
        heard = ("since its last heartbeat" if self._beat_this_term() is not None
                 else "since the first claim of this term (no heartbeat yet)")
        reason = (f"work stalled: no POST /heartbeat for {format_duration(round(silent, 3))} "
                  f"{heard}; LEASE_WORK_STALL_AFTER is {format_duration(self.stall_after)}")
        work.stalls += 1
        work.last_stall = {"at": rfc3339(state.clock.wall()), "reason": reason,
                           "fencing_token": state.facts.fencing_token}
        log.warning("work stalled; stepping down", extra={
            "lease": state.lease, "identity": state.identity,
            "fencing_token": state.facts.fencing_token, "reason": reason})
        if not self._step_down(reason):
            log.warning("work stalled but the lease is no longer held",
                        extra={"lease": state.lease})
