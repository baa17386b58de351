"""The shard group's round trips (:mod:`sidecar.lease.beats`): one renews every lease of
the group, a lease's renew is answered from one sent recently enough, and the answer's
validity counts from that round trip's send time."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from sidecar.lease.beats import Beats
from sidecar.lease.rowlease import RowLease
from sidecar.settings import Timing
from tests.unit.fakes import FakeClock

TIMING = Timing(lease_duration=15.0, renew_interval=2.0, safety_margin=1.0)


class Server:
    """The round trip: renews what it is given (unless told some key is lost), taking
    ``delay`` fake seconds."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.trips: list[tuple[float, dict[str, Any]]] = []
        self.lost: set[str] = set()
        self.delay = 0.0
        self.gate: asyncio.Event | None = None

    async def __call__(self, held: Mapping[str, Any],
                       advertise: bool) -> tuple[Mapping[str, Any], tuple[str, ...]]:
        self.trips.append((self.clock.now, dict(held)))
        if self.gate is not None:
            await self.gate.wait()
        self.clock.advance(self.delay)
        renewed = {key: value + 1 for key, value in held.items() if key not in self.lost}
        return renewed, ("me",) if advertise else ()


async def test_a_renew_is_answered_from_a_recent_round_trip_valid_from_its_send_time() -> None:
    clock = FakeClock()
    server = Server(clock)
    beats = Beats(server, TIMING, clock, "group")
    reg = beats.register("a", 10)
    beat = asyncio.create_task(beats._beat())
    await beat
    assert server.trips == [(1000.0, {"a": 10})]
    clock.advance(1.5)  # the elector renews 1.5 s after the round trip was sent
    value, sent = await beats.renewed("a", reg, clock.now)
    assert (value, sent) == (11, 1000.0) and len(server.trips) == 1  # no round trip of its own


async def test_a_lease_not_in_the_last_round_trip_asks_for_one() -> None:
    clock = FakeClock()
    server = Server(clock)
    beats = Beats(server, TIMING, clock, "group")
    runner = asyncio.create_task(beats.run())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(server.trips) == 1  # the first beat, nothing held
    reg = beats.register("a", 5)
    clock.advance(0.1)
    value, sent = await asyncio.wait_for(beats.renewed("a", reg, clock.now), 2)
    assert value == 6 and sent == clock.now and server.trips[-1][1] == {"a": 5}
    await beats.close()
    runner.cancel()


async def test_a_stale_round_trip_is_not_used() -> None:
    clock = FakeClock()
    server = Server(clock)
    beats = Beats(server, TIMING, clock, "group")
    reg = beats.register("a", 1)
    await beats._beat()
    clock.advance(beats.fresh + 0.01)  # older than a renew may lean on
    runner = asyncio.create_task(beats.run())
    value, sent = await asyncio.wait_for(beats.renewed("a", reg, clock.now), 2)
    assert value == 3 and sent == clock.now and len(server.trips) == 2
    await beats.close()
    runner.cancel()


async def test_a_lease_the_round_trip_did_not_renew_is_refused() -> None:
    clock = FakeClock()
    server = Server(clock)
    beats = Beats(server, TIMING, clock, "group")
    reg = beats.register("a", 1)
    server.lost.add("a")
    await beats._beat()
    assert await beats.renewed("a", reg, clock.now) == (None, clock.now)
    assert beats.value("a", reg) is None  # not renewed again


async def test_forget_waits_for_the_round_trip_renewing_the_lease() -> None:
    """A release must name the row's version after a renew in flight (PostgreSQL draws
    a new one per write)."""
    clock = FakeClock()
    server = Server(clock)
    server.gate = asyncio.Event()
    beats = Beats(server, TIMING, clock, "group")
    reg = beats.register("a", 1)
    beat = asyncio.create_task(beats._beat())
    await asyncio.sleep(0)
    forgetting = asyncio.create_task(beats.forget("a", reg))
    await asyncio.sleep(0)
    assert not forgetting.done()
    server.gate.set()
    await beat
    assert await forgetting == 2  # the version the round trip wrote
    assert beats.value("a", reg) is None


async def test_the_validity_of_a_group_renew_counts_from_the_round_trips_send_time() -> None:
    """RowLease in a group: valid_for is the validity less the time since the round
    trip was sent, so send time + valid_for is the round trip's own promise."""
    clock = FakeClock()
    server = Server(clock)
    beats = Beats(server, TIMING, clock, "group")

    class Store:
        async def acquire(self, name: str, owner: str, duration: float) -> Any:
            from sidecar.lease.rowlease import Row
            return Row(owner=owner, version=7)

    lease = RowLease(Store(), "a", "a", "me", duration=15.0, safety_margin=1.0,  # type: ignore[arg-type]  # only acquire is called
                     clock=clock, batch=beats)
    assert (await lease.try_acquire()).held
    await beats._beat()
    clock.advance(1.25)
    grant = await lease.try_renew()
    assert grant.held and grant.valid_for == TIMING.validity - 1.25


async def test_a_release_that_stops_waiting_still_ends_the_renewals() -> None:
    """The elector bounds a release; a slow round trip in flight outlasts the bound. The
    lease must leave the group all the same: left registered, every later round trip
    renewed a row nobody held and nobody could take (found by the simulator)."""
    clock = FakeClock()
    server = Server(clock)
    server.gate = asyncio.Event()  # the round trip hangs
    beats = Beats(server, TIMING, clock, "group")
    reg = beats.register("a", 7)
    slow = asyncio.create_task(beats._beat())
    await asyncio.sleep(0)
    assert server.trips[-1][1] == {"a": 7}
    try:
        async with asyncio.timeout(0.01):  # the release gives up waiting
            await beats.forget("a", reg)
    except TimeoutError:
        pass
    server.gate.set()
    await slow
    await beats._beat()
    assert server.trips[-1][1] == {}  # not renewed any more
    assert await beats.forget("a", reg) is None

