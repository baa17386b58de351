"""The shard group of the row backends (``sqlite``, ``postgres-row``): member records are
rows of the lease table, renewed with every shard row in one round trip.

A member's record is the row ``{group key}#member#{digest of its identity}`` ("#" is in
no lease name, so it never meets a lease; ``lease-sidecar status`` leaves it out), owned
by the member, expiring one lease duration after its last round trip by the database's
clock, like a lease row; the acquire's sweep removes it once it has run out. The round
trip (a store's ``beat_group``: one SQLite transaction, one PostgreSQL statement)
renews every shard row the member holds exactly as a renew does (ours, unexpired; on
PostgreSQL our last write's version or a later one), writes or drops the member row,
and reads the live members' identities.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol, cast

from sidecar.base.clock import Clock
from sidecar.lease import Backend
from sidecar.lease.beats import BeatingGroup, Beats
from sidecar.lease.rowlease import MEMBER_MARK, Refused, RowBackend, RowLease
from sidecar.settings import Settings, Timing


class GroupStore(Protocol):
    """What a row store adds for a shard group."""

    async def beat_group(self, owner: str, duration: float, held: Mapping[str, int],
                         member: str, advertise: bool,
                         members: str) -> tuple[dict[str, int], list[str]]:
        """One round trip: renew each held row (key -> version of our last write) as
        ``renew`` does; write the row ``member`` for ``owner`` with the same expiry, or
        with ``advertise`` False delete it; read the owners of the live rows whose key
        starts with ``members``. Returns (key -> new version of each row renewed, the
        live members)."""
        ...


def member_key(group_key: str, identity: str) -> str:
    """The member row of ``identity`` in the group: a digest, so any identity fits."""
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return f"{group_key}{MEMBER_MARK}{digest}"


class RowShardGroup(BeatingGroup):
    """A :class:`~sidecar.lease.ShardGroup` over a row backend and its store."""

    def __init__(self, backend: RowBackend, store: GroupStore, group_key: str,
                 identity: str, timing: Timing, clock: Clock) -> None:
        self._backend = backend
        self._store = store
        self._identity = identity
        self.member = identity
        self._duration = timing.lease_duration
        self._member = member_key(group_key, identity)
        self._members = group_key + MEMBER_MARK
        self._beats = Beats(self._round_trip, timing, clock, group_key)

    def lease(self, name: str) -> RowLease:
        return self._backend.lease(name, batch=self._beats)

    def retire(self, name: str) -> None:
        """Nothing to close: the lease keeps nothing open of its own."""

    async def _round_trip(self, held: Mapping[str, int],
                          advertise: bool) -> tuple[Mapping[str, int], tuple[str, ...]]:
        try:
            renewed, members = await self._store.beat_group(
                self._identity, self._duration, held, self._member, advertise,
                self._members)
        except Refused:
            # The store knows no row of ours can be there (the SQLite file was replaced):
            # every lease's renew is refused, as a lone renew would be.
            return {}, ()
        return renewed, tuple(sorted(set(members)))


def make_row_group(backend: Backend, settings: Settings, clock: Clock,
                   group_key: str) -> RowShardGroup:
    """``BackendEntry.shard_group`` of the row backends whose store has ``beat_group``."""
    assert isinstance(backend, RowBackend)
    store = backend.store
    assert callable(getattr(store, "beat_group", None)), "the store has no shard groups"
    return RowShardGroup(backend, cast(GroupStore, store), group_key, settings.identity,
                         settings.timing, clock)
