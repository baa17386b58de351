"""The work watchdog's rules on a real clock, with short periods (a stall after 200 ms).

The step-down is recorded instead of going to an elector here (it calls the elector's
``request_release``, tested in test_elector.py); real sidecars stepping down on a stall
are in tests/integration/test_work_watchdog.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from sidecar import watchdog
from sidecar.state import LeaseState
from sidecar.watchdog import WorkWatchdog
from tests.unit.test_metrics import scrape

STALL = 0.2


class Recorder:
    """Stands in for the elector: remembers the reason and stops the claims, as the
    elector's step-down does first."""

    def __init__(self, state: LeaseState) -> None:
        self.state = state
        self.asked: list[tuple[float, str]] = []

    def __call__(self, reason: str) -> bool:
        self.asked.append((self.state.clock.monotonic(), reason))
        self.state.update("released", released=True, reason=reason)
        return True


def lead(state: LeaseState, claim_in: float = 0.0, token: int = 1) -> float:
    now = state.clock.monotonic()
    state.update("acquired", holding=True, released=False, claim_from=now + claim_in,
                 valid_until=now + 60, fencing_token=token, holder="me")
    return now + claim_in


@contextlib.asynccontextmanager
async def watched(state: LeaseState, recorder: Recorder) -> AsyncIterator[WorkWatchdog]:
    dog = WorkWatchdog(state, STALL, recorder)
    task = asyncio.create_task(dog.run())
    try:
        yield dog
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_for(predicate, timeout: float = 3.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


@pytest.fixture
def state() -> LeaseState:
    return LeaseState(lease="jobs", identity="me", role="all", claim_horizon=0.05)


async def test_no_heartbeat_at_all_steps_down_one_period_after_the_first_claim(state):
    recorder = Recorder(state)
    async with watched(state, recorder):
        first_claim = lead(state)
        await wait_for(lambda: recorder.asked)
    at, reason = recorder.asked[0]
    assert STALL <= at - first_claim < STALL + 0.5
    assert reason.startswith("work stalled: no POST /heartbeat for ")
    assert "no heartbeat yet" in reason and "LEASE_WORK_STALL_AFTER is 200ms" in reason
    assert len(recorder.asked) == 1
    assert state.work.stalls == 1 and state.work.last_stall is not None
    assert state.work.last_stall["reason"] == reason
    assert watchdog.status(state)["stalls"] == 1
    assert scrape([state])['lease_sidecar_work_stalls_total{lease="jobs"}'] == 1


async def test_heartbeats_keep_a_leader_and_their_end_steps_it_down(state):
    recorder = Recorder(state)
    async with watched(state, recorder):
        lead(state)
        loop = asyncio.get_running_loop()
        until = loop.time() + 4 * STALL
        while loop.time() < until:  # four periods, a beat every quarter period
            outcome, answer = watchdog.beat(state)
            assert outcome == "beat" and answer["stall_after"] == STALL
            assert answer["stalls_at"] > answer["at"]
            await asyncio.sleep(STALL / 4)
        assert recorder.asked == []
        assert state.claim().leader
        last_beat = state.work.last_beat
        assert last_beat is not None
        await wait_for(lambda: recorder.asked)
    at, reason = recorder.asked[0]
    assert STALL <= at - last_beat < STALL + 0.5
    assert "since its last heartbeat" in reason
    samples = scrape([state])
    assert samples['lease_sidecar_last_work_heartbeat_timestamp_seconds{lease="jobs"}'] == \
        state.work.last_beat_wall > 0


async def test_a_fresh_term_gets_the_full_period_from_its_first_claim(state):
    """A beat from an earlier term does not count, and the one-horizon wait before the
    first claim is not counted against the new leader."""
    recorder = Recorder(state)
    async with watched(state, recorder):
        lead(state)
        assert watchdog.beat(state)[0] == "beat"
        state.update("lost", holding=False, fencing_token=None, holder=None)
        await asyncio.sleep(STALL * 1.5)  # the old beat is now older than a period
        first_claim = lead(state, claim_in=0.1, token=2)
        await wait_for(lambda: recorder.asked)
    at, reason = recorder.asked[0]
    assert STALL <= at - first_claim < STALL + 0.5
    assert "no heartbeat yet" in reason


async def test_one_step_down_per_stalled_term(state):
    """The elector may take a moment: the watchdog asks once, not in a loop."""
    asked: list[str] = []
    async with watched(state, lambda reason: asked.append(reason) or True):
        lead(state)
        await wait_for(lambda: asked)
        await asyncio.sleep(STALL * 2)  # still leading: no step-down happened
        assert len(asked) == 1
        lead(state, token=2)  # a new term stalls again
        await wait_for(lambda: len(asked) == 2)


def test_a_standby_has_no_work_to_vouch_for(state):
    assert watchdog.beat(state) == ("not-leading", {})
    lead(state, claim_in=10)  # holding, before its first claim: not leading yet
    assert watchdog.beat(state)[0] == "not-leading"
    assert state.work.last_beat is None and state.work.last_beat_wall == 0.0
    assert watchdog.status(state) == {"stall_after": None, "last_heartbeat": None,
                                      "stalls": 0, "last_stall": None}
