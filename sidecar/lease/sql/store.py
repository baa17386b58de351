"""A RowStore over any (dialect, driver) pair."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from sidecar.base.errors import BackendError, NotFound
from sidecar.lease import pg_timeline
from sidecar.lease.pg_timeline import Timelines, checkpoint_age, claim_delay
from sidecar.lease.rowlease import Row
from sidecar.lease.sql.dialect import Dialect, Statement

log = logging.getLogger("sidecar.lease.sql")


class Driver(Protocol):
    """How statements reach a server. Errors are raised as one-line BackendErrors."""

    async def fetch(self, statement: Statement,
                    params: Mapping[str, object]) -> list[tuple[Any, ...]]: ...

    async def script(self, sql: str) -> None: ...

    async def wait_for_notify(self, channel: str, timeout: float, since: float,
                              payload: str | None = None) -> None:
        """Until a NOTIFY on ``channel`` (carrying ``payload``, a lease's name, when one
        is given) after ``since``, or ``timeout``."""
        ...

    async def close(self) -> None: ...


def _flag(value: object) -> bool:
    """A boolean column as drivers hand it over: psqlODBC sends ``'0'``/``'1'`` text
    (true for ``bool()``), asyncpg and SQL Server's ``BIT`` real booleans."""
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, str):
        return value.strip().lower() in ("1", "t", "true")
    return bool(value)


class SqlRowStore:
    """The row-lease statements of ``dialect`` run by ``driver``.

    ``replica=True`` makes :meth:`read` the replica read (no expiry filter, dirty read on
    SQL Server), for :class:`~sidecar.lease.rowlease.ReplicaCheck`.

    ``ensure_schema=True`` (``LEASE_ENSURE_SCHEMA``) runs the idempotent provisioning
    script before acquiring, until the table is known to exist. A role that may not
    create it is no crash: if the table is there anyway, acquiring just works; if not,
    the acquire's error names both causes (the elector logs it once, and the sidecar
    stays "not leader"), and the next acquire tries again.
    """

    def __init__(self, dialect: Dialect, driver: Driver, replica: bool = False,
                 ensure_schema: bool = False) -> None:
        self.dialect = dialect
        self.driver = driver
        # True once the table is known to exist (provisioned, or an acquire ran on it).
        self._schema_ready = not ensure_schema
        self._schema_lock = asyncio.Lock()
        self._read = dialect.read_replica if replica else dialect.read
        # When the last acquire was sent, and the last acquire of each name: a release
        # notified after it must wake us even if it arrived before we started waiting.
        self._last_acquire = float("-inf")
        self._acquired: dict[str, float] = {}
        # Server timelines this process has seen in its versions (PostgreSQL).
        self._timelines = Timelines()
        # The token era's (timeline, base, server start) as last read (pg_timeline;
        # dialects with an ``era`` only); None: read it before the next write.
        self._era: tuple[int, int, int] | None = None
        self._era_missing_logged = False

    async def _one(self, statement: Statement, params: Mapping[str, object]) -> Row | None:
        rows = await self.driver.fetch(statement, params)
        return self.dialect.decode(rows[0]) if rows else None

    async def acquire(self, name: str, owner: str, duration: float) -> Row | None:
        not_created = await self._ensure_schema()
        self._last_acquire = self._acquired[name] = asyncio.get_running_loop().time()
        try:
            rows = await self._write(self.dialect.acquire, {
                "name": name, "owner": owner, "duration": duration,
                "duration_ms": round(duration * 1000)})
        except NotFound as exc:
            raise _not_created(exc, not_created) from None
        self._schema_ready = True
        if not rows:
            return None
        columns = list(rows[0])
        timeline = None
        if self.dialect.acquire_reports_timeline:
            # Won or lost, the server's timeline is one this process has now seen.
            *columns, timeline = columns
            self._timelines.saw(int(timeline), asyncio.get_running_loop().time())
        after_release = False
        if self.dialect.acquire_reports_release:
            *columns, after_release = columns
        *columns, won = columns
        # Only ``won`` says we hold it: a row we only read may name us (a second process
        # with our identity); RowLease tells those apart.
        row = replace(self.dialect.decode(tuple(columns)), won=_flag(won))
        if not row.won:
            return row
        delay = 0.0 if timeline is None else await self._claim_delay(int(timeline), duration)
        return replace(row, claim_delay=delay, previous_claims_ended=_flag(after_release))

    async def _write(self, statement: Statement,
                     params: Mapping[str, object]) -> list[tuple[Any, ...]]:
        """A statement that draws a version: with the token era's parameters, read once
        and again when the server's timeline has moved since (the version comes out NULL
        and the write fails: then the era is read anew and the write sent once more)."""
        if self.dialect.era is None:
            return await self.driver.fetch(statement, params)
        for attempt in (1, 2):
            era = await self._token_era()
            try:
                return await self.driver.fetch(statement, {
                    **params, "era_tl": era[0], "era_base": era[1], "era_start": era[2]})
            except BackendError as exc:
                if attempt == 2 or not _null_version(exc):
                    raise
                self._era = None
        raise AssertionError("unreachable")

    async def _token_era(self) -> tuple[int, int, int]:
        """(timeline, base, server start) of the token era
        (:func:`sidecar.lease.pg_timeline.era_sql`); (-1, 0, 0) where the era table is
        missing: the era is the timeline, as before it."""
        if self._era is not None:
            return self._era
        assert self.dialect.era is not None
        try:
            rows = await self.driver.fetch(self.dialect.era, {})
        except NotFound:
            if not self._era_missing_logged:
                self._era_missing_logged = True
                log.warning("no token era table: after a pg_upgrade of a cluster that ever "
                            "failed over, fencing tokens would be smaller than before; "
                            "create it with `lease-sidecar schema --apply`", extra={
                                "schema": self.dialect.schema,
                                "table": pg_timeline.ERA_TABLE})
            rows = []
        self._era = (int(rows[0][0]), int(rows[0][1]), int(rows[0][2])) if rows else (-1, 0, 0)
        return self._era

    async def _claim_delay(self, timeline: int, duration: float) -> float:
        """How long a holder granted on the server's ``timeline`` waits before its first
        claim: a holder on the old primary may claim for up to ``duration`` after a
        promotion (:mod:`sidecar.lease.pg_timeline`)."""
        now = asyncio.get_running_loop().time()
        age = self._timelines.age(timeline, now)
        checkpoint = self.dialect.checkpoint
        if age < duration and checkpoint is not None:
            async def ask() -> tuple[Any, ...]:
                return (await self.driver.fetch(checkpoint, {}))[0]
            age = max(age, await checkpoint_age(ask, timeline, type(self.dialect).__name__))
        return claim_delay(duration, age)

    async def renew(self, name: str, owner: str, duration: float,
                    version: int) -> Row | None:
        rows = await self._write(self.dialect.renew, {
            "name": name, "owner": owner, "duration": duration, "version": version,
            "duration_ms": round(duration * 1000)})
        row = self.dialect.decode(rows[0]) if rows else None
        if row is not None and self._era is not None and self._era[0] > 0:
            # The write went through on the timeline the era was read on.
            self._timelines.saw(self._era[0], asyncio.get_running_loop().time())
        return row

    async def beat_group(self, owner: str, duration: float, held: Mapping[str, int],
                         member: str, advertise: bool,
                         members: str) -> tuple[dict[str, int], list[str]]:
        """A shard group's round trip (:class:`sidecar.lease.rowgroup.GroupStore`): one
        statement (``Dialect.group_beat``), whatever the number of shards."""
        statement = self.dialect.group_beat
        assert statement is not None, "this dialect has no shard groups"
        not_created = await self._ensure_schema()
        names = list(held)
        try:
            rows = await self._write(statement, {
                "names": names, "versions": [held[name] for name in names],
                "owner": owner, "duration": duration, "member": member,
                "advertise": int(advertise), "prefix": members})
        except NotFound as exc:
            raise _not_created(exc, not_created) from None
        renewed = {str(name): int(version) for kind, name, version in rows if kind == "lease"}
        if renewed and self._era is not None and self._era[0] > 0:
            # The writes went through on the timeline the era was read on.
            self._timelines.saw(self._era[0], asyncio.get_running_loop().time())
        return renewed, [str(name) for kind, name, _ in rows if kind == "member"]

    async def members(self, prefix: str) -> list[str]:
        """The live members of a shard group (``lease-sidecar status``)."""
        statement = self.dialect.group_members
        assert statement is not None, "this dialect has no shard groups"
        return [str(owner) for (owner,) in await self.driver.fetch(statement,
                                                                   {"prefix": prefix})]

    async def release(self, name: str, owner: str, version: int,
                      record: bool = False) -> None:
        await self.driver.fetch(self.dialect.release, {
            "name": name, "owner": owner, "version": version, "record": int(record)})

    async def read(self, name: str) -> Row | None:
        # A standby reads the hand-over hint before its first acquire: provision first
        # here too, or a fresh database answers that read with a missing table.
        not_created = await self._ensure_schema()
        try:
            return await self._one(self._read, {"name": name})
        except NotFound as exc:
            raise _not_created(exc, not_created) from None

    async def list_all(self) -> list[tuple[str, Row, bool]]:
        """Every row, expired ones included: ``(name, row, live)``."""
        rows = await self.driver.fetch(self.dialect.list_all, {})
        return [(row[0], self.dialect.decode(tuple(row[1:-1])), bool(row[-1])) for row in rows]

    async def wait_for_release(self, timeout: float, name: str | None = None) -> None:
        """Until a NOTIFY of ``name``'s release (or sweep) sent after our last acquire of
        it (of any name's, without one), or timeout. Per name, both the time and the
        wake-up: the leases of a shard group share this store, and another shard's
        acquire sent after our shard's release was notified made that release look old
        (it then woke nobody, and the shard's next holder came at its retry, a renew
        interval later); and every release woke every standby of the member, whose
        acquires all queued ahead of the one that could win."""
        if self.dialect.channel is None:
            # No wake-up channel (SQL Server): standbys notice on their next retry.
            await asyncio.sleep(timeout)
            return
        since = self._last_acquire if name is None else self._acquired.get(name, float("-inf"))
        await self.driver.wait_for_notify(self.dialect.channel, timeout, since, name)

    async def apply_schema(self) -> None:
        await self.driver.script(self.dialect.provision_script())

    async def _ensure_schema(self) -> BackendError | None:
        """Provision once (``ensure_schema``); the error when that failed this time."""
        if self._schema_ready:
            return None
        async with self._schema_lock:  # leases sharing the store provision once
            if self._schema_ready:
                return None
            try:
                await self.apply_schema()
            except BackendError as exc:
                return exc
            self._schema_ready = True
            log.info("lease table ready (created where it was missing)",
                     extra={"schema": self.dialect.schema, "table": self.dialect.table})
            return None

    async def close(self) -> None:
        await self.driver.close()


def _null_version(exc: BackendError) -> bool:
    """A write failed because its version came out NULL (the table refuses one): the era
    it was given is not the server's any more, or the token is out of range."""
    text = str(exc)
    return "null value" in text and '"version"' in text


def _not_created(missing: NotFound, not_created: BackendError | None) -> NotFound:
    """The missing table's error, naming why LEASE_ENSURE_SCHEMA did not create it."""
    if not_created is None:
        return missing
    return NotFound(f"{missing}; LEASE_ENSURE_SCHEMA could not create it: {not_created}")
