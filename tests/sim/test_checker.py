"""The simulator's own verdicts: what its checkers must and must not call a violation."""

from __future__ import annotations

from sidecar.lease import pg_timeline
from testkit.sim.backends import SETUPS
from testkit.sim.scenario import Run


def test_a_cluster_whose_tokens_are_used_up_has_no_leader_and_no_violation() -> None:
    """The simulator, not the sidecar: a long run (``--backend postgres --seed 7 --faults
    1000000``) took the cluster past 2,048 timelines, where every sidecar refuses to hold
    by design (a token would pass 2^53), and the liveness check called the missing leader
    a violation. The quiet phases skip it while the cluster allows no leader; the safety
    checks stay. Here the era table says so from the start."""
    sim = Run("postgres", 1, 40, SETUPS["postgres"])
    cluster = sim.setup.models["cluster"]
    assert cluster.tokens_left()
    assert cluster.server is not None
    cluster.server.data.tables[pg_timeline.ERA_TABLE]["base"] = pg_timeline.TIMELINE_LIMIT
    assert not cluster.tokens_left()
    result = sim.execute()
    assert result.faults >= 40
    assert result.verdict.terms == 0  # nobody claimed
    assert result.verdict.violations == []
