"""The elector's rules with a scripted lease and a fake clock.

The lease is an in-memory stand-in (tests/unit/fakes.py) so the timing rules can be
checked exactly; the real backends are exercised by the integration tests.
"""

import asyncio
import contextlib
import itertools
import logging

import pytest

from sidecar.base.errors import BackendError
from sidecar.elector import Elector
from sidecar.lease import Grant
from sidecar.settings import Timing
from sidecar.state import LeaseState
from tests.unit.fakes import FakeClock, FakeLease, RecordingPublisher

FAST = Timing(lease_duration=1.0, renew_interval=0.01, renew_deadline=0.5,
              safety_margin=0.1, claim_horizon=0.05)


def make(clock: FakeClock, lease: FakeLease, sink=None, timing: Timing = FAST):
    state = LeaseState(lease="default", identity="me", role="all",
                       claim_horizon=timing.claim_horizon, clock=clock)
    publisher = RecordingPublisher(sink=sink, clock=clock)
    return Elector(lease, state, timing, "me", [publisher]), state, publisher


async def claiming(clock: FakeClock, lease: FakeLease, sink=None):
    """``make``'s elector, state and publisher once the elector has acquired ``lease``
    and a claim horizon has passed: a leader whose claims are out."""
    elector, state, publisher = make(clock, lease, sink=sink)
    await elector._acquire_once()
    clock.advance(FAST.claim_horizon)
    assert state.claim().leader
    return elector, state, publisher


async def until(predicate, timeout: float = 2.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout)


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_validity_counts_from_the_send_time():
    clock = FakeClock()
    lease = FakeLease(clock, round_trip=3.0, valid_for=10.0)
    elector, state, _ = make(clock, lease)
    await elector._acquire_once()
    sent = lease.calls[0][1]
    replied = sent + 3.0
    assert state.facts.holding
    assert state.facts.valid_until == sent + 10.0  # not reply time + 10
    # ...while the first claim waits one horizon from the reply: the acquire may have
    # waited inside the server for the previous holder's release.
    assert state.facts.claim_from == replied + FAST.claim_horizon
    assert state.facts.fencing_token == 7


async def drive(clock: FakeClock, task: asyncio.Task, step: float = 0.005,
                limit: float = 2.0, until=None) -> None:
    """Move the fake clock in small steps while ``task`` runs (its sleeps are real and
    short; what it waits for is fake time), until it ends or ``until()`` holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not task.done() and not (until and until()):
        assert loop.time() < deadline, "the task did not finish"
        clock.advance(step)
        await asyncio.sleep(0.001)
    if task.done():
        await task
    else:
        await stop(task)


async def test_unpublish_then_release():
    clock = FakeClock()
    sink: list[tuple[str, float]] = []
    lease = FakeLease(clock)
    lease.calls = sink  # one timeline for publisher and lease
    elector, state, _ = await claiming(clock, lease, sink=sink)
    await drive(clock, asyncio.create_task(elector.shutdown()))
    order = [what for what, _ in sink]
    assert order.index("unpublish") < order.index("release")
    assert not state.facts.holding
    assert not state.claim().leader


@pytest.mark.parametrize("how", ["shutdown", "release request"])
async def test_the_release_waits_until_the_last_claim_handed_out_has_expired(how):
    """A next holder that does not wait (client-go) must not overlap our last claim."""
    clock = FakeClock()
    lease = FakeLease(clock)
    elector, state, _ = make(clock, lease)
    await elector._acquire_once()
    clock.advance(FAST.claim_horizon)
    first = state.claim()
    clock.advance(FAST.claim_horizon / 2)
    last = state.claim()  # e.g. an HTTP client asked just before SIGTERM
    assert first.leader and last.leader and last.valid_until > first.valid_until
    unpublished_at = clock.now
    if how == "shutdown":
        task = asyncio.create_task(elector.shutdown())
    else:
        elector.request_release()
        task = asyncio.create_task(elector._renew_once())  # then sits out a lease
    await drive(clock, task, step=0.001, until=lambda: not state.facts.holding)
    released_at = [at for what, at in lease.calls if what == "release"]
    assert len(released_at) == 1
    assert released_at[0] >= last.valid_until  # never while our claim may be acted on
    assert released_at[0] <= last.valid_until + 0.01  # ...and not much later either
    assert last.valid_until <= unpublished_at + FAST.claim_horizon
    assert not state.claim().leader and not state.facts.holding


async def test_the_release_never_waits_past_the_lease_validity():
    clock = FakeClock()
    lease = FakeLease(clock, valid_for=FAST.claim_horizon * 1.5)
    elector, state, _ = make(clock, lease)
    await elector._acquire_once()
    clock.advance(FAST.claim_horizon * 1.2)
    claim = state.claim()
    assert claim.leader and claim.valid_until == state.facts.valid_until  # cut by validity
    await drive(clock, asyncio.create_task(elector.shutdown()), step=0.001)
    released_at = next(at for what, at in lease.calls if what == "release")
    assert claim.valid_until <= released_at <= claim.valid_until + 0.01


async def test_no_claim_outstanding_means_no_wait_before_the_release():
    """Nobody asked during the last horizon (or validity already ran out): release now."""
    clock = FakeClock()
    lease = FakeLease(clock)
    elector, _, _ = await claiming(clock, lease)
    clock.advance(FAST.claim_horizon)  # that claim has just expired
    stepped_down_at = clock.now
    await asyncio.wait_for(elector.shutdown(), 1.0)  # the fake clock stands still
    assert [at for what, at in lease.calls if what == "release"] == [stepped_down_at]


async def test_a_lost_lease_is_not_released_and_not_waited_for():
    clock = FakeClock()
    lease = FakeLease(clock)
    elector, state, _ = await claiming(clock, lease)
    lease.grant = False
    await asyncio.wait_for(elector._renew_once(), 1.0)  # the fake clock stands still
    assert not state.facts.holding
    assert "release" not in [what for what, _ in lease.calls]


async def test_a_lost_renew_steps_down_without_releasing():
    clock = FakeClock()
    lease = FakeLease(clock)
    elector, state, _ = make(clock, lease)
    await elector._acquire_once()
    lease.grant = False
    await elector._renew_once()
    assert not state.facts.holding
    assert "release" not in [what for what, _ in lease.calls]
    assert state.transitions[-1]["event"] == "lost"


async def test_validity_running_out_steps_down_even_when_renews_error():
    clock = FakeClock()
    lease = FakeLease(clock, valid_for=1.0)
    elector, state, _ = make(clock, lease)
    await elector._acquire_once()
    lease.fail = True
    await elector._renew_once()  # fails, but time is left: still holding
    assert state.facts.holding
    clock.advance(1.0)
    assert not state.claim().leader  # fail closed before the elector even runs
    await elector._renew_once()
    assert not state.facts.holding


async def test_first_claim_waits_one_horizon_after_acquiring():
    """The previous holder's last claim may run one horizon past its release."""
    clock = FakeClock()
    lease = FakeLease(clock)
    elector, state, publisher = make(clock, lease)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await elector._acquire_once()
    assert loop.time() - started >= FAST.claim_horizon * 0.9  # publishers told after it
    assert publisher.events
    assert state.facts.holding
    assert state.facts.claim_from == clock.now + FAST.claim_horizon  # reply time + horizon
    assert not state.claim().leader  # fake time has not moved past claim_from
    clock.advance(FAST.claim_horizon)
    assert state.claim().leader


async def test_unreachable_backend_logs_once_per_change(caplog):
    clock = FakeClock()
    lease = FakeLease(clock, fail=True)
    elector, state, _ = make(clock, lease)
    caplog.set_level(logging.INFO, logger="sidecar.elector")
    task = asyncio.create_task(elector.run())
    await until(lambda: len(lease.calls) >= 4)
    assert not state.facts.backend_ok
    assert not state.claim().leader
    lease.fail = False
    await until(lambda: state.facts.holding)
    await stop(task)
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("backend unreachable") == 1
    assert messages.count("backend reachable again") == 1
    (down,) = [r for r in caplog.records if r.getMessage() == "backend unreachable"]
    (back,) = [r for r in caplog.records if r.getMessage() == "backend reachable again"]
    assert back.cause == down.error  # the line saying it is back names what it was
    assert back.unreachable_for_s >= 0


class WatchedFailingLease(FakeLease):
    """Fails every call; like a Kubernetes watch, ``wait_for_change`` returns only for a
    change made after it was called."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock, fail=True)
        self._changed = asyncio.Event()

    def change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)


async def test_a_change_during_the_first_renew_interval_of_a_backoff_ends_it():
    """Backing off after failures, the standby sleeps one renew interval in full, but a
    change its watch shows in that interval still ends the backoff when it is over (the
    CI run that found this: a Lease created in that interval was seen 3 s later)."""
    timing = Timing(lease_duration=3.0, renew_interval=0.3, renew_deadline=1.5,
                    safety_margin=0.1, claim_horizon=0.05)
    clock = FakeClock()
    lease = WatchedFailingLease(clock)
    elector, _, _ = make(clock, lease, timing=timing)
    elector._failures = 8  # backed off to the lease duration: 2.4 to 3.6 s
    loop = asyncio.get_running_loop()
    started = loop.time()
    loop.call_later(0.05, lease.change)
    await elector._acquire_once()
    took = loop.time() - started
    assert timing.renew_interval * 0.8 <= took < 1.5, took  # the floor, not the backoff


async def test_standby_reports_the_holder():
    clock = FakeClock()
    lease = FakeLease(clock, grant=False)
    elector, state, _ = make(clock, lease)
    task = asyncio.create_task(elector.run())
    await until(lambda: state.facts.holder == "someone-else")
    await stop(task)
    assert not state.claim().leader


async def test_release_request_steps_down_and_sits_out():
    clock = FakeClock()
    lease = FakeLease(clock)
    elector, state, _ = make(clock, lease)
    task = asyncio.create_task(elector.run())
    await until(lambda: state.facts.holding)
    elector.request_release()
    await until(lambda: not state.facts.holding)
    acquires = sum(1 for what, _ in lease.calls if what == "acquire")
    await asyncio.sleep(0.1)  # far less than the one-lease-duration sit-out
    await stop(task)
    assert sum(1 for what, _ in lease.calls if what == "acquire") == acquires
    assert ("release" in [what for what, _ in lease.calls])


class GatedRenew(FakeLease):
    """Renews wait for the test to open a gate (a renew in flight)."""

    gate: asyncio.Event | None = None
    renewing: asyncio.Event | None = None

    async def try_renew(self) -> Grant:
        assert self.gate is not None and self.renewing is not None
        self.renewing.set()
        await self.gate.wait()
        return await super().try_renew()


async def test_a_release_asked_during_a_renew_is_not_held_back_a_renew_interval():
    """Before: the next sleep cleared the wake-up, so the step-down waited a whole renew
    interval (2 s by default) after the renew in flight came back."""
    clock = FakeClock()
    lease = GatedRenew(clock)
    lease.gate, lease.renewing = asyncio.Event(), asyncio.Event()
    slow = Timing(lease_duration=30.0, renew_interval=5.0, renew_deadline=20.0,
                  safety_margin=1.0, claim_horizon=0.05)
    state = LeaseState(lease="default", identity="me", role="all",
                       claim_horizon=slow.claim_horizon, clock=clock)
    elector = Elector(lease, state, slow, "me")
    await elector._acquire_once()
    # The first renew's sleep is real time (5 s): cut it short with a wake-up.
    renew = asyncio.create_task(elector._renew_once())
    await asyncio.sleep(0.01)
    elector._wake.set()
    await asyncio.wait_for(lease.renewing.wait(), 1)
    assert elector.request_release("work stalled: test") is True
    lease.gate.set()
    await asyncio.wait_for(renew, 1)
    assert state.facts.holding  # the renew in flight succeeded
    after = asyncio.create_task(elector._renew_once())  # steps down, then sits out 30 s
    await until(lambda: not state.facts.holding, timeout=1)  # at once, not after 5 s
    await stop(after)
    assert "release" in [what for what, _ in lease.calls]
    assert state.facts.reason == "work stalled: test"
    assert state.transitions[-1]["event"] == "released"
    assert state.transitions[-1]["reason"] == "work stalled: test"


async def test_release_request_to_a_standby_is_refused_and_forgotten():
    """Before: remembered, and the next term ended right after it began."""
    clock = FakeClock()
    lease = FakeLease(clock, grant=False)
    elector, state, _ = make(clock, lease)
    assert elector.request_release() is False
    lease.grant = True
    await elector._acquire_once()
    assert state.facts.holding
    await elector._renew_once()
    assert state.facts.holding and "release" not in [what for what, _ in lease.calls]


async def test_a_release_asked_of_an_ended_term_does_not_end_the_next():
    """A request accepted while holding, then the lease lost before the loop acted on it
    (the renew in flight came back refused): the next term must not inherit it."""
    clock = FakeClock()
    lease = FakeLease(clock)
    elector, state, _ = make(clock, lease)
    await elector._acquire_once()
    assert elector.request_release() is True
    await elector._step_down("lost lease: renew refused", release=False)
    calls = len(lease.calls)
    await elector._acquire_once()
    await elector._renew_once()
    assert state.facts.holding
    assert "release" not in [what for what, _ in lease.calls[calls:]]


@pytest.mark.parametrize("spread", [0.1, 0.2])
def test_jitter_stays_in_bounds(spread):
    from sidecar.elector import jittered

    values = [jittered(2.0, spread) for _ in range(1000)]
    assert min(values) >= 2.0 * (1 - spread)
    assert max(values) <= 2.0 * (1 + spread)


async def test_a_lost_event_wakes_the_holder_at_once():
    clock = FakeClock()
    lease = FakeLease(clock)
    lease.lost = asyncio.Event()
    slow = Timing(lease_duration=60.0, renew_interval=30.0, renew_deadline=40.0,
                  safety_margin=1.0, claim_horizon=0.01)
    state = LeaseState(lease="default", identity="me", role="all", claim_horizon=0.01,
                       clock=clock)
    elector = Elector(lease, state, slow, "me", [])
    task = asyncio.create_task(elector.run())
    await until(lambda: state.facts.holding)
    lease.grant = False
    lease.lost.set()
    await until(lambda: not state.facts.holding, timeout=2.0)  # not after 30 s
    await stop(task)


async def test_stop_ends_the_loop_even_without_a_cancel():
    """Python 3.11's wait_for can swallow a cancel; the stop flag still ends the loop."""
    clock = FakeClock()
    lease = FakeLease(clock)
    elector, state, _ = make(clock, lease)
    task = asyncio.create_task(elector.run())
    await until(lambda: state.facts.holding)
    elector.stop()
    await asyncio.wait_for(task, 2.0)
    assert not state.facts.holding
    assert "release" in [what for what, _ in lease.calls]


async def test_a_backend_claim_delay_longer_than_the_horizon_is_honoured():
    """After a server restart the previous holder may claim up to its renew deadline."""
    clock = FakeClock()
    lease = FakeLease(clock)

    async def restarted() -> Grant:
        lease.calls.append(("acquire", clock.now))
        return Grant(held=True, valid_for=10.0, fencing_token=8, claim_delay=0.06)

    lease.try_acquire = restarted
    elector, state, _ = make(clock, lease)
    await drive(clock, asyncio.create_task(elector._acquire_once()))
    replied = lease.calls[0][1]  # the fake acquire takes no time
    assert state.facts.claim_from == pytest.approx(replied + 0.06)  # not just the horizon


@pytest.mark.parametrize(("claim_delay", "first_claim_after"), [(0.0, 0.0), (0.02, 0.02)])
async def test_a_recorded_release_spares_the_horizon_but_not_the_claim_delay(
        claim_delay, first_claim_after):
    """The backend proved the previous term's claims had run out: no horizon wait, yet
    a backend's own delay (a promotion) still counts."""
    clock = FakeClock()
    lease = FakeLease(clock)

    async def after_release() -> Grant:
        lease.calls.append(("acquire", clock.now))
        return Grant(held=True, valid_for=10.0, fencing_token=8, claim_delay=claim_delay,
                     previous_claims_ended=True)

    lease.try_acquire = after_release
    elector, state, publisher = make(clock, lease)
    await drive(clock, asyncio.create_task(elector._acquire_once()))
    replied = lease.calls[0][1]
    assert state.facts.claim_from == pytest.approx(replied + first_claim_after)
    assert first_claim_after < FAST.claim_horizon
    assert publisher.events


async def test_only_a_term_that_reached_its_first_claim_releases_on_record():
    """A term stopped during its horizon wait cannot vouch for the claims of the term
    before it: its release writes no record. One that claimed, released, does."""
    clock = FakeClock()
    lease = FakeLease(clock)
    elector, state, _ = make(clock, lease)
    await elector._acquire_once()
    assert state.facts.holding and not state.claim().leader  # still waiting its horizon
    await drive(clock, asyncio.create_task(elector.shutdown()))
    assert lease.records == [False]

    elector, state, _ = await claiming(clock, lease)
    await drive(clock, asyncio.create_task(elector.shutdown()))
    assert lease.records == [False, True]


async def test_a_release_waits_for_the_work_to_stop_after_the_claims():
    """``exec``: the command may outlive the last claim by its grace; the release (and
    the record in it) comes only once it has stopped."""
    clock = FakeClock()
    lease = FakeLease(clock)
    stopped = asyncio.Event()
    state = LeaseState(lease="default", identity="me", role="all",
                       claim_horizon=FAST.claim_horizon, clock=clock)
    elector = Elector(lease, state, FAST, "me", [], work_stopped=stopped.wait)
    await elector._acquire_once()
    clock.advance(FAST.claim_horizon)
    assert state.claim().leader
    elector.request_release()
    task = asyncio.create_task(elector._renew_once())
    clock.advance(1.0)  # every claim has long run out
    await asyncio.sleep(0.1)
    assert "release" not in [what for what, _ in lease.calls]
    stopped.set()
    await until(lambda: "release" in [what for what, _ in lease.calls])
    await stop(task)


async def test_a_claim_delay_longer_than_the_validity_keeps_the_term_alive():
    """After a server restart the first acquirer waits out the old holder's renew
    deadline; before, it sent no renew meanwhile and its term ran out of validity
    ("validity ran out") right before its first claim, costing every restart a second
    hand-over. Now it renews every renew interval while it waits."""
    clock = FakeClock()
    lease = FakeLease(clock, valid_for=0.3, token=8)  # validity < the claim delay

    async def restarted() -> Grant:
        lease.calls.append(("acquire", clock.now))
        return Grant(held=True, valid_for=0.3, fencing_token=8, claim_delay=1.0)

    lease.try_acquire = restarted
    elector, state, publisher = make(clock, lease)
    acquired = clock.now
    task = asyncio.create_task(elector._acquire_once())
    await drive(clock, task, step=0.002, limit=5.0)
    assert state.facts.holding, state.facts.reason
    assert state.facts.fencing_token == 8
    renews = [at for what, at in lease.calls if what == "renew"]
    assert renews and renews[0] - acquired < 0.3  # renewed before the validity ran out
    assert all(b - a < 0.3 for a, b in itertools.pairwise(renews))
    assert len(renews) >= 3  # the whole delay, not just its start
    assert publisher.events  # told once the delay was over
    assert state.facts.claim_from >= acquired + 1.0
    clock.advance(max(0.0, state.facts.claim_from - clock.now))
    assert state.claim().leader


async def test_a_cooperative_end_of_term_unpublishes_waits_and_releases():
    """Grant(held=False, release=True) (Kubernetes' preferredHolder): stepped down as on
    SIGTERM — the release comes after the last claim handed out has run out."""
    clock = FakeClock()
    lease = FakeLease(clock)
    elector, state, publisher = make(clock, lease)
    await drive(clock, asyncio.create_task(elector._acquire_once()))
    clock.advance(FAST.claim_horizon)
    assert state.claim().leader  # hands out a claim valid one horizon ahead
    handed_out_until = state.issued_until

    async def end_of_term() -> Grant:
        return Grant(held=False, release=True, reason="preferredHolder set to pod-b")

    lease.try_renew = end_of_term
    task = asyncio.create_task(elector._renew_once())
    await drive(clock, task)
    assert not state.facts.holding
    released = [at for what, at in lease.calls if what == "release"]
    assert released and released[0] >= handed_out_until
    assert state.transitions[-1]["event"] == "released"
    assert publisher.events[-1] == ("changed", False)


class SlowReplyLease(FakeLease):
    """Its writes commit at once, but the reply of the ``slow`` call ("acquire" or
    "renew") waits for ``reply``: the window in which a cancel loses a committed write.
    Every write draws a new version of the store's row; the lease knows a version only
    from a reply, and a release ends the row only when it names the store's version."""

    def __init__(self, clock: FakeClock, slow: str) -> None:
        super().__init__(clock)
        self.slow = slow
        self.reply = asyncio.Event()
        self.stored = 0  # the store's version
        self.known = 0  # the version this lease last heard of
        self.released: list[bool] = []  # per release: did it name the store's version?

    async def _call(self, what: str) -> Grant:
        grant = await super()._call(what)
        self.stored += 1
        if what == self.slow:
            await self.reply.wait()
        self.known = self.stored
        return grant

    async def release(self, record: bool = False) -> None:
        await super().release(record)
        self.released.append(self.known == self.stored)


@pytest.mark.parametrize("slow", ["acquire", "renew"])
async def test_a_stop_lets_a_write_in_flight_end_so_the_release_finds_it(slow):
    """The runtime's stop (SIGTERM) cancels the elector while a write waits for its
    reply. Cut off, a renew that had committed left the lease naming an older version,
    and the release matched nothing; an acquire that had won was never given back:
    either way the lease stayed blocked for a lease duration. Now the call ends first;
    a won acquire is given back (no claim of it went out: no record), a renewed term
    is released with its record."""
    clock = FakeClock()
    lease = SlowReplyLease(clock, slow)
    elector, state, _ = make(clock, lease)
    task = asyncio.create_task(elector.run())
    await until(lambda: any(what == slow for what, _ in lease.calls))
    if slow == "renew":
        assert state.facts.holding
        clock.advance(FAST.claim_horizon)  # the term's claims are out
    elector.stop()
    task.cancel()
    await asyncio.sleep(0.01)
    lease.reply.set()  # well within the bound the stop waits for it (1 s)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 2.0)
    assert lease.released == [True]
    assert lease.records == [slow == "renew"]
    assert not state.facts.holding


async def test_a_renew_cut_off_by_its_timeout_unwinds_before_the_elector_goes_on():
    """A renew that outlives the term's validity is cut off; the elector goes on (to a
    step-down and its release) only once the renew has unwound, as a direct await did:
    a release must not overtake the renew it follows, and the renew's late failure is
    seen, not left in a task nobody awaits."""
    clock = FakeClock()
    lease = FakeLease(clock, valid_for=0.3)
    elector, _, _ = await claiming(clock, lease)
    unwound: list[bool] = []

    async def hangs() -> Grant:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.01)  # a driver's clean-up: a cancel request, a reset
            unwound.append(True)
            raise
        raise AssertionError("unreachable")

    lease.try_renew = hangs  # type: ignore[method-assign]  # a renew that hangs
    await asyncio.wait_for(elector._renew_now(), 2.0)  # cut off after the 0.25 s left
    assert unwound == [True]


class HintGivesBack(FakeLease):
    """A lease with hand-over hints whose check, right after a grant, gives the grant to
    the named standby (as the advisory lock does) and then fails: the give-back's reply
    is lost. Whether the grant stands, only a renew tells."""

    def __init__(self, clock: FakeClock, holds_after: bool) -> None:
        super().__init__(clock)
        self.holds_after = holds_after  # does the grant still stand after the check?
        self.checks = 0

    async def hand_to(self, identity: str, bound: float) -> None: ...

    async def handing_to_other(self) -> str | None:
        self.checks += 1
        if self.checks == 1:
            return None  # the check before the acquire: no hint yet
        self.grant = self.holds_after
        raise BackendError("release: reply lost")


@pytest.mark.parametrize("holds_after", [False, True])
async def test_a_hint_check_that_fails_after_a_grant_leads_only_on_a_renew(holds_after):
    """Found by the simulator (postgres): the check that failed read as "no hint", and
    the elector led on a grant the check had given back, beside the named standby."""
    clock = FakeClock()
    lease = HintGivesBack(clock, holds_after)
    elector, state, _ = make(clock, lease)
    await elector._acquire_once()
    # A grant that did not stand is given back (a release without a record).
    given_back = [] if holds_after else ["release"]
    assert [what for what, _ in lease.calls] == ["acquire", "renew", *given_back]
    assert lease.records == [False] * len(given_back)
    clock.advance(FAST.claim_horizon)
    assert state.facts.holding is holds_after
    assert state.claim().leader is holds_after


class RenewFailsAfterCheck(HintGivesBack):
    """The hint check fails after the grant, and so does the renew that should tell
    whether the grant stands: no answer either way."""

    async def try_renew(self) -> Grant:
        self.calls.append(("renew", self.clock.now))
        raise BackendError("terminating connection due to administrator command")


async def test_a_grant_whose_renew_fails_after_a_failed_check_is_given_back():
    """Found by the simulator (postgres-row, a shard set): the member did not lead on the
    grant but kept it in its group's renews, and its elector stopped once the shard was
    another member's; every round trip then renewed a row nobody led on, and the member
    the shard was assigned to saw it held for good."""
    clock = FakeClock()
    lease = RenewFailsAfterCheck(clock, holds_after=True)
    elector, state, _ = make(clock, lease)
    await elector._acquire_once()
    assert [what for what, _ in lease.calls] == ["acquire", "renew", "release"]
    assert lease.records == [False]
    assert not state.facts.holding and not state.claim().leader
    assert state.facts.reason == "the acquire's grant did not stand"
