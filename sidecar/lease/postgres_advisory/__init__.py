"""``postgres``: a session-level advisory lock on a dedicated, non-pooled connection.

Each lease name gets its own ``asyncpg.connect`` connection (never a pool: a pooled or
PgBouncer-multiplexed session could hand the lock to someone else's code, or lose it).
The lock lives exactly as long as that session, so:

- no schema and no rows; the lock id is a hash of the lease's key (:func:`.sql.lock_id`);
- a crashed holder's lock passes on the moment PostgreSQL ends its session; standbys wait
  for it *inside the server* (``pg_advisory_lock`` under ``lock_timeout``), so they get
  it within milliseconds without polling. Because of that, the new holder waits one
  ``claim_horizon`` before it publishes (the elector's rule for every backend), letting
  the dead holder's last claims run out;
- the holder heartbeats (checks ``pg_locks`` for its own session) every renew interval; a
  heartbeat that has not succeeded within ``renew_deadline`` ends the claim
  (``Grant.valid_for``), and a dropped connection (asyncpg termination listener) ends
  it at once: ``try_renew`` then answers "not held" without a round trip and
  ``AdvisoryLease.lost`` is set for an elector that wants to wake up;
- the session's own settings make the *server* wait longer than the client before it
  ends a silent session (:func:`.session.session_settings`);
- fencing token: ``timeline * 2^42 + txid``, the transaction id drawn right after the lock
  was granted and committed synchronously, so it grows across holders, across a server
  crash and across a promotion (:mod:`sidecar.lease.pg_timeline`); a holder granted on a
  timeline that may have begun less than ``renew_deadline`` ago waits that long before
  its first claim, as after a server restart.

Behind a transaction pooler the lock cannot work (:mod:`.session`): each lock statement
checks that it runs on our own server session, and after a grant through a pooler a fresh
connection checks that it gets a session of its own. Any sign of a pooler is a
misconfiguration that never heals: the lease fails closed at once, logs one line naming
the pooler and ``postgres-row``, and sets ``misconfigured``, on which the runtime exits
with code 2.

Modules: :mod:`.sql` (statements, lock id), :mod:`.session` (connecting, session settings,
the session a lease holds), :mod:`.lease` (one lease name).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg

from sidecar.base.clock import Clock
from sidecar.base.dsn import check_postgres_url
from sidecar.base.redact import redact
from sidecar.lease import BackendEntry, LeaseInfo
from sidecar.lease.pg_timeline import Timelines, era_ddl
from sidecar.lease.postgres_advisory.group import (
    holder_name,
    list_members,
    make_advisory_group,
)
from sidecar.lease.postgres_advisory.lease import AdvisoryLease
from sidecar.lease.postgres_advisory.session import (
    DB_ERRORS,
    Connector,
    close,
    create_era_table,
)
from sidecar.lease.postgres_advisory.sql import ALL_LOCKS, key_from_halves, lock_id
from sidecar.settings import Settings

log = logging.getLogger("sidecar.lease.postgres")


class AdvisoryBackend:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._connector = connector(settings)
        self._leases: dict[str, AdvisoryLease] = {}
        self._timelines = Timelines()
        # Set once a transaction pooler was seen on any lease: the runtime exits with the
        # code of a bad setting (the DSN names a pooler the advisory lock cannot use).
        self.misconfigured = asyncio.Event()
        self.misconfiguration: str | None = None

    def lease(self, name: str) -> AdvisoryLease:
        if name not in self._leases:
            self._leases[name] = AdvisoryLease(
                name, lock_id(self._settings.store.key(name)), self._connector,
                self._settings.timing, self._settings.identity, on_pooler=self._pooler_seen,
                timelines=self._timelines)
        return self._leases[name]

    def _pooler_seen(self, name: str, message: str) -> None:
        if self.misconfiguration is None:
            self.misconfiguration = message
            log.error(message, extra={"lease": name, "identity": self._settings.identity,
                                      "dsn": redact(self._settings.store.dsn)})
        # Every lease goes over the same DSN: none of them may claim any more.
        for lease in self._leases.values():
            if lease.pooler is None:
                lease.pooler_seen("another lease of this sidecar saw it")
        self.misconfigured.set()

    async def close(self) -> None:
        for lease in self._leases.values():
            await lease.close()


def connector(settings: Settings) -> Connector:
    return Connector(settings.store.dsn, settings.identity, settings.timing,
                     settings.store.schema, settings.store.ensure_schema)


def schema_sql(settings: Settings) -> str:
    """The one table the advisory lock uses, and only if it is there: the token era's
    (:mod:`sidecar.lease.pg_timeline`), which keeps tokens growing across a pg_upgrade."""
    return era_ddl(settings.store.schema)


async def apply_schema(settings: Settings) -> None:
    """``schema --apply`` (LEASE_ENSURE_SCHEMA creates it when a session finds it
    missing, :class:`~.session.Connector`)."""
    db = connector(settings)
    conn = (await db.open()).conn
    try:
        await create_era_table(conn, settings.store.schema)
    except DB_ERRORS as exc:
        raise db.error("create the token era table", exc) from None
    finally:
        await close(conn)


async def list_leases(settings: Settings, names: tuple[str, ...] | None) -> list[LeaseInfo]:
    """For ``lease-sidecar status``, from pg_locks: read-only, no schema, no lock taken.

    A lock id is a hash, so the leases cannot be listed: the names asked for (else the
    configured ones) are looked up. One "exists" while a session holds or awaits its
    lock; the holder's fencing token lives only in the holder (``GET /leader``).
    """
    db = connector(settings)
    conn = (await db.open()).conn
    try:
        rows = await conn.fetch(ALL_LOCKS)
    except DB_ERRORS as exc:
        raise db.error("list locks", exc) from None
    finally:
        await close(conn)
    sessions: dict[int, list[asyncpg.Record]] = {}
    for row in rows:
        sessions.setdefault(key_from_halves(row[0], row[1]), []).append(row)
    result = []
    for name in names or settings.names:
        key = lock_id(settings.store.key(name))
        if key not in sessions:
            continue
        holder = next((r for r in sessions[key] if r["granted"]), None)
        details: dict[str, Any] = {"lock_id": key,
                                   "waiting": sum(not r["granted"] for r in sessions[key])}
        if holder is not None:
            details.update(pid=holder["pid"], backend_start=holder["backend_start"])
        result.append(LeaseInfo(lease=name, details=details,
                                holder=holder_name(holder["application_name"]) if holder else None))
    return result


def create(settings: Settings, clock: Clock) -> AdvisoryBackend:
    """The backend; the lock needs no clock (the server's session decides)."""
    return AdvisoryBackend(settings)


ENTRY = BackendEntry(create=create, holds_by="session", needs_dsn=True,
                     check_dsn=check_postgres_url, list_leases=list_leases,
                     schema_sql=schema_sql, apply_schema=apply_schema,
                     shard_group=make_advisory_group, list_members=list_members)
