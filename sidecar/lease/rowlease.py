"""The TTL row-lease algorithm shared by sqlite, postgres-row and sqlserver.

One row per lease name; the row is the lock. A store (SQL plus a driver) runs the
statements; this module holds the rules that are the same everywhere:

- acquire is one round trip that sweeps expired rows, then inserts, takes over an
  expired row, refreshes our own row (re-entrant) or loses to a live foreign owner;
- renew only touches a row we own that has not expired, by the database's clock;
- release deletes only a row we own;
- a server-assigned version that only grows is the fencing token;
- optionally, an acquisition counts only once a read replica shows the same version.

Guarantee: when ``try_acquire``/``try_renew`` returns ``held``, the row's expiry was set
by the server to (server now + duration) *after* the request was sent, so nobody can
take the row over for ``duration`` seconds from the send time. We subtract a safety
margin for clock-rate differences between this host and the server.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from sidecar.lease import Grant, Holder

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


def validate_identifier(kind: str, value: str) -> str:
    """Schema and table names end up in SQL text, so only plain identifiers pass."""
    if not _IDENTIFIER.match(value):
        raise ValueError(
            f"{kind} {value!r} is not a plain identifier (letters, digits, _; max 63)"
        )
    return value


@dataclass(frozen=True)
class Row:
    owner: str
    version: int
    expires_at: datetime | None = None


class RowStore(Protocol):
    """The statements of the row-lease algorithm for one database."""

    async def acquire(self, name: str, owner: str, duration: float, metadata: str) -> Row | None:
        """Run the one-round-trip acquire; return the row as it stands afterwards."""
        ...

    async def renew(self, name: str, owner: str, duration: float) -> Row | None:
        """Extend our unexpired row; ``None`` when it is not ours any more."""
        ...

    async def release(self, name: str, owner: str) -> None: ...

    async def read(self, name: str) -> Row | None: ...

    async def wait_for_release(self, timeout: float) -> None:
        """Sleep up to ``timeout``; return early when some lease was released."""
        ...


@dataclass
class ReplicaCheck:
    store: RowStore
    timeout: float
    poll_interval: float = 0.05


class RowLease:
    """A :class:`~sidecar.lease.Lease` over any :class:`RowStore`."""

    def __init__(
        self,
        store: RowStore,
        name: str,
        row_name: str,
        owner: str,
        duration: float,
        safety_margin: float,
        metadata: str = "",
        replica: ReplicaCheck | None = None,
    ) -> None:
        self.name = name
        self._store = store
        self._row_name = row_name
        self._owner = owner
        self._duration = duration
        self._valid_for = duration - safety_margin
        self._metadata = metadata
        self._replica = replica
        self._token: int | None = None

    async def try_acquire(self) -> Grant:
        row = await self._store.acquire(self._row_name, self._owner, self._duration, self._metadata)
        if row is None or row.owner != self._owner:
            return Grant(held=False, holder=row.owner if row else None,
                         reason=f"held by {row.owner}" if row else "no row")
        if self._replica and not await self._replica_confirms(row.version):
            await self._store.release(self._row_name, self._owner)
            return Grant(held=False, holder=None, reason="replica did not confirm in time")
        # Re-entrant refresh keeps the term's token; a new term takes the new version.
        if self._token is None:
            self._token = row.version
        return Grant(held=True, valid_for=self._valid_for, fencing_token=self._token,
                     holder=self._owner)

    async def try_renew(self) -> Grant:
        row = await self._store.renew(self._row_name, self._owner, self._duration)
        if row is None:
            self._token = None
            return Grant(held=False, reason="row expired or taken over")
        return Grant(held=True, valid_for=self._valid_for, fencing_token=self._token,
                     holder=self._owner)

    async def release(self) -> None:
        self._token = None
        await self._store.release(self._row_name, self._owner)

    async def describe(self) -> Holder:
        row = await self._store.read(self._row_name)
        if row is None:
            return Holder(holder=None)
        return Holder(holder=row.owner, fencing_token=row.version, expires_at=row.expires_at)

    async def wait_for_change(self, timeout: float) -> None:
        await self._store.wait_for_release(timeout)

    async def _replica_confirms(self, version: int) -> bool:
        assert self._replica is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._replica.timeout
        while True:
            try:
                row = await self._replica.store.read(self._row_name)
            except Exception:
                row = None
            if row is not None and row.owner == self._owner and row.version == version:
                return True
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(self._replica.poll_interval)
