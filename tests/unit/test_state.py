"""The claim rules (docs/design.md), on a fake clock (no sleeping)."""

import math
from datetime import datetime

from sidecar.state import LeaseState
from tests.unit.fakes import FakeClock


def make_state(clock: FakeClock, horizon: float = 0.25) -> LeaseState:
    return LeaseState(lease="default", identity="me", role="all", claim_horizon=horizon,
                      clock=clock)


def test_standby_claims_nothing():
    state = make_state(FakeClock())
    claim = state.claim()
    assert not claim.leader
    assert state.body(claim)["leader"] is False
    assert state.body(claim)["valid_until"] is None


def test_claim_is_capped_by_the_horizon_and_the_lease():
    clock = FakeClock()
    state = make_state(clock)
    state.update(holding=True, claim_from=clock.now, valid_until=clock.now + 10)
    claim = state.claim()
    assert claim.leader
    assert claim.valid_until == clock.now + 0.25
    clock.advance(9.9)
    assert state.claim().valid_until == clock.now + 0.1  # the lease ends first


def test_no_claim_after_validity_even_if_nobody_updated_the_state():
    """A frozen process resumes: the facts still say holding, the clock says no."""
    clock = FakeClock()
    state = make_state(clock)
    state.update(holding=True, claim_from=clock.now, valid_until=clock.now + 10)
    clock.advance(10.0)
    assert not state.claim().leader
    assert state.facts.holding


def test_no_claim_before_claim_from():
    clock = FakeClock()
    state = make_state(clock)
    state.update(holding=True, claim_from=clock.now + 0.25, valid_until=clock.now + 10)
    assert not state.claim().leader
    clock.advance(0.25)
    assert state.claim().leader


def test_released_state_stops_claiming_while_still_holding():
    clock = FakeClock()
    state = make_state(clock)
    state.update(holding=True, claim_from=clock.now, valid_until=clock.now + 10)
    assert state.claim().leader
    state.update(released=True)
    assert not state.claim().leader


def test_versions_and_transitions():
    clock = FakeClock()
    state = make_state(clock)
    first = state.facts.version
    state.update("acquired", holding=True, fencing_token=3)
    assert state.facts.version == first + 1
    assert state.transitions[-1]["event"] == "acquired"
    assert state.transitions[-1]["fencing_token"] == 3
    assert state.event_counts == {"acquired": 1}


def test_body_times_are_rfc3339_utc():
    clock = FakeClock()
    state = make_state(clock)
    state.update(holding=True, claim_from=clock.now, valid_until=clock.now + 10,
                 fencing_token=5)
    body = state.body(state.claim())
    assert body["valid_until"].endswith("Z")
    assert body["since"].endswith("Z")
    assert body["fencing_token"] == 5
    assert body["holder"] == "me"
    assert set(body) == {"leader", "lease", "identity", "holder", "fencing_token", "since",
                         "valid_until", "valid_until_ms", "role"}


def test_valid_until_ms_is_the_same_instant_rounded_down():
    clock = FakeClock()
    state = make_state(clock)
    state.update(holding=True, claim_from=clock.now, valid_until=clock.now + 10)
    clock.advance(0.0007)  # the claim ends 0.7 ms into a millisecond
    claim = state.claim()
    exact = state.to_wall(claim.valid_until)
    assert exact is not None
    body = state.body(claim)
    assert isinstance(body["valid_until_ms"], int)
    assert body["valid_until_ms"] == math.floor(exact * 1000)
    assert body["valid_until_ms"] / 1000 < exact  # never later than the claim's end
    parsed = datetime.fromisoformat(body["valid_until"]).timestamp()
    assert round(parsed * 1000) == body["valid_until_ms"]
    # Not leading: both are null, never a stale time.
    state.update(holding=False)
    standby = state.body(state.claim())
    assert standby["valid_until"] is None and standby["valid_until_ms"] is None
