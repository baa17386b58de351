"""The claim rules (docs/design.md), on a fake clock (no sleeping)."""

import asyncio
import math
from datetime import datetime

from sidecar.publish import ClaimEncoder, claim_body
from sidecar.publish.http.longpoll import ServedLease
from sidecar.state import Facts, Leadership, LeaseState
from testkit.support import unix_time
from tests.unit.fakes import FakeClock


def make_state(clock: FakeClock, horizon: float = 0.25) -> LeaseState:
    return LeaseState(lease="default", identity="me", role="all", claim_horizon=horizon,
                      clock=clock)


def test_standby_claims_nothing():
    state = make_state(FakeClock())
    claim = state.claim()
    assert not claim.leader
    assert claim_body(state, claim)["leader"] is False
    assert claim_body(state, claim)["valid_until"] is None


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
    body = claim_body(state, state.claim())
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
    body = claim_body(state, claim)
    assert isinstance(body["valid_until_ms"], int)
    assert body["valid_until_ms"] == math.floor(exact * 1000)
    assert body["valid_until_ms"] / 1000 < exact  # never later than the claim's end
    parsed = unix_time(body["valid_until"])
    assert round(parsed * 1000) == body["valid_until_ms"]
    # Not leading: both are null, never a stale time.
    state.update(holding=False)
    standby = claim_body(state, state.claim())
    assert standby["valid_until"] is None and standby["valid_until_ms"] is None


def test_rfc3339_is_the_floored_millisecond_in_utc_across_seconds():
    """The second's text is cached (issue 20: most of a claim's cost); every
    millisecond must still read as datetime spells it, rounded down."""
    from datetime import UTC

    from sidecar.base.clock import epoch_ms, rfc3339

    for wall in (0.0, -0.0005, 59.9999, 60.0, 1764613948.7931, 1764613949.0004,
                 1764613948.9999, 4102444799.9995):
        ms = epoch_ms(wall)
        assert ms is not None
        expected = datetime.fromtimestamp(ms // 1000, tz=UTC).strftime(
            "%Y-%m-%dT%H:%M:%S") + f".{ms % 1000:03d}Z"
        assert rfc3339(wall) == expected, wall


def test_encoded_is_the_body_as_json_for_every_claim():
    """The bytes of /leader and the leader file are kept as a template around the
    expiry (issue 20): they must stay exactly the JSON of :func:`claim_body`."""
    import json

    clock = FakeClock()
    state = make_state(clock)
    encode = ClaimEncoder(state)
    seen = []
    for step in range(4):
        if step == 2:
            state.update(fencing_token=7, holder="me")  # a new version: a new template
        state.update(holding=True, claim_from=clock.now, valid_until=clock.now + 10)
        clock.advance(0.0013)
        claim = state.claim()
        seen.append(encode(claim))
        assert json.loads(encode(claim)) == claim_body(state, claim)
    assert len(set(seen)) == 4  # each millisecond its own expiry
    state.update(holding=False, holder="other")
    claim = state.claim()
    assert json.loads(encode(claim)) == claim_body(state, claim)
    assert b'"valid_until": null, "valid_until_ms": null' in encode(claim)


# -- Facts.leads_at: the claim rule itself, asked directly at chosen instants ------------

def _term(clock: FakeClock, **changes: object) -> Facts:
    """Holding since ``clock.now``: first claim 0.25 s later, validity 10 s."""
    base = {"holding": True, "claim_from": clock.now + 0.25, "valid_until": clock.now + 10}
    return Facts(**{**base, **changes})  # type: ignore[arg-type]  # the test's overrides are Facts fields


def test_leads_at_from_the_first_claim_up_to_but_not_at_the_end_of_validity():
    clock = FakeClock()
    facts = _term(clock)
    start, end = facts.claim_from, facts.valid_until
    expected = {
        clock.now: False,  # acquired, first-claim wait not over
        start - 1e-9: False,
        start: True,  # the first claim is due exactly at claim_from
        start + 5: True,
        end - 1e-9: True,
        end: False,  # validity ends: monotonic now < valid_until, strictly
        end + 100: False,  # a frozen process that resumes late
    }
    assert {now: facts.leads_at(now) for now in expected} == expected


def test_leads_at_fails_closed_without_the_lease_or_after_unpublishing():
    clock = FakeClock()
    middle = clock.now + 5  # inside [claim_from, valid_until) of _term
    assert _term(clock).leads_at(middle)
    assert not _term(clock, holding=False).leads_at(middle)
    assert not _term(clock, released=True).leads_at(middle)
    assert not Facts().leads_at(middle)  # the facts a state starts with


def test_leads_at_is_what_a_claim_says_and_hands_out_nothing():
    """LeaseState.claim() is leads_at at the clock's now, plus the claim it hands out;
    leads_at alone (the pod label's question on kopf's threads) leaves issued_until."""
    clock = FakeClock()
    state = make_state(clock)
    state.update(holding=True, claim_from=clock.now + 0.25, valid_until=clock.now + 10)
    # Before the first claim, at it, inside, at the end of validity, past it.
    for step in (0.0, 0.25, 4.0, 5.75, 0.1):
        clock.advance(step)
        facts = state.facts
        assert facts.leads_at(clock.now) == state.claim().leader
        issued = state.issued_until
        facts.leads_at(clock.now)
        assert state.issued_until == issued
    state.update(released=True)
    assert not state.facts.leads_at(clock.now) and not state.claim().leader


def test_next_flip_names_the_first_claim_then_the_end_of_validity():
    clock = FakeClock()
    facts = _term(clock)
    assert facts.next_flip(clock.now) == facts.claim_from
    assert facts.next_flip(facts.claim_from) == facts.valid_until
    assert facts.next_flip(facts.valid_until) is None
    assert _term(clock, released=True).next_flip(clock.now) is None
    assert Facts().next_flip(clock.now) is None
    # Just before and after each flip, leads_at says what next_flip promised.
    for flip in (facts.claim_from, facts.valid_until):
        assert facts.leads_at(flip - 1e-9) != facts.leads_at(flip)


# -- the leadership, its ETag and its wait (the long-poll follows these) -------------------------

def test_the_etag_ignores_renews_and_follows_leadership():
    clock = FakeClock()
    state = make_state(clock)
    standby = ServedLease(state).etag(state.claim())
    state.update(holder="other")  # another holder: a different answer
    other = ServedLease(state).etag(state.claim())
    assert other != standby
    state.update(reason="held by other", backend_ok=True)  # a standby's retry
    assert ServedLease(state).etag(state.claim()) == other
    state.update(holding=True, holder="me", claim_from=clock.now + 0.25,
                 valid_until=clock.now + 10, fencing_token=7)
    waiting = ServedLease(state).etag(state.claim())  # holds, cannot claim yet
    assert waiting not in (standby, other)
    clock.advance(0.25)
    leading = ServedLease(state).etag(state.claim())
    assert leading != waiting
    tags = set()
    for _ in range(5):  # renews: new validity, new version, same answer
        clock.advance(1)
        state.update(valid_until=clock.now + 10, fencing_token=7)
        tags.add(ServedLease(state).etag(state.claim()))
    assert tags == {leading}
    state.update(fencing_token=8)  # a new term's token is a new answer
    assert ServedLease(state).etag(state.claim()) != leading
    # A weak tag (the body's bytes change with every claim), lease name inside.
    assert leading.startswith('W/"default-') and leading.endswith('"')


def test_the_etag_is_the_content_not_a_counter():
    """Two states (two runs of the sidecar) giving the same answer have the same tag."""
    clock = FakeClock()
    first, second = make_state(clock), make_state(clock)
    for state in (first, second):
        state.update(holding=True, claim_from=clock.now, valid_until=clock.now + 10,
                     fencing_token=3)
    second.update(valid_until=clock.now + 20)
    assert ServedLease(first).etag(first.claim()) == ServedLease(second).etag(second.claim())


def real_state(horizon: float = 0.25) -> LeaseState:
    return LeaseState(lease="default", identity="me", role="all", claim_horizon=horizon)


def hold(state: LeaseState, valid_for: float, claim_in: float = 0.0) -> Leadership:
    """Make ``state`` a holder whose claim starts in ``claim_in`` seconds and is valid for
    ``valid_for`` seconds from now; return its answer's leadership now."""
    now = state.clock.monotonic()
    state.update(holding=True, holder="me", claim_from=now + claim_in,
                 valid_until=now + valid_for, fencing_token=1)
    return state.leadership(state.claim())


async def _timed_wait(state: LeaseState, tag: Leadership, timeout: float) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await state.wait_for_leadership_change(tag, timeout)
    return loop.time() - started


async def test_renews_do_not_end_a_leadership_wait():
    state = real_state()
    tag = hold(state, valid_for=0.5)

    async def renew() -> None:
        for _ in range(10):
            await asyncio.sleep(0.05)
            state.update(valid_until=state.clock.monotonic() + 0.5)

    renewing = asyncio.ensure_future(renew())
    waited = await _timed_wait(state, tag, 0.6)
    await renewing
    assert waited >= 0.59  # ten renews in that time, none woke the waiter
    assert state.facts.version >= 11


async def test_a_claim_lapsing_without_any_update_ends_the_wait():
    """A renew that hangs until validity runs out changes no fact; the answer changes."""
    state = real_state()
    tag = hold(state, valid_for=0.15)
    version = state.facts.version
    waited = await _timed_wait(state, tag, 5)
    assert state.facts.version == version  # nobody updated anything
    assert 0.14 <= waited < 0.5
    assert not state.claim().leader


async def test_the_first_claim_of_a_term_ends_the_wait():
    """One horizon after the acquire the answer becomes "leader" with no update."""
    state = real_state()
    tag = hold(state, valid_for=5, claim_in=0.2)
    assert not state.claim().leader
    waited = await _timed_wait(state, tag, 5)
    assert 0.19 <= waited < 0.5
    assert state.claim().leader


async def test_a_step_down_ends_the_wait_at_once():
    state = real_state()
    tag = hold(state, valid_for=30)
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, lambda: state.update(released=True))
    waited = await _timed_wait(state, tag, 5)
    assert 0.09 <= waited < 0.3
    # A tag that is already stale returns at once; so does a zero timeout.
    assert await _timed_wait(state, tag, 5) < 0.01
    assert await _timed_wait(state, state.leadership(state.claim()), 0) < 0.01
