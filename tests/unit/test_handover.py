"""The elector's side of a deliberate hand-over and of LEASE_APP_READY_URL, on the
scripted lease of tests/unit/fakes.py with a next-holder hint added. The backends' hints
and the real timing are tested with real processes in tests/integration/test_handover.py.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from sidecar.base.errors import BackendError
from sidecar.elector import HINT_AFTER_RELEASE, Elector
from sidecar.lease import Grant, successor_of
from sidecar.publish.events import EventPublisher
from sidecar.settings import Settings, Timing
from sidecar.state import LeaseState
from tests.unit.fakes import FakeClock, FakeLease, RecordingPublisher

TIMING = Timing(lease_duration=0.3, renew_interval=0.01, renew_deadline=0.2,
                safety_margin=0.05, claim_horizon=0.05)
# How long a hint lives when no claim is out: a retry interval after the release (a named
# standby that does not come holds the others back that long, not a lease duration).
HINT_BOUND = HINT_AFTER_RELEASE * TIMING.renew_interval


@dataclass
class HintLease(FakeLease):
    """FakeLease with the Successor capability; ``own`` is this contender's identity."""

    own: str = "web-0"
    hint: str | None = None
    hint_fails: bool = False

    async def hand_to(self, identity: str, bound: float) -> None:
        self.calls.append((f"hand_to {identity} {bound}", self.clock.now))
        if self.hint_fails:
            raise BackendError("permission denied")
        self.hint = identity

    async def handing_to_other(self) -> str | None:
        self.calls.append(("hint?", self.clock.now))
        return self.hint if self.hint not in (None, self.own) else None


def contender(lease: FakeLease, sits_out=None) -> tuple[Elector, LeaseState]:
    state = LeaseState(lease="jobs", identity="web-0", role="all",
                       claim_horizon=TIMING.claim_horizon, clock=lease.clock)
    return Elector(lease, state, TIMING, "web-0", sits_out=sits_out), state


def names(lease: FakeLease) -> list[str]:
    return [what for what, _ in lease.calls]


def test_only_a_lease_with_both_methods_has_the_capability():
    assert successor_of(HintLease(FakeClock())) is not None
    assert successor_of(FakeLease(FakeClock())) is None


async def test_the_leader_names_its_successor_then_steps_down_the_safe_way():
    lease = HintLease(FakeClock())
    elector, state = contender(lease)
    assert elector.request_handover("web-1") is False  # a standby cannot
    await elector._acquire_once()
    assert elector.request_handover("web-0") is False  # not to itself
    assert elector.request_handover("web-1") is True
    await elector._renew_once()
    # The hint first (bounded), then the release; no renew between.
    assert names(lease)[-2:] == [f"hand_to web-1 {HINT_BOUND}", "release"]
    assert not state.facts.holding and state.facts.reason == "handed over to web-1"
    assert state.handovers == {"request": 1}
    assert state.transitions[-1]["event"] == "released"


async def test_claims_stop_at_the_request_not_when_the_loop_gets_to_it():
    """A request that comes while a renew is on its way (a commit on a busy disk) was
    acted on after it: the leader kept handing out claims meanwhile, and the wait for
    the last one started that much later."""
    lease = HintLease(FakeClock())
    elector, state = contender(lease)
    await elector._acquire_once()
    lease.clock.advance(TIMING.claim_horizon)
    assert state.claim().leader
    assert elector.request_handover("web-1")
    assert not state.claim().leader and state.facts.holding
    assert state.facts.reason == "handed over to web-1"


async def test_the_hint_is_written_while_the_last_claim_runs_out():
    """Not before the step-down: the hint's round trips (a new session and the queue of
    the advisory lock) came on top of the two claim horizons. Now the leader stops
    claiming first and names the successor meanwhile; the release still waits for it."""
    lease = HintLease(FakeClock())
    elector, state = contender(lease)
    await elector._acquire_once()
    written = asyncio.Event()
    seen: list[bool] = []
    original = lease.hand_to

    async def slow_hint(identity: str, bound: float) -> None:
        seen.append(state.claim().leader)
        await written.wait()
        await original(identity, bound)

    lease.hand_to = slow_hint  # type: ignore[method-assign]  # a scripted slow hint
    elector.request_handover("web-1")
    stepping_down = asyncio.ensure_future(elector._renew_once())
    for _ in range(5):
        await asyncio.sleep(0.01)  # the claims' wait (fake time) is over, the hint is not
    assert seen == [False] and "release" not in names(lease)
    written.set()
    await stepping_down
    assert names(lease)[-2:] == [f"hand_to web-1 {HINT_BOUND}", "release"]


async def test_a_hint_that_cannot_be_written_costs_the_preference_not_the_release():
    lease = HintLease(FakeClock(), hint_fails=True)
    elector, state = contender(lease)
    await elector._acquire_once()
    elector.request_handover("web-1")
    await elector._renew_once()
    assert names(lease)[-1] == "release" and not state.facts.holding


async def test_without_a_target_no_hint_is_written():
    lease = HintLease(FakeClock())
    elector, state = contender(lease)
    await elector._acquire_once()
    elector.request_handover(None, why="app-unready")
    await elector._renew_once()
    assert not any(n.startswith("hand_to") for n in names(lease))
    assert state.facts.reason == "handed over (app-unready)"
    assert state.handovers == {"app-unready": 1}


async def test_a_standby_named_by_nobody_stands_aside_while_the_hint_lives():
    lease = HintLease(FakeClock(), hint="web-1")
    elector, state = contender(lease)
    await elector._acquire_once()
    assert "acquire" not in names(lease)
    assert state.facts.reason == "standing aside: the lease is being handed to web-1"
    lease.hint = None  # the hint ran out (at most one lease duration)
    await elector._acquire_once()
    assert names(lease)[-2:] == ["acquire", "hint?"] and state.facts.holding


async def test_the_named_standby_acquires():
    lease = HintLease(FakeClock(), hint="web-0")
    elector, state = contender(lease)
    await elector._acquire_once()
    assert names(lease) == ["hint?", "acquire", "hint?"] and state.facts.holding


async def test_a_standby_granted_while_another_is_named_gives_the_lease_back():
    """An advisory-lock wait queued in the server before the hint was written is granted
    at the leader's release: before, that standby led and the named one never did (seen
    in the hand-over benchmark, 1 trial in 10). Now it looks again after the grant and
    releases before any claim."""
    lease = HintLease(FakeClock())
    elector, state = contender(lease)
    original = lease.try_acquire

    async def granted_as_the_hint_appears() -> Grant:
        grant = await original()
        lease.hint = "web-1"  # written by the leader while our wait was queued
        return grant

    lease.try_acquire = granted_as_the_hint_appears  # type: ignore[method-assign]  # a scripted grant
    await elector._acquire_once()
    assert names(lease) == ["hint?", "acquire", "hint?", "release"]
    assert not state.facts.holding and not state.claim().leader
    assert state.facts.reason == "standing aside: the lease is being handed to web-1"


async def test_a_standby_whose_application_is_not_ready_does_not_campaign():
    lease = HintLease(FakeClock())
    why = ["not campaigning: the application is not ready"]
    elector, state = contender(lease, sits_out=lambda: why[0])
    publisher = RecordingPublisher()
    elector.publishers.append(publisher)
    await elector._acquire_once()
    # No attempt to acquire; only a release, which gives back a grant the backend may
    # have made meanwhile (an advisory in-server wait) and is no round trip otherwise.
    assert [call for call, _ in lease.calls if call != "release"] == []
    assert state.facts.reason == why[0]
    # The publishers hear it (the pod annotation says so: no hand-over picks this pod),
    # once, not on every round of sitting out.
    assert state.facts.sitting_out == why[0]
    assert publisher.events == [("changed", False)]
    await elector._acquire_once()
    assert publisher.events == [("changed", False)]
    why[0] = None
    await elector._acquire_once()
    assert state.facts.holding and state.facts.sitting_out is None
    assert publisher.events[1] == ("changed", False)  # campaigning again, then leading


@pytest.mark.parametrize(("why", "kind"), [("request", "Normal"), ("app-unready", "Warning")])
async def test_a_hand_over_is_its_own_event(why: str, kind: str):
    lease = HintLease(FakeClock())
    elector, state = contender(lease)
    settings = Settings(timing=TIMING, identity="web-0", pod_name="web-0",
                        pod_namespace="apps")
    publisher = EventPublisher(settings, [state])
    await elector._acquire_once()
    elector.request_handover("web-1", why=why)
    await elector._renew_once()
    publisher._catch_up(0, state)
    occurrences = []
    while not publisher._queue.empty():
        occurrences.append(publisher._queue.get_nowait())
    last = occurrences[-1]
    assert last is not None and (last.reason, last.type) == ("LeaseHandedOver", kind)
    assert "handed over to web-1" in last.note


def pod(name: str, created: str, ready: bool = True, deleting: bool = False,
        role: str | None = "standby", group: str = "lease-sidecar.jobs") -> dict:
    meta: dict = {"name": name, "creationTimestamp": created,
                  "labels": {"lease-sidecar/group": group}}
    if role is not None:
        meta["labels"]["lease-role"] = role
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:10:00Z"
    return {"metadata": meta, "status": {"conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_the_successor_is_the_youngest_pod_that_stays_and_campaigns():
    """Ready is not enough: an api-role pod, or one whose sidecar has not published
    (no lease-role), never takes the lease, and the others would stand aside for it."""
    from sidecar.rollout import youngest_ready

    group = "lease-sidecar.jobs"
    pods = [pod("web-old", "2026-01-01T00:00:00Z"), pod("web-me", "2026-01-01T00:09:00Z"),
            pod("web-new", "2026-01-01T00:05:00Z"),
            pod("web-newer", "2026-01-01T00:06:00Z", ready=False),
            pod("web-going", "2026-01-01T00:07:00Z", deleting=True),
            pod("api-0", "2026-01-01T00:08:00Z", role="api"),
            pod("web-unlabelled", "2026-01-01T00:08:30Z", role=None)]
    assert youngest_ready(pods, own="web-me", group=group) == "web-new"
    assert youngest_ready([pod("web-me", "2026-01-01T00:09:00Z")], own="web-me",
                          group=group) is None


def test_a_younger_pod_whose_sidecar_has_not_published_is_worth_a_wait():
    """Only a pod younger than the pick, staying, of our group and with no role label
    yet: the one a rollout just made Ready before its sidecar's first label write."""
    from sidecar.rollout import unpublished_younger

    group = "lease-sidecar.jobs"
    old = pod("web-old", "2026-01-01T00:00:00Z")
    me = pod("web-me", "2026-01-01T00:01:00Z")
    new = pod("web-new", "2026-01-01T00:09:00Z", role=None)
    assert unpublished_younger([old, me, new], "web-me", group, than="web-old") == "web-new"
    assert unpublished_younger([old, me, new], "web-me", group, than=None) == "web-new"
    # Older than the pick, being deleted, another group's, or already published: no wait.
    assert unpublished_younger([old, me, new], "web-me", group, than="web-new") is None
    assert unpublished_younger(
        [old, me, pod("web-new", "2026-01-01T00:09:00Z", role=None, deleting=True)],
        "web-me", group, than="web-old") is None
    assert unpublished_younger(
        [old, me, pod("web-new", "2026-01-01T00:09:00Z", role=None, group="other")],
        "web-me", group, than="web-old") is None
    assert unpublished_younger([old, me, pod("web-new", "2026-01-01T00:09:00Z")],
                               "web-me", group, than="web-old") is None
    assert unpublished_younger([pod("web-me", "2026-01-01T00:09:00Z", role=None)],
                               "web-me", group, than=None) is None


def test_why_a_pod_cannot_lead():
    from sidecar.rollout import cannot_lead

    group = "lease-sidecar.jobs"
    assert cannot_lead(pod("a", "t"), group) is None
    assert cannot_lead(pod("a", "t", deleting=True), group) == "pod a is terminating"
    assert cannot_lead(pod("a", "t", role="api"), group) == (
        "pod a runs its sidecar in role api, which never campaigns")
    assert cannot_lead(pod("a", "t", ready=False), group) == "pod a is not Ready"
    assert cannot_lead(pod("a", "t", group="other"), group) == (
        "pod a is not in lease group lease-sidecar.jobs")
    not_ready_app = pod("a", "t")
    not_ready_app["status"]["containerStatuses"] = [{"name": "app", "ready": False}]
    assert cannot_lead(not_ready_app, group, ("app",)) == "pod a: container app is not Ready"
    sitting_out = pod("a", "t")  # Ready, but its application is not (LEASE_APP_READY_URL)
    sitting_out["metadata"]["annotations"] = {"lease-sidecar/lease": json.dumps(
        {"role": "standby", "sits_out": "not campaigning: the application is not ready"})}
    assert cannot_lead(sitting_out, group) == (
        "pod a's sidecar sits out (not campaigning: the application is not ready)")


async def test_on_shutdown_the_chosen_successor_is_named_first():
    lease = HintLease(FakeClock())
    state = LeaseState(lease="jobs", identity="web-0", role="all",
                       claim_horizon=TIMING.claim_horizon, clock=lease.clock)

    async def choose() -> str | None:
        return "web-2"

    elector = Elector(lease, state, TIMING, "web-0", shutdown_successor=choose)
    await elector._acquire_once()
    await elector.shutdown()
    assert names(lease)[-2:] == [f"hand_to web-2 {HINT_BOUND}", "release"]
    assert state.facts.reason == "handed over to web-2 (shutdown)"
    assert state.handovers == {"shutdown": 1}


async def test_the_hint_outlives_the_claims_by_a_retry_interval_and_a_second_request_waits():
    """The hint held the other standbys back for a whole lease duration when the named
    one never came; and a second request during the step-down was answered as if it
    named the successor, while the hint named the first one."""
    lease = HintLease(FakeClock())
    elector, state = contender(lease)
    await elector._acquire_once()
    lease.clock.advance(TIMING.claim_horizon)
    assert state.claim().leader  # a claim is out: it runs one horizon from now
    assert elector.request_handover("web-1") is True
    assert elector.request_handover("web-2") is False  # one step-down at a time

    async def time_passes() -> None:  # the step-down waits for the claim on this clock
        while True:
            await asyncio.sleep(0.001)
            lease.clock.advance(0.01)

    clock = asyncio.create_task(time_passes())
    try:
        await elector._renew_once()
    finally:
        clock.cancel()
    named = next(what for what in names(lease) if what.startswith("hand_to"))
    assert named.startswith("hand_to web-1 ")
    assert float(named.split()[-1]) == pytest.approx(
        TIMING.claim_horizon + HINT_AFTER_RELEASE * TIMING.renew_interval)
    assert state.facts.reason == "handed over to web-1"
