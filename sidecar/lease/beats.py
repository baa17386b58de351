"""One round trip per renew interval for a whole shard group (:class:`~sidecar.lease.
ShardGroup`): this member's record and every shard lease it holds, renewed together.

A backend gives the round trip (:data:`RoundTrip`: the held leases' values in, the ones
still held and the live members out); :class:`Beats` runs it once a renew interval and
answers each lease's renew from it:

- A lease registers when its acquire wins (:meth:`Beats.register`, with the value the
  round trip needs: a row's version, a lock key) and is renewed by every round trip
  from then on, until it is forgotten (:meth:`Beats.forget`, before its release) or a
  round trip finds it no longer held.
- :meth:`Beats.renewed` answers a renew with the latest round trip that renewed this
  lease's registration and was *sent* at most :attr:`Beats.fresh` seconds before the
  renew was asked; the grant's validity counts from that send time, so it promises
  exactly what that round trip proved. Failing that, it asks for a round trip at once
  and waits for it (a lease acquired after the last one, or a round trip that failed).
- ``fresh`` is 1.25 renew intervals where the validity leaves room (the elector's next
  renew then still finds at least a quarter of the validity ahead: validity ≥ 2.5
  renew intervals, 14 s against 2 s by default), so every renew of a group that renews
  on time is answered without a round trip of its own. Where the validity is shorter,
  ``fresh`` shrinks, and renews ask for round trips of their own (concurrent askers
  share them).

Everything reads time through the sidecar's :class:`~sidecar.base.clock.Clock` and
waits with asyncio, so a simulated process runs it as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.base.clock import Clock, first_of
from sidecar.base.errors import BackendError
from sidecar.settings import Timing

log = logging.getLogger("sidecar.lease.shards")

# (held lease key -> the value its renew needs, advertise this member) ->
# (lease key -> its new value, for the leases still held; the live members).
RoundTrip = Callable[[Mapping[str, Any], bool],
                     Awaitable[tuple[Mapping[str, Any], tuple[str, ...]]]]
# Spread of the round trips' period, so the members of a group do not beat in step.
BEAT_JITTER = 0.05


@dataclass
class _Held:
    registration: int
    value: Any


@dataclass
class _Trip:
    """One round trip: what it renewed, sent when, and its outcome once done."""

    sent: float
    renewing: dict[str, int]  # key -> registration renewed by this trip
    done: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    renewed: dict[str, Any] = field(default_factory=dict)  # key -> new value
    members: tuple[str, ...] = ()


class Beats:
    """The round trips of one shard group (see the module doc)."""

    def __init__(self, round_trip: RoundTrip, timing: Timing, clock: Clock,
                 group: str) -> None:
        self._round_trip = round_trip
        self._timing = timing
        self._clock = clock
        self._group = group
        interval = timing.renew_interval
        self.fresh = max(0.0, min(1.25 * interval, timing.validity - 1.5 * interval))
        self._held: dict[str, _Held] = {}
        self._registrations = 0
        self._advertise = True
        self._last: _Trip | None = None  # the latest round trip that succeeded
        self._current: _Trip | None = None  # in flight
        self._wanted = asyncio.Event()  # a lease needs a round trip now
        self._next: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stopping = False
        self._failing = False
        self.round_trips = 0  # counted for the metrics and the benchmarks

    # -- the leases' side ------------------------------------------------------------
    def register(self, key: str, value: Any) -> int:
        """A lease of the group won ``key`` with ``value``: renew it from now on."""
        self._registrations += 1
        self._held[key] = _Held(self._registrations, value)
        return self._registrations

    def value(self, key: str, registration: int) -> Any | None:
        held = self._held.get(key)
        return held.value if held is not None and held.registration == registration else None

    async def forget(self, key: str, registration: int) -> Any | None:
        """Stop renewing ``key`` (its lease is being released) at once; the value of its
        last write, once a round trip renewing it now has ended (a release must name the
        row's current version). The registration goes before the wait: a release that
        gives up waiting (it runs under a timeout, and a slow round trip outlasts it)
        must not leave it behind, or every later round trip renews a lease nobody holds
        and nobody can take — the member itself included — for as long as it lives
        (found by the simulator)."""
        held = self._held.get(key)
        if held is None or held.registration != registration:
            return None
        del self._held[key]
        trip = self._current
        if trip is not None and trip.renewing.get(key) == registration:
            with contextlib.suppress(Exception):
                await asyncio.shield(trip.done)
            # Renewed by that trip: its new value; failed or not renewed: the last known.
            return trip.renewed.get(key, held.value)
        return held.value

    async def renewed(self, key: str, registration: int, asked: float
                      ) -> tuple[Any | None, float]:
        """(the lease's new value, or None: no longer held; the round trip's send time)
        from a round trip sent no earlier than ``asked - fresh`` (see the module doc).
        Raises what the round trip raised."""
        for _ in range(3):
            trip = self._last
            if trip is not None and trip.sent >= asked - self.fresh \
                    and trip.renewing.get(key) == registration:
                return trip.renewed.get(key), trip.sent
            current = self._current
            if current is None or current.sent < asked - self.fresh \
                    or current.renewing.get(key) != registration:
                if self.value(key, registration) is None:
                    return None, asked  # found not held since (or never registered)
                self._wanted.set()
                await self._wait(self._next)
            else:
                await self._wait(current.done)
        raise RuntimeError("shard group: no round trip renewed the lease")  # pragma: no cover

    # -- the members' side -------------------------------------------------------------
    def advertise(self, member: bool) -> None:
        self._advertise = member

    async def next_beat(self) -> tuple[str, ...]:
        await self._wait(self._next)
        assert self._last is not None
        return self._last.members

    async def _wait(self, trip: asyncio.Future[None]) -> None:
        """Wait for a round trip without cancelling it; one that will never come (the
        group closed) is a backend error for the caller, not its cancellation."""
        try:
            await asyncio.shield(trip)
        except asyncio.CancelledError:
            if trip.cancelled() and self._stopping:
                raise BackendError(f"shard group {self._group} closed") from None
            raise

    # -- the loop ----------------------------------------------------------------------
    async def run(self) -> None:
        interval = self._timing.renew_interval
        try:
            while not self._stopping:
                await self._beat()
                period = interval * random.uniform(1 - BEAT_JITTER, 1 + BEAT_JITTER)
                if not self._wanted.is_set():
                    await first_of(self._wanted.wait(), timeout=period)
        finally:
            self._next.cancel()  # no round trip comes any more: nobody waits for one

    async def close(self) -> None:
        self._stopping = True
        self._wanted.set()

    async def _beat(self) -> None:
        self._wanted.clear()
        trip = _Trip(self._clock.monotonic(),
                     {key: held.registration for key, held in self._held.items()})
        waiting, self._next = self._next, asyncio.get_running_loop().create_future()
        self._current = trip
        values = {key: held.value for key, held in self._held.items()}
        try:
            async with asyncio.timeout(max(1.0, self._timing.validity)):
                renewed, members = await self._round_trip(values, self._advertise)
        except asyncio.CancelledError:
            self._settle(trip, waiting, asyncio.CancelledError())
            raise
        except Exception as exc:
            if not self._failing:
                self._failing = True
                log.warning("shard group round trip failed", extra={
                    "group": self._group, "error": str(exc) or type(exc).__name__})
            self._settle(trip, waiting, exc)
            return
        finally:
            self.round_trips += 1
        if self._failing:
            self._failing = False
            log.info("shard group round trips succeed again", extra={"group": self._group})
        trip.renewed = dict(renewed)
        trip.members = tuple(members)
        for key, registration in trip.renewing.items():
            held = self._held.get(key)
            if held is None or held.registration != registration:
                continue  # forgotten meanwhile
            if key in trip.renewed:
                held.value = trip.renewed[key]
            else:
                del self._held[key]  # not ours any more: its next renew is refused
        self._last = trip
        self._settle(trip, waiting, None)

    def _settle(self, trip: _Trip, waiting: asyncio.Future[None],
                error: BaseException | None) -> None:
        self._current = None
        for future in (trip.done, waiting):
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            elif isinstance(error, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(error)
                future.exception()  # retrieved: nobody may be waiting for this one


class BeatingGroup:
    """What every shard group delegates to its :class:`Beats` (the group sets ``_beats``
    in its constructor): the members' view, the round-trip loop and its count."""

    _beats: Beats

    @property
    def round_trips(self) -> int:
        return self._beats.round_trips

    def advertise(self, member: bool) -> None:
        self._beats.advertise(member)

    async def next_beat(self) -> tuple[str, ...]:
        return await self._beats.next_beat()

    async def run(self) -> None:
        await self._beats.run()

    async def close(self) -> None:
        await self._beats.close()
