"""In-memory stand-ins used only by unit tests (no sleeping on time, no server)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from sidecar.base.errors import BackendError
from sidecar.lease import Grant, Holder


@dataclass
class FakeClock:
    now: float = 1000.0
    wall_offset: float = 1_700_000_000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self.wall_offset

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeLease:
    """Grants per a script; records every call with the fake time it happened."""

    clock: FakeClock
    name: str = "default"
    valid_for: float = 10.0
    round_trip: float = 0.0  # fake seconds each call "takes"
    grant: bool = True
    fail: bool = False
    token: int = 7
    calls: list[tuple[str, float]] = field(default_factory=list)
    records: list[bool] = field(default_factory=list)  # release(record=...) per release
    lost: asyncio.Event | None = None

    async def _call(self, what: str) -> Grant:
        self.calls.append((what, self.clock.now))
        self.clock.advance(self.round_trip)
        await asyncio.sleep(0)
        if self.fail:
            raise BackendError("database unreachable")
        if not self.grant:
            return Grant(held=False, holder="someone-else", reason="held by someone-else")
        return Grant(held=True, valid_for=self.valid_for, fencing_token=self.token,
                     holder="me")

    async def try_acquire(self) -> Grant:
        return await self._call("acquire")

    async def try_renew(self) -> Grant:
        return await self._call("renew")

    async def release(self, record: bool = False) -> None:
        self.calls.append(("release", self.clock.now))
        self.records.append(record)

    async def describe(self) -> Holder:
        return Holder(holder="me")

    async def wait_for_change(self, timeout: float) -> None:
        await asyncio.sleep(timeout)


@dataclass
class RecordingPublisher:
    events: list[tuple[str, bool]] = field(default_factory=list)
    sink: list[tuple[str, float]] | None = None
    clock: FakeClock | None = None

    async def start(self) -> None: ...

    async def changed(self, state) -> None:
        leader = state.claim().leader
        self.events.append(("changed", leader))
        if self.sink is not None and self.clock is not None:
            self.sink.append(("publish" if leader else "unpublish", self.clock.now))

    async def stop(self) -> None: ...


class ScriptedGroup:
    """A shard group whose round trips come when the test puts members on ``beats``; it
    records what the manager advertises."""

    def __init__(self, member: str) -> None:
        self.member = member
        self.beats: asyncio.Queue[tuple[str, ...]] = asyncio.Queue()
        self.advertised: list[bool] = []
        self.closed = False

    def advertise(self, member: bool) -> None:
        self.advertised.append(member)

    async def run(self) -> None:
        await asyncio.Event().wait()  # the round trips are the test's

    async def next_beat(self) -> tuple[str, ...]:
        return await self.beats.get()

    def lease(self, shard: str) -> str:
        return shard

    def retire(self, shard: str) -> None:
        pass

    async def close(self) -> None:
        self.closed = True
