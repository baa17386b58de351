"""A lease backend that lives in this process's memory, written by the recipe of
docs/adding-a-backend.md: one file, a Lease, a Backend, ``create`` and ``ENTRY``.

It is a real backend — TTLs on the injected clock, a fencing token that only grows, a
wake-up on release — shared by the contenders of one process only, so the unit tests can
run real electors against it without a server. It is not registered in
``sidecar.lease``: the tests call its ``ENTRY`` directly.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from sidecar.base.clock import Clock
from sidecar.lease import BackendEntry, Grant, Holder
from sidecar.settings import Settings, Timing


@dataclass
class _Record:
    holder: str | None = None
    expires: float = 0.0  # monotonic, on the shared clock
    token: int = 0


@dataclass
class MemoryStore:
    """What a database would hold: one record per key, and a way to wait for changes."""

    records: dict[str, _Record] = field(default_factory=dict)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class MemoryLease:
    # Nothing tells this backend of a loss between renews.
    lost: asyncio.Event | None = None

    def __init__(self, store: MemoryStore, name: str, key: str, identity: str,
                 timing: Timing, clock: Clock) -> None:
        self.name = name
        self._store = store
        self._key = key
        self._identity = identity
        self._timing = timing
        self._clock = clock

    def _record(self) -> _Record:
        return self._store.records.setdefault(self._key, _Record())

    def _granted(self, record: _Record) -> Grant:
        record.expires = self._clock.monotonic() + self._timing.lease_duration
        return Grant(held=True, valid_for=self._timing.validity, fencing_token=record.token,
                     holder=self._identity)

    async def try_acquire(self) -> Grant:
        record = self._record()
        if record.holder == self._identity:
            return self._granted(record)
        if record.holder is not None and record.expires > self._clock.monotonic():
            return Grant(held=False, holder=record.holder, reason=f"held by {record.holder}")
        record.holder = self._identity
        record.token += 1  # a new term: downstream systems see a larger token
        return self._granted(record)

    async def try_renew(self) -> Grant:
        record = self._record()
        if record.holder != self._identity or record.expires <= self._clock.monotonic():
            return Grant(held=False, holder=record.holder, reason="expired or taken over")
        return self._granted(record)

    async def release(self, record: bool = False) -> None:
        kept = self._record()  # no release record here: every new term waits its horizon
        if kept.holder == self._identity:
            kept.holder = None
            async with self._store.changed:
                self._store.changed.notify_all()

    async def describe(self) -> Holder:
        record = self._record()
        live = record.holder is not None and record.expires > self._clock.monotonic()
        return Holder(holder=record.holder if live else None, fencing_token=record.token)

    async def wait_for_change(self, timeout: float) -> None:
        async with self._store.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._store.changed.wait(), timeout)


class MemoryBackend:
    # Nothing found once connected can make this backend unsafe.
    misconfigured: asyncio.Event | None = None
    misconfiguration: str | None = None

    def __init__(self, settings: Settings, clock: Clock, store: MemoryStore) -> None:
        self._settings = settings
        self._clock = clock
        self._store = store

    def lease(self, name: str) -> MemoryLease:
        return MemoryLease(self._store, name, self._settings.store.key(name),
                           self._settings.identity, self._settings.timing, self._clock)

    async def close(self) -> None:
        return None


# One process, one "database": every backend created here shares it.
SHARED = MemoryStore()


def create(settings: Settings, clock: Clock) -> MemoryBackend:
    return MemoryBackend(settings, clock, SHARED)


ENTRY = BackendEntry(create=create)
