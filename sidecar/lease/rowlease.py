"""The TTL row-lease algorithm shared by sqlite, postgres-row and sqlserver.

One row per lease name; the row is the lock. A store (SQL plus a driver) runs the
statements; this module holds the rules that are the same everywhere:

- acquire is one round trip that sweeps expired rows, then inserts or takes over an
  expired row, or loses to a live row — also one that names *our* identity: acquire is
  only called while we do not hold the lease, so such a row belongs to a second process
  with our identity (or to our previous term, whose release failed). Refreshing it, as
  a re-entrant acquire would, gives two processes the same lease and the same token; we
  wait for it to expire instead, log a warning once and say so in the Grant (the
  elector counts it: ``lease_sidecar_duplicate_identity_total``). An acquire while
  holding is a renew;
- renew only touches a row we own that has not expired, by the database's clock, and
  (PostgreSQL) still carries the version of our last write: after a promotion a row that
  is missing or older than our last write means the lease is lost (fail closed);
- release ends only our row of this term. Where the store keeps a release record
  (PostgreSQL, SQLite) it expires the row in place and marks it released on that row's
  own version, and the next acquire that takes that very row over reports it
  (``Grant.previous_claims_ended``: the elector releases only once our claims have run
  out, so the next holder need not wait a claim horizon). A row deleted or edited by
  hand, swept, or released by an older version carries no such record;
- a server-assigned version that only grows is the fencing token;
- optionally, an acquisition counts only once a read replica shows the same version.

Guarantee: when ``try_acquire``/``try_renew`` returns ``held``, the row's expiry was set
by the server to (server now + duration) *after* the request was sent, so nobody can
take the row over for ``duration`` seconds from the send time. We subtract a safety
margin for clock-rate differences between this host and the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from sidecar.base.clock import Clock, SystemClock
from sidecar.base.errors import BackendError
from sidecar.lease import Grant, Holder
from sidecar.settings import Settings, Timing

log = logging.getLogger("sidecar.lease")

# The hand-over hint of lease key K is the row K + HINT_SUFFIX ("#" is in no lease name):
# an ordinary row whose owner is the named successor and whose expiry bounds the hint.
HINT_SUFFIX = "#next"


def is_hint(key: str) -> bool:
    """A hand-over hint row, not a lease (``lease-sidecar status`` leaves it out)."""
    return key.endswith(HINT_SUFFIX)


# A shard group's member record of group key G is the row G + MEMBER_MARK + a digest of
# the member's identity (:mod:`sidecar.lease.rowgroup`).
MEMBER_MARK = "#member#"


def is_side_row(key: str) -> bool:
    """A row that is not a lease: a hand-over hint or a member record ("#" is in no
    lease name)."""
    return "#" in key


@dataclass(frozen=True)
class Row:
    owner: str
    version: int
    expires_at: datetime | None = None
    # From acquire: this very statement inserted or took over the row. False: it only
    # read a live row (possibly one naming us, written by another process).
    won: bool = True
    # From a won acquire: seconds from the reply before the first claim (a server that
    # may have been promoted while an earlier holder still claimed; Grant.claim_delay).
    claim_delay: float = 0.0
    # From a won acquire: the row taken over carried the release record of its own
    # term (Grant.previous_claims_ended).
    previous_claims_ended: bool = False


class Refused(BackendError):
    """Raised by a store that knows the lease cannot be held now, and that a row of ours
    is already gone (SQLite: the database file was replaced, or is in its hold-off; or
    the lease is free but a live hand-over hint names another contender). The lease
    answers "not held" with this as the reason, and a release has nothing to do."""


class RowStore(Protocol):
    """The statements of the row-lease algorithm for one database."""

    async def acquire(self, name: str, owner: str, duration: float) -> Row | None:
        """Run the one-round-trip acquire; return the row as it stands afterwards."""
        ...

    async def renew(self, name: str, owner: str, duration: float,
                    version: int) -> Row | None:
        """Extend our unexpired row whose version is ``version`` (our last write, where
        the store checks it); ``None`` when it is not ours any more."""
        ...

    async def release(self, name: str, owner: str, version: int,
                      record: bool = False) -> None:
        """End our row of the term whose last write has ``version``; with ``record``,
        record the release where the store can (see the module doc)."""
        ...

    async def read(self, name: str) -> Row | None: ...

    async def wait_for_release(self, timeout: float, name: str | None = None) -> None:
        """Sleep up to ``timeout``; return early when some lease was released since our
        last acquire of ``name`` (of any name, without one)."""
        ...

    async def close(self) -> None: ...


def _release_to(store: RowStore
                ) -> Callable[[str, str, int, bool, str, str, float], Awaitable[None]] | None:
    """The store's optional
    ``release_to(name, owner, version, record, hint, successor, bound)``:
    release and write the hand-over hint in one commit
    (:meth:`.sqlite.store.SqliteStore.release_to`)."""
    method = getattr(store, "release_to", None)
    return method if callable(method) else None


class RenewBatch(Protocol):
    """Renews shared by the leases of a shard group (:class:`sidecar.lease.beats.Beats`):
    a lease registers the version its acquire won, its renews are answered from the
    group's round trips, and it is forgotten before its release."""

    def register(self, key: str, value: int) -> int: ...

    async def renewed(self, key: str, registration: int,
                      asked: float) -> tuple[int | None, float]: ...

    async def forget(self, key: str, registration: int) -> int | None: ...


@dataclass
class ReplicaCheck:
    store: RowStore
    timeout: float
    poll_interval: float = 0.05


class RowLease:
    """A :class:`~sidecar.lease.Lease` over any :class:`RowStore`; ``key`` is the row's
    name, ``name`` the lease's."""

    # A row lease learns of a loss only when a renew is refused.
    lost: asyncio.Event | None = None

    def __init__(
        self,
        store: RowStore,
        name: str,
        key: str,
        owner: str,
        duration: float,
        safety_margin: float,
        replica: ReplicaCheck | None = None,
        clock: Clock | None = None,
        batch: RenewBatch | None = None,
    ) -> None:
        self.name = name
        self._store = store
        self._key = key
        self._owner = owner
        self._duration = duration
        self._valid_for = duration - safety_margin
        self._margin = safety_margin
        self._replica = replica
        self._clock = clock or SystemClock()
        self._token: int | None = None
        # The version of our last write (renews draw new ones on PostgreSQL).
        self._version: int | None = None
        # Monotonic: until when a row we wrote may still be live (ours, not a duplicate's).
        self._own_row_until = float("-inf")
        self._duplicate_warned = False
        # (identity, bound): the hint the release writes, where the store writes both in
        # one commit (:meth:`hand_to`).
        self._successor: tuple[str, float] | None = None
        # A shard group's renews (None: this lease renews on its own), and this term's
        # registration with it.
        self._batch = batch
        self._registration = 0

    async def try_acquire(self) -> Grant:
        if self._token is not None:
            return await self.try_renew()  # we hold it: extend, same term, same token
        sent = self._clock.monotonic()
        try:
            row = await self._store.acquire(self._key, self._owner, self._duration)
        except Refused as exc:
            return Grant(held=False, reason=str(exc))
        if row is None or row.owner != self._owner:
            return Grant(held=False, holder=row.owner if row else None,
                         reason=f"held by {row.owner}" if row else "no row")
        if not row.won:
            return self._same_identity(row, sent)
        if self._replica and not await self._replica_confirms(row.version):
            await self._store.release(self._key, self._owner, row.version)
            return Grant(held=False, holder=None, reason="replica did not confirm in time")
        self._token = self._version = row.version
        if self._batch is not None:
            self._registration = self._batch.register(self._key, row.version)
        self._successor = None  # named in an earlier term that ended without a release
        self._own_row_until = sent + self._duration + self._margin
        self._duplicate_warned = False
        return Grant(held=True, valid_for=self._valid_for, fencing_token=self._token,
                     holder=self._owner, claim_delay=row.claim_delay,
                     previous_claims_ended=row.previous_claims_ended)

    def _same_identity(self, row: Row, sent: float) -> Grant:
        """A live row names us, but we do not hold the lease: wait for it to expire."""
        if sent < self._own_row_until:
            return Grant(held=False, holder=row.owner,
                         reason="our previous term's row has not expired yet")
        if not self._duplicate_warned:
            self._duplicate_warned = True
            log.warning("another live holder has our identity; not taking the lease over "
                        "until its row expires (identities must be unique)", extra={
                            "lease": self.name, "identity": self._owner,
                            "expires_at": row.expires_at.isoformat() if row.expires_at
                            else None})
        return Grant(held=False, holder=row.owner, duplicate_identity=True,
                     reason="held by another process with our identity")

    async def try_renew(self) -> Grant:
        sent = self._clock.monotonic()
        if self._version is None:
            return Grant(held=False, reason="not held")
        if self._batch is not None:
            return await self._renewed_with_group(sent)
        try:
            row = await self._store.renew(self._key, self._owner, self._duration,
                                          self._version)
        except Refused as exc:
            return Grant(held=False, reason=str(exc))
        if row is None:
            self._token = self._version = None
            return Grant(held=False, reason="row expired, taken over, or missing or older "
                                            "than our last write (a promotion)")
        self._version = row.version
        self._own_row_until = sent + self._duration + self._margin
        return Grant(held=True, valid_for=self._valid_for, fencing_token=self._token,
                     holder=self._owner)

    async def _renewed_with_group(self, asked: float) -> Grant:
        """The renew of a shard group's lease, from the group's round trip sent at
        ``sent``: valid from that send time, not from ``asked`` (which comes after it)."""
        assert self._batch is not None
        version, sent = await self._batch.renewed(self._key, self._registration, asked)
        if version is None:
            self._token = self._version = None
            return Grant(held=False, reason="row expired, taken over, or missing or older "
                                            "than our last write (a promotion)")
        self._version = version
        self._own_row_until = sent + self._duration + self._margin
        return Grant(held=True, valid_for=max(0.0, self._valid_for - (asked - sent)),
                     fencing_token=self._token, holder=self._owner)

    async def release(self, record: bool = False) -> None:
        version = self._version
        self._token = self._version = None
        successor, self._successor = self._successor, None
        if version is None:
            return  # nothing held: nothing of ours to end
        if self._batch is not None:
            # No round trip renews it from here on; one renewing it now ends first, and
            # the release names the version it wrote.
            version = await self._batch.forget(self._key, self._registration) or version
        release_to = _release_to(self._store)
        with contextlib.suppress(Refused):
            if successor is not None and release_to is not None:
                await release_to(self._key, self._owner, version, record,
                                 self._key + HINT_SUFFIX, *successor)
            else:
                await self._store.release(self._key, self._owner, version, record)

    async def describe(self) -> Holder:
        row = await self._store.read(self._key)
        if row is None:
            return Holder(holder=None)
        return Holder(holder=row.owner, fencing_token=row.version, expires_at=row.expires_at)

    async def wait_for_change(self, timeout: float) -> None:
        await self._store.wait_for_release(timeout, self._key)

    # -- the Successor capability (sidecar.lease.Successor) ----------------------------
    async def hand_to(self, identity: str, bound: float) -> None:
        """Write the hint row: owned by ``identity``, expiring ``bound`` seconds from
        now by the database's clock. The store's own acquire writes it, so a plain role
        that can hold a lease can write it, and no table change is needed; a live hint
        naming someone else (an earlier hand-over) is removed first. A store that can
        release and write the hint in one commit (SQLite, whose commits are disk syncs)
        does both in :meth:`release`: standbys see the free lease and the hint at once."""
        if _release_to(self._store) is not None:
            self._successor = (identity, bound)
            return
        hint = self._key + HINT_SUFFIX
        earlier = await self._store.read(hint)
        if earlier is not None and earlier.owner != identity:
            await self._store.release(hint, earlier.owner, earlier.version)
        await self._store.acquire(hint, identity, bound)

    async def handing_to_other(self) -> str | None:
        hint = self._key + HINT_SUFFIX
        row = await self._store.read(hint)
        if row is None:
            return None
        if row.owner != self._owner:
            return row.owner
        if self._token is not None:
            # Named, and now holding (the elector asks right after a won acquire): the
            # hint has done its job. Left to live out its bound (a lease duration), it
            # kept the other standbys standing aside, deaf to wake-ups, through this
            # term; a hand-over to one of them then reached it only at its next retry
            # (in real pods: a leader deleted within a lease duration of the last
            # hand-over took a renew interval longer to replace, 6 of 10 times).
            with contextlib.suppress(Refused):
                await self._store.release(hint, row.owner, row.version)
        return None

    async def _replica_confirms(self, version: int) -> bool:
        assert self._replica is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._replica.timeout
        while True:
            try:
                row = await self._replica.store.read(self._key)
            except Exception:
                row = None
            if row is not None and row.owner == self._owner and row.version == version:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(self._replica.poll_interval)


class RowBackend:
    """Hands out one :class:`RowLease` per name over one shared store (and, where
    acquisitions need a replica's confirmation, a replica store)."""

    # Nothing found once connected can make a row backend unsafe.
    misconfigured: asyncio.Event | None = None
    misconfiguration: str | None = None

    def __init__(self, store: RowStore, *, key: Callable[[str], str], identity: str,
                 timing: Timing, clock: Clock, replica: ReplicaCheck | None = None) -> None:
        self._store = store
        self._key = key
        self._identity = identity
        self._timing = timing
        self._clock = clock
        self._replica = replica

    @classmethod
    def from_settings(cls, settings: Settings, clock: Clock, store: RowStore,
                      replica: RowStore | None = None) -> RowBackend:
        check = ReplicaCheck(replica, settings.store.replica_timeout) if replica else None
        return cls(store, key=settings.store.key, identity=settings.identity,
                   timing=settings.timing, clock=clock, replica=check)

    @property
    def store(self) -> RowStore:
        return self._store

    def lease(self, name: str, batch: RenewBatch | None = None) -> RowLease:
        """The lease of ``name``; with ``batch``, renewed with a shard group."""
        return RowLease(self._store, name, self._key(name), self._identity,
                        duration=self._timing.lease_duration,
                        safety_margin=self._timing.safety_margin, replica=self._replica,
                        clock=self._clock, batch=batch)

    async def close(self) -> None:
        await self._store.close()
        if self._replica is not None:
            await self._replica.store.close()
