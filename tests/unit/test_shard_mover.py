"""The shard mover survives the round trip that stops the elector it is handing over.

A member hands a shard it holds but is not assigned to the member the view names, waits
until the release, then stops the shard's elector. The group's round trips go on
meanwhile: one that comes between the release and the mover's wake-up already stopped
that elector (it holds nothing and the shard is not ours). The mover then stopped it a
second time, died on a ``KeyError``, and the member kept every other shard it should
have handed over (seen in the shards benchmark: 51 shards on one member of eight, fair
share 32, for the whole 240 s of the wait).

Also: the view follows the group from its first round trip, and a stop still hands the
shards over and stops their electors after a shard loop failed."""

from __future__ import annotations

import asyncio
from typing import Any

from sidecar.base.clock import SystemClock
from sidecar.lease.beats import BeatingGroup, Beats
from sidecar.settings import Timing
from sidecar.shards import manager as shard_manager
from sidecar.shards.assign import assign
from sidecar.shards.manager import ShardManager
from sidecar.state import LeaseState
from tests.unit.fakes import ScriptedGroup

TIMING = Timing(lease_duration=3.0, renew_interval=0.1, renew_deadline=2.0,
                safety_margin=0.2, claim_horizon=0.05)


class HeldElector:
    """An elector whose lease is granted at once; a hand-over is answered by the test."""

    def __init__(self, state: LeaseState) -> None:
        self.state = state
        self.handovers: list[str | None] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        self.state.update(holding=True)
        await self._stop.wait()

    def stop(self) -> None:
        self._stop.set()

    def request_handover(self, to: str | None = None, why: str = "request") -> bool:
        self.handovers.append(to)
        self.state.update(released=True)
        return True


def member_m0(shards: list[str], group: ScriptedGroup
              ) -> tuple[ShardManager, dict[str, LeaseState], dict[str, HeldElector]]:
    """Member m0 of ``group`` over ``shards``, its electors of :class:`HeldElector`."""
    states = {s: LeaseState(s, "m0", "leader", TIMING.claim_horizon) for s in shards}
    electors: dict[str, HeldElector] = {}

    def make_elector(lease: Any, state: LeaseState, _successor: Any) -> HeldElector:
        electors[state.lease] = HeldElector(state)
        return electors[state.lease]

    manager = ShardManager(group, states, "m0", TIMING, SystemClock(), make_elector)
    return manager, states, electors


async def test_the_mover_goes_on_when_a_round_trip_stopped_the_handed_over_elector() -> None:
    shards = [f"work-{n}" for n in range(8)]
    group = ScriptedGroup("m0")
    manager, states, electors = member_m0(shards, group)
    await manager.start()
    try:
        for _ in range(shard_manager.JOIN_BEATS):  # alone: every shard is ours
            await group.beats.put(("m0",))
        await asyncio.sleep(0.05)
        assert sorted(manager.owned()) == shards
        both = ("m0", "m1")
        theirs = sorted(s for s, m in assign(shards, both).items() if m == "m1")
        await group.beats.put(both)
        for _ in range(len(theirs)):
            # The mover hands one shard over once the view has held still...
            async with asyncio.timeout(5):
                while not any(e.handovers for s, e in electors.items()
                              if states[s].facts.holding):
                    await asyncio.sleep(0.01)
            shard = next(s for s, e in electors.items()
                         if e.handovers and states[s].facts.holding)
            # ...and the round trip that sees its release comes before the mover wakes.
            await group.beats.put(both)
            states[shard].update(holding=False, released=False)
            await asyncio.sleep(0.05)
            assert manager.alive(), f"the shard mover died: {manager.failure}"
        assert sorted(manager.owned()) == sorted(set(shards) - set(theirs))
    finally:
        for task in [*manager._loops, *manager._tasks.values()]:
            task.cancel()
        await asyncio.gather(*manager._loops, *manager._tasks.values(),
                             return_exceptions=True)


class CountedGroup(BeatingGroup):
    """A shard group on the real round-trip loop, whose round trips only count."""

    member = "m0"

    def __init__(self) -> None:
        self.sent = 0
        self._beats = Beats(self._round_trip, TIMING, SystemClock(), "work")

    async def _round_trip(self, held: Any, advertise: bool) -> tuple[dict[str, Any],
                                                                      tuple[str, ...]]:
        self.sent += 1
        return {}, ("m0",)

    def lease(self, shard: str) -> str:
        return shard

    def retire(self, shard: str) -> None:
        pass


async def test_the_view_follows_the_groups_first_round_trip() -> None:
    """A newcomer counts its round trips from the first (JOIN_BEATS), which writes its
    record: a view that began with the second campaigned a renew interval late, after
    the others had begun handing it shards (seen on kubernetes: moves to a newcomer
    unowned for 1.5 s)."""
    group = CountedGroup()
    manager = ShardManager(group, {}, "m0", TIMING, SystemClock(),
                           make_elector=lambda *_: None)
    await manager.start()
    try:
        async with asyncio.timeout(5):
            while group.sent < 1:
                await asyncio.sleep(0.001)
        await asyncio.sleep(TIMING.renew_interval / 4)  # well before the second
        assert group.sent == 1
        assert manager._beats == 1, "the first round trip was not seen"
        assert manager.view.members == ("m0",)
    finally:
        for task in manager._loops:
            task.cancel()
        await asyncio.gather(*manager._loops, return_exceptions=True)


async def test_a_stop_after_a_failed_loop_still_stops_every_elector() -> None:
    """A shard loop that failed (logged once, ``/livez`` fails) re-raised when the stop
    awaited it: the stop ended there, and no elector was told to stop."""
    shards = [f"work-{n}" for n in range(4)]

    async def broken_mover() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("a defect in the mover")

    group = ScriptedGroup("m0")
    manager, _, electors = member_m0(shards, group)
    manager._move = broken_mover  # the loop start() creates as "shard-mover"
    await manager.start()
    for _ in range(shard_manager.JOIN_BEATS):
        await group.beats.put(("m0",))
    await asyncio.sleep(0.05)
    assert sorted(manager.owned()) == shards
    assert not manager.alive() and manager.failure is not None
    assert "a defect in the mover" in manager.failure
    # Alone: the leave finds no successor and its wait is bounded (3 renew intervals).
    async with asyncio.timeout(5):
        await manager.stop()
    assert all(e._stop.is_set() for e in electors.values())
    assert group.closed and not manager._loops
