"""What a run with ``failover`` faults is judged by, beyond the checker's rules: fencing
tokens per term (none handed out twice, each new one larger than every earlier one) and
the leaderless gap after each promotion."""

from __future__ import annotations

from sidecar.lease.pg_timeline import timeline_of
from testkit.chaos.harness import Result
from testkit.chaos.recorder import Span


def token_problems(spans: list[Span]) -> list[str]:
    """Terms (identity, token) in order of their first claim: every new term's token is
    larger than every earlier term's, so none is handed out twice."""
    problems = []
    seen: dict[int, str] = {}
    best: int | None = None
    for span in sorted(spans, key=lambda s: s.start):
        if span.token is None:
            problems.append(f"{span.identity} claimed without a token at {span.start:.3f}")
            continue
        token = int(span.token)
        if token in seen:
            if seen[token] != span.identity:
                problems.append(f"token {token} handed to {seen[token]} and {span.identity}")
            continue
        if best is not None and token < best:
            problems.append(f"{span.identity} got token {token} after token {best}")
        seen[token] = span.identity
        best = token if best is None else max(best, token)
    return problems


def gaps(result: Result) -> list[dict[str, float]]:
    """Per failover: seconds without any claim before the first claim on the new
    timeline, and from the promotion to that claim."""
    out = []
    spans = sorted(result.recorder.spans, key=lambda s: s.start)
    for fault in result.faults:
        if fault.kind != "failover" or "timeline" not in fault.params:
            continue
        timeline = fault.params["timeline"]
        firsts = [s.start for s in spans
                  if s.token is not None and timeline_of(int(s.token)) == timeline]
        if not firsts:
            continue
        first = min(firsts)
        before = [s.end for s in spans if s.start < first]
        out.append({"leaderless": max(0.0, first - max(before, default=first)),
                    "promotion_to_claim": first - fault.params["promoted_at"],
                    "kill_to_claim": first - fault.params["killed_at"],
                    "handovers_during_lag": fault.params.get("handed_over", 0)})
    return out
