"""Fault kinds, the record of one injected fault, and the seeded schedule that picks them.

The schedule owns one ``random.Random(seed)``; every choice (which fault, leader or
not, durations, restart delays, pauses) is drawn from it in the order the harness asks,
so a seed replays the same sequence of decisions. Real processes make exact timings
differ between runs; the decisions do not.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# Faults on one sidecar process.
PROCESS_FAULTS = ("sigkill", "sigstop", "sigterm")
# Faults on the path between one sidecar and its backend (through the harness's proxy).
NETWORK_FAULTS = ("cut", "latency", "partition")
# ``failover``: the standby stops receiving WAL, the lease changes hands during the lag,
# then the primary dies and the standby is promoted (PostgreSQL with a harness-owned server).
# ``foreign-write``: someone else writes the lease (kubernetes: kubectl edits or deletes
# the Lease, as an operator's runbook does); params["edit"] says which write.
BACKEND_FAULTS = ("backend-restart", "failover", "foreign-write")
FOREIGN_EDITS = ("holder-cleared", "holder-to-standby", "duration-1s", "deleted")
ALL_FAULTS = PROCESS_FAULTS + NETWORK_FAULTS + BACKEND_FAULTS


@dataclass
class Fault:
    """One injected fault, as the checker needs it."""

    index: int
    kind: str
    at: float  # wall time of injection
    target: str  # sidecar identity, or "backend"
    leader: str | None  # who claimed leadership at injection
    params: dict[str, Any] = field(default_factory=dict)
    bound: float = 0.0  # seconds from ``at`` within which a leader must be back
    # The overlap the backend documents for this fault (0: none may happen).
    overlap_bound: float = 0.0
    ended: float | None = None  # wall time the fault stopped acting (heal, restart done)

    @property
    def leader_hit(self) -> bool:
        """Could this fault take leadership away? (Backend faults hit everyone.)"""
        return self.target == "backend" or (self.leader is not None
                                            and self.target == self.leader)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "at": self.at, "target": self.target,
                "leader": self.leader, "leader_hit": self.leader_hit, "params": self.params,
                "bound": self.bound, "ended": self.ended}


class Schedule:
    def __init__(self, seed: int, kinds: tuple[str, ...], lease_duration: float,
                 leader_bias: float = 0.5, pause: tuple[float, float] = (0.1, 0.6)) -> None:
        self.rng = random.Random(seed)
        self.kinds = kinds
        self.lease_duration = lease_duration
        self.leader_bias = leader_bias
        self.pause_range = pause

    def kind(self, allowed: tuple[str, ...]) -> str:
        return self.rng.choice([k for k in self.kinds if k in allowed])

    def target(self, candidates: list[str], leader: str | None) -> str:
        """The leader with probability ``leader_bias`` (takeovers are what we measure),
        else any candidate."""
        if leader in candidates and self.rng.random() < self.leader_bias:
            return leader
        return self.rng.choice(sorted(candidates))

    def params(self, kind: str) -> dict[str, float]:
        rng, lease = self.rng, self.lease_duration
        if kind == "sigstop":  # longer than the lease, so a standby must take over
            return {"stopped_for": round(lease * rng.uniform(1.2, 2.0), 3)}
        if kind in ("sigkill", "sigterm"):
            return {"restart_after": round(rng.uniform(0.2, 2.0), 3)}
        if kind == "cut":
            return {"refuse_for": round(rng.uniform(0.1, lease), 3)}
        if kind == "latency":
            return {"delay": round(rng.uniform(0.05, 1.0), 3),
                    "for": round(rng.uniform(0.5, 1.5 * lease), 3)}
        if kind == "partition":
            return {"for": round(rng.uniform(0.2, 1.5 * lease), 3)}
        if kind == "backend-restart":
            return {"down_for": round(rng.uniform(0.0, 1.0), 3)}
        if kind == "foreign-write":
            return {"edit": rng.choice(FOREIGN_EDITS)}
        if kind == "failover":
            return {"handovers": rng.choice((1, 2)),
                    "promote_after": round(rng.uniform(0.1, 0.5), 3)}
        raise ValueError(f"unknown fault {kind!r}")

    def pause(self) -> float:
        """Time between a fault and the next (on top of waiting for a leader)."""
        return self.rng.uniform(*self.pause_range)
