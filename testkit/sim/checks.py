"""The checkers, judged on the world's true clock as each claim is handed out, for each
lease name (a shard is one) on its own.

- **No overlap**: a claim handed out by one process (a ``GET /leader`` answer, the file,
  the label) covers ``[asked, valid_until)`` on the true clock. It must not begin before
  every other process's claims of the same lease have ended. (A process's
  ``valid_until`` is on its own monotonic clock; the world knows that clock's offset.)
  The one documented exception, the advisory lock's termination notice, is a window the
  model opens while the notice travels to a holder that can hear it and closes when its
  claims stop (:meth:`Checker.excuse`).
- **Tokens grow**: a term is one process's run of claims of a lease between two
  acquisitions. Its token never changes, and each term's token is larger than every
  token of the lease's terms whose claims came before it.
- **Liveness**: after the faults stop and everything is healed, every lease (each name,
  each shard) is claimed by some process within the backend's bound
  (:meth:`Checker.quiet_began` / :meth:`Checker.quiet_ended`): a lease nobody can take
  is found even while the others change hands.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class Verdict:
    claims: int = 0
    terms: int = 0
    # Claims handed out inside a documented window (not judged for overlap).
    excused: int = 0
    violations: list[str] = field(default_factory=list)
    # Seconds from "healed" until every lease had been claimed, per quiet phase.
    recoveries: list[float] = field(default_factory=list)


@dataclass
class _Lease:
    """What the checker keeps of one lease name."""

    # process -> the latest end (true time) of the claims it handed out outside a
    # documented window
    ends: dict[str, float] = field(default_factory=dict)
    terms: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # process -> term
    highest: float = -math.inf
    highest_by: str = ""


class Checker:
    def __init__(self) -> None:
        self.verdict = Verdict()
        self._leases: dict[str, _Lease] = {}
        # (process, lease) pairs inside a documented window: their claims may overlap
        # others'.
        self._excused: set[tuple[str, str]] = set()
        self._quiet_since: float | None = None
        # The leases a quiet phase waits for, and each one's first claim since it began.
        self._expected: frozenset[str] = frozenset()
        self._first_claims: dict[str, float] = {}
        # The world's trace (the first claim of each term goes there).
        self.trace: Callable[[str], None] | None = None
        self.now = 0.0

    def excuse(self, process: str, leases: Iterable[str], on: bool) -> None:
        """Open (or close) a documented window for ``process``'s claims of ``leases``: the
        claims it hands out meanwhile may overlap others' (the advisory lock's termination
        notice, while it travels to a holder that can hear it: docs/backends.md). Each
        lease's window closes on its own, when that lease's claims stop: one session may
        hold a shard set's locks, and the process hears of their loss one by one."""
        pairs = {(process, lease) for lease in leases}
        if on:
            self._excused |= pairs
        else:
            self._excused -= pairs

    def claimed(self, process: str, lease: str, term: int, token: int | None, at: float,
                until: float) -> None:
        verdict = self.verdict
        verdict.claims += 1
        if self._quiet_since is not None:
            self._first_claims.setdefault(lease, at)
        if (process, lease) in self._excused:
            # Inside the window the old holder's claims carry its older token: the
            # downstream refuses it (what the token is for), so neither overlap nor order
            # is judged.
            verdict.excused += 1
            return
        seen = self._leases.setdefault(lease, _Lease())
        for other, end in seen.ends.items():
            if other != process and end > at:
                self._violation(
                    f"overlap on {lease}: {process} claims at {at:.4f} (term {term}, token "
                    f"{token}) while {other}'s claim runs until {end:.4f}")
        if until > seen.ends.get(process, -math.inf):
            seen.ends[process] = until
        current = seen.terms.get(process)
        if current is not None and current[0] == term:
            if current[1] != token:
                self._violation(f"token changed within a term of {lease}: {process} term "
                                f"{term} {current[1]} -> {token}")
            return
        verdict.terms += 1
        seen.terms[process] = (term, token)
        if self.trace is not None:
            self.trace(f"{process} claims {lease}: term {term}, token {token}")
        if token is None:
            self._violation(f"{process} claims {lease} without a fencing token (term {term})")
            return
        if token <= seen.highest:
            self._violation(f"token of {lease} did not grow: {process} term {term} claims "
                            f"with {token} after {seen.highest_by}'s {seen.highest:.0f}")
        if token > seen.highest:
            seen.highest, seen.highest_by = token, process

    def quiet_began(self, at: float, leases: tuple[str, ...]) -> None:
        self._quiet_since = at
        self._expected = frozenset(leases)
        self._first_claims = {}

    def led_since_quiet(self) -> bool:
        """Every lease the quiet phase waits for has been claimed since it began."""
        return self._expected <= self._first_claims.keys()

    def quiet_ended(self, at: float, bound: float, leader_expected: bool = True) -> None:
        """Judge one quiet phase: each lease claimed within ``bound`` of its start."""
        since = self._quiet_since
        self._quiet_since = None
        if since is None or not leader_expected:
            return
        missing = sorted(self._expected - self._first_claims.keys())
        if missing:
            self._violation(f"no leader of {', '.join(missing)} within {at - since:.1f}s "
                            f"after the faults ended at {since:.1f} (bound {bound:.1f}s)")
            return
        last, lease = max((self._first_claims[name], name) for name in self._expected)
        self.verdict.recoveries.append(last - since)
        if last - since > bound:
            self._violation(f"the first claim of {lease} came {last - since:.1f}s after the "
                            f"faults ended at {since:.1f} (bound {bound:.1f}s)")

    def _violation(self, text: str) -> None:
        self.verdict.violations.append(f"[{self.now:.4f}] {text}")
