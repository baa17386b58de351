"""Round trips of backend calls, recorded by the elector and read by the metrics.

The elector times every acquire and renew it sends and records it here with its outcome;
``sidecar.metrics`` turns these counts into histograms when scraped. Plain counters, no
Prometheus objects: the state stays free of any exporter, and a scrape reads numbers
that only the event loop writes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Upper bounds (seconds) of the round-trip buckets: from a local SQLite file (well under
# a millisecond) to an advisory-lock acquire that waits inside the server for seconds.
BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Per operation, its outcomes. held: the backend granted (or kept) the lease; refused: it
# answered that someone else holds it (for a renew: the lease is lost); error: the call
# failed; timeout: a renew still running when the lease's validity ran out (the elector
# gave up on it; acquires have no such deadline).
OUTCOMES: dict[str, tuple[str, ...]] = {
    "acquire": ("held", "refused", "error"),
    "renew": ("held", "refused", "error", "timeout"),
}
OPERATIONS = tuple(OUTCOMES)


@dataclass
class Histogram:
    """Cumulative-on-read bucket counts of one (operation, outcome)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count)`` pairs as Prometheus buckets, ``+Inf`` last."""
        running, out = 0, []
        for bound, n in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclass
class CallStats:
    """Every acquire and renew of one lease by this contender."""

    histograms: dict[tuple[str, str], Histogram] = field(default_factory=lambda: {
        (op, outcome): Histogram() for op, outcomes in OUTCOMES.items() for outcome in outcomes})
    # Wall time of the last acquire or renew that held the lease (0: never).
    last_success_wall: float = 0.0

    def observe(self, operation: str, seconds: float, outcome: str, wall: float) -> None:
        self.histograms[(operation, outcome)].observe(max(seconds, 0.0))
        if outcome == "held":
            self.last_success_wall = wall
