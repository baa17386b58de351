"""One Lease object as seen by one contender: acquire, renew, release, describe, wait.

Standbys watch the Lease, so a release (``holderIdentity`` cleared and
``leaseDurationSeconds`` set to 1, like client-go's ``ReleaseOnCancel``) is taken over at
once, and a holder that died is taken over the moment its lease runs out on the standby's
clock (:mod:`.expiry`) — not at the next retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace

from sidecar.clock import Clock
from sidecar.lease import Grant, Holder
from sidecar.lease.kubernetes.expiry import Observer
from sidecar.lease.kubernetes.record import Record, micro_time
from sidecar.lease.kubernetes.transport import Conflict, LeaseApi, LeaseWatch
from sidecar.settings import Timing


class KubeLease:
    """Lease ``name``, stored as the Lease object ``object_name``, contended for by
    ``identity``; ``api`` connects (once, on first use) and returns the Lease calls."""

    # A Lease object is lost only when a renew is refused.
    lost: asyncio.Event | None = None

    def __init__(self, name: str, *, object_name: str, identity: str, timing: Timing,
                 clock: Clock, api: Callable[[], Awaitable[LeaseApi]]) -> None:
        self.name = name
        self._object = object_name
        self._identity = identity
        self._clock = clock
        self._connect = api
        self._api: LeaseApi | None = None
        # Whole seconds on the wire; rounding up only makes others wait longer.
        self._duration = max(1, math.ceil(timing.lease_duration))
        self._valid_for = timing.validity
        self._observer = Observer(clock.monotonic)
        self._mine: Record | None = None  # our last successful write in this term
        self._changed = asyncio.Event()
        self._watch: LeaseWatch | None = None

    # -- the Lease protocol ------------------------------------------------------------
    async def try_acquire(self) -> Grant:
        api = await self._connected()
        watched = self._observer.record
        if (self._watch is not None and watched is not None
                and self._observer.free_in(self._identity) == 0):
            # The watch just showed the lease free (a release, or it ran out): skip the
            # GET, saving a round trip on every handover. A stale view costs nothing but
            # a 409, because the write is guarded by the version we saw.
            current: Record | None = watched
        else:
            current = await self._read(api)
        wait = self._observer.free_in(self._identity)
        if wait > 0:
            if current is None:
                return Grant(held=False, reason=f"lease object deleted while held; free in "
                                                f"{wait:.1f}s")
            return Grant(held=False, holder=current.holder,
                         reason=f"held by {current.holder} (free in {wait:.1f}s unless "
                                "renewed)")
        # A new term every time — also when the record names us (a restarted process
        # with the same identity): the token must change with every acquisition. A new
        # object starts at 0, as client-go's does.
        now = micro_time(self._clock.wall())
        if current is None:
            wanted = Record(holder=self._identity, duration=self._duration, transitions=0,
                            version="", acquire_time=now, renew_time=now)
        else:
            wanted = replace(current, holder=self._identity, duration=self._duration,
                             transitions=current.transitions + 1, acquire_time=now,
                             renew_time=now)
        try:
            if current is None:
                written = await api.create(self._object, wanted)
            else:
                written = await api.replace(self._object, wanted)
        except Conflict:
            # Lost the race: read the winner's record so our wait counts from it.
            winner = await self._read(api)
            holder = winner.holder if winner else None
            return Grant(held=False, holder=holder or None,
                         reason=f"lost the race to {holder or 'another contender'}")
        return self._holding(written)

    async def try_renew(self) -> Grant:
        mine = self._mine
        if mine is None:
            return Grant(held=False, reason="not holding")
        api = await self._connected()
        try:
            written = await api.replace(self._object, self._renewed(mine))
        except Conflict:
            # Something else wrote the object; it is still ours only if it still names
            # us in the same term.
            current = await self._read(api)
            if not self._is_ours(current, mine):
                self._mine = None
                holder = current.holder if current else None
                return Grant(held=False, holder=holder or None,
                             reason=f"taken over by {holder}" if holder else "lease released "
                             "or deleted by someone else")
            assert current is not None
            try:
                written = await api.replace(self._object, self._renewed(current))
            except Conflict:
                self._mine = None
                return Grant(held=False, reason="lost the race while renewing")
        return self._holding(written)

    async def release(self) -> None:
        """Give the lease back as client-go's ``ReleaseOnCancel`` does: holder ``""``,
        ``leaseDurationSeconds`` 1, ``acquireTime`` = ``renewTime`` = now, the count
        kept; standbys of either kind take over at once."""
        mine, self._mine = self._mine, None
        if mine is None:
            return
        api = await self._connected()
        for _ in range(2):
            now = micro_time(self._clock.wall())
            released = replace(mine, holder="", duration=1, acquire_time=now,
                               renew_time=now)
            try:
                self._observer.observe(await api.replace(self._object, released))
                return
            except Conflict:
                current = await self._read(api)
                if not self._is_ours(current, mine):
                    return  # already someone else's: nothing of ours to give back
                assert current is not None
                mine = current

    async def describe(self) -> Holder:
        record = await self._read(await self._connected())
        if record is None:
            return Holder(holder=None)
        return Holder(holder=record.holder or None, fencing_token=record.transitions,
                      expires_at=record.expires_at())

    async def wait_for_change(self, timeout: float) -> None:
        """Return when the lease may be ours: released, gone, or run out on our clock."""
        self._ensure_watch()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            free_in = self._observer.free_in(self._identity)
            if left <= 0 or free_in <= 0:
                return
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, free_in))

    def stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()

    # -- internals ---------------------------------------------------------------------
    async def _connected(self) -> LeaseApi:
        self._api = await self._connect()
        return self._api

    async def _read(self, api: LeaseApi) -> Record | None:
        record = await api.get(self._object)
        self._observe(record)
        return record

    def _observe(self, record: Record | None) -> None:
        if self._observer.observe(record):
            self._changed.set()
            self._changed = asyncio.Event()

    def _holding(self, written: Record) -> Grant:
        self._observe(written)
        self._mine = written
        return Grant(held=True, valid_for=self._valid_for, fencing_token=written.transitions,
                     holder=self._identity)

    def _renewed(self, base: Record) -> Record:
        return replace(base, holder=self._identity, duration=self._duration,
                       renew_time=micro_time(self._clock.wall()))

    def _is_ours(self, current: Record | None, mine: Record) -> bool:
        return (current is not None and current.holder == self._identity
                and current.transitions == mine.transitions)

    def _ensure_watch(self) -> None:
        # Not before a call has connected: until then nothing was observed to wait for.
        if self._watch is not None or self._api is None:
            return
        loop = asyncio.get_running_loop()

        def deliver(record: Record | None) -> None:
            # Runs in the watch thread; the observer belongs to the event loop.
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(self._observe, record)

        self._watch = self._api.watch(self._object, deliver)
