"""Judges a recorded run: safety (no overlapping claims), liveness (a leader soon after
every fault), fencing (tokens only grow across leaders).

Definitions (all times on the recorder's one clock):

- A sidecar's *claim time* is the union of its observed claim spans (HTTP and file).
- *Overlap*: a moment claimed by two different identities. An overlap is a safety
  violation unless the backend documents a window for the fault it follows (only the
  advisory lock does, for a session the server or the network ended) and it stays
  within that window; every overlap is counted in the table either way.
- *Gap*: a moment between ``begin`` and ``end`` claimed by nobody. A gap is explained
  by a fault ``f`` with ``f.at < gap end <= f.at + f.bound``; an unexplained gap is a
  liveness violation. Faults are paced (the next one waits for a leader), so a gap can
  only be explained by the fault(s) that caused it or by one shortly before.
- A gap is attributed (for the per-fault table) to the latest fault that hit the leader
  (or the backend) with ``at <= gap start <= at + bound``; else to the latest fault
  before it. *Takeover* of a leader-hitting fault = end of its last attributed gap
  minus its injection time; a leader hit without a gap (e.g. small latency) has none.
- A gap with no file read inside it is *blind* (the recorder itself stalled; nothing
  was seen, so nothing is judged). A watched gap no fault explains is a *blip* (a
  starved leader missing its file refresh by a few ms) if it is shorter than
  ``ambient`` (one lease duration), else a liveness violation: a healthy system never
  goes a lease duration without a leader.
- *Fencing*: ordering each identity's terms (runs of one token) by start, a token never
  decreases, and a change of identity brings a strictly larger token.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from testkit.chaos.faults import Fault
from testkit.chaos.recorder import Span


@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    who: tuple[str, ...] = ()
    fault: int | None = None  # index of the attributed fault

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass
class Row:
    """One line of the table: one backend and fault kind."""

    kind: str
    faults: int = 0
    leader_hits: int = 0
    overlaps: int = 0
    max_overlap: float = 0.0
    max_gap: float = 0.0
    bound: float = 0.0
    takeovers: list[float] = field(default_factory=list)
    liveness_violations: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "faults": self.faults, "leader_hits": self.leader_hits,
                "overlaps": self.overlaps, "max_overlap": self.max_overlap,
                "max_gap": self.max_gap, "bound": self.bound,
                "takeover_p50": percentile(self.takeovers, 50),
                "takeover_p99": percentile(self.takeovers, 99),
                "takeovers": self.takeovers,
                "liveness_violations": self.liveness_violations}


@dataclass
class Verdict:
    rows: dict[str, Row]
    overlaps: list[Interval]
    gaps: list[Interval]
    violations: list[str]
    claimed_fraction: float
    blind: list[Interval] = field(default_factory=list)
    blips: list[Interval] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def percentile(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(pct) - 1] \
        if pct < 100 else max(values)


def claim_time(spans: list[Span]) -> dict[str, list[Interval]]:
    """Per identity, its spans merged into disjoint intervals."""
    by_who: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        by_who[span.identity].append(span)
    merged: dict[str, list[Interval]] = {}
    for who, own in by_who.items():
        own.sort(key=lambda s: s.start)
        out: list[Interval] = []
        for span in own:
            if out and span.start <= out[-1].end:
                if span.end > out[-1].end:
                    out[-1] = Interval(out[-1].start, span.end, (who,))
            else:
                out.append(Interval(span.start, span.end, (who,)))
        merged[who] = out
    return merged


def find_overlaps(merged: dict[str, list[Interval]]) -> list[Interval]:
    """Moments claimed by two or more identities (sweep over start/end events)."""
    events: list[tuple[float, int, str]] = []
    for who, intervals in merged.items():
        for iv in intervals:
            # At equal times an end (0) sorts before a start (1): touching is no overlap.
            events += [(iv.start, 1, who), (iv.end, 0, who)]
    events.sort()
    active: set[str] = set()
    out: list[Interval] = []
    since = 0.0
    for time, is_start, who in events:
        if len(active) >= 2 and time > since:
            segment = Interval(since, time, tuple(sorted(active)))
            if out and out[-1].end == since and out[-1].who == segment.who:
                segment = Interval(out.pop().start, time, segment.who)
            out.append(segment)
        if is_start:
            active.add(who)
        else:
            active.discard(who)
        since = time
    return out


def find_gaps(merged: dict[str, list[Interval]], begin: float, end: float) -> list[Interval]:
    everything = sorted((iv for ivs in merged.values() for iv in ivs), key=lambda i: i.start)
    gaps: list[Interval] = []
    covered_to = begin
    for iv in everything:
        if iv.start > covered_to and iv.start > begin:
            gaps.append(Interval(covered_to, min(iv.start, end)))
        covered_to = max(covered_to, iv.end)
        if covered_to >= end:
            break
    if covered_to < end:
        gaps.append(Interval(covered_to, end))
    return [g for g in gaps if g.end > g.start]


def fencing_violations(spans: list[Span]) -> list[str]:
    problems: list[str] = []
    if any(span.token is None for span in spans):
        problems.append("fencing: a leader claim carried no fencing token")
    term: tuple[str, int] | None = None  # the current run of one identity and token
    best: tuple[int, str] | None = None  # the largest token seen so far, and its owner
    for span in sorted((s for s in spans if s.token is not None), key=lambda s: s.start):
        token = int(span.token)  # type: ignore[arg-type]  # filtered to tokens above
        if (span.identity, token) == term:
            continue
        term = (span.identity, token)
        if best is not None and (token < best[0] or (token == best[0]
                                                     and span.identity != best[1])):
            problems.append(f"fencing: {span.identity} led with token {token} at "
                            f"{span.start:.3f} after {best[1]} had token {best[0]}")
        elif best is None or token > best[0]:
            best = (token, span.identity)
    return problems


def attribute(gap_start: float, faults: list[Fault], times: list[float]) -> Fault | None:
    i = bisect.bisect_right(times, gap_start)
    for fault in reversed(faults[max(0, i - 20):i]):
        if fault.leader_hit and gap_start <= fault.at + fault.bound:
            return fault
    return faults[i - 1] if i else None


def watched(gap: Interval, reads: Sequence[float]) -> bool:
    """Did the recorder read the leader files at some moment inside the gap?"""
    i = bisect.bisect_right(reads, gap.start)
    return i < len(reads) and reads[i] < gap.end


def check(spans: list[Span], faults: list[Fault], begin: float, end: float,
          reads: Sequence[float], ambient: float) -> Verdict:
    faults = sorted(faults, key=lambda f: f.at)
    times = [f.at for f in faults]
    merged = claim_time(spans)
    rows: dict[str, Row] = {}
    for fault in faults:
        row = rows.setdefault(fault.kind, Row(fault.kind))
        row.faults += 1
        row.leader_hits += fault.leader_hit
        row.bound = max(row.bound, fault.bound)
    violations: list[str] = []

    overlaps = []
    for ov in find_overlaps(merged):
        blamed = attribute(ov.start, faults, times)
        ov = Interval(ov.start, ov.end, ov.who, blamed.index if blamed else None)
        overlaps.append(ov)
        row = rows.setdefault(blamed.kind if blamed else "no fault", Row("no fault"))
        row.overlaps += 1
        row.max_overlap = max(row.max_overlap, ov.length)
        if blamed is not None and ov.length <= blamed.overlap_bound:
            continue  # within the window the backend documents for this fault
        violations.append(f"safety: {' and '.join(ov.who)} both claimed leadership for "
                          f"{ov.length * 1000:.1f} ms from {ov.start:.3f} "
                          f"(after fault #{ov.fault})")

    gaps, blind, blips = [], [], []
    takeover: dict[int, float] = {}
    for gap in find_gaps(merged, begin, end):
        if not watched(gap, reads):
            blind.append(gap)
            continue
        blamed = attribute(gap.start, faults, times)
        gap = Interval(gap.start, gap.end, (), blamed.index if blamed else None)
        gaps.append(gap)
        row = rows.setdefault(blamed.kind if blamed else "no fault", Row("no fault"))
        row.max_gap = max(row.max_gap, gap.length)
        if blamed is not None and blamed.leader_hit:
            takeover[blamed.index] = max(takeover.get(blamed.index, 0.0), gap.end - blamed.at)
        i = bisect.bisect_left(times, gap.end)
        if any(f.at + f.bound >= gap.end for f in faults[max(0, i - 20):i]):
            continue
        if gap.length <= ambient:
            blips.append(gap)
        else:
            row.liveness_violations += 1
            violations.append(f"liveness: no leader for {gap.length:.3f} s from "
                              f"{gap.start:.3f}, beyond every recent fault's bound "
                              f"(attributed to #{gap.fault})")
    for fault in faults:
        if fault.index in takeover:
            rows[fault.kind].takeovers.append(round(takeover[fault.index], 4))
    violations += fencing_violations(spans)
    claimed = sum(iv.length for ivs in merged.values() for iv in ivs
                  if begin <= iv.start <= end)
    return Verdict(rows, overlaps, gaps, violations,
                   claimed_fraction=min(1.0, claimed / max(end - begin, 1e-9)),
                   blind=blind, blips=blips)
