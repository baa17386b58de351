"""``postgres-row``: the TTL row lease (the SQL Server design) in PostgreSQL, over asyncpg.

Guarantees (see sidecar.lease.rowlease): a holder is granted ``lease_duration -
safety_margin`` from the send time of its acquire/renew; expiry is set and compared by
the server's ``now()``; the fencing token is drawn from a sequence, so it only grows
across holders even though release deletes the row. A release (and the acquire-time
sweep of expired rows) sends NOTIFY, so standbys LISTENing take over at once; NOTIFY is a
best-effort wake-up only — without it standbys notice on their next retry.

No statement keeps session state, so the backend works behind a transaction-pooling
proxy (PgBouncer ``pool_mode=transaction``, any version): the driver finds the pooler
when it connects and then uses unnamed statements only and no LISTEN, so standbys poll
at their retry interval (see :mod:`sidecar.lease.sql.asyncpg_driver`).
"""

from __future__ import annotations

from sidecar.clock import Clock
from sidecar.dsn import check_postgres_url
from sidecar.lease import BackendEntry, LeaseInfo
from sidecar.lease.sql.asyncpg_driver import AsyncpgDriver
from sidecar.lease.sql.dialect import PostgresDialect
from sidecar.lease.sql.store import SqlRowBackend, SqlRowStore, check_names, request_timeout
from sidecar.lease.sql.store import list_leases as _list_leases
from sidecar.settings import Settings


def _dialect(settings: Settings) -> PostgresDialect:
    return PostgresDialect(settings.store.schema, settings.store.table_name)


def _store(settings: Settings, dsn: str, replica: bool = False) -> SqlRowStore:
    driver = AsyncpgDriver(dsn, timeout=request_timeout(settings),
                           label="postgres-row replica" if replica else "postgres-row")
    return SqlRowStore(_dialect(settings), driver, replica=replica)


def create(settings: Settings, clock: Clock) -> SqlRowBackend:
    replica_dsn = settings.store.replica_dsn
    replica = _store(settings, replica_dsn, replica=True) if replica_dsn else None
    return SqlRowBackend(settings, _store(settings, settings.store.dsn or ""), replica)


def schema_sql(settings: Settings) -> str:
    return _dialect(settings).schema_script()


async def apply_schema(settings: Settings) -> None:
    store = _store(settings, settings.store.dsn or "")
    try:
        # Several sidecars may start at once; CREATE … IF NOT EXISTS alone can still race
        # on the catalog, so provisioning holds a transaction-scoped advisory lock.
        lock = f"lease-sidecar schema {store.dialect.channel}"
        await store.driver.script(f"SELECT pg_advisory_xact_lock(hashtext('{lock}'));\n"
                                  + store.dialect.schema_script())
    finally:
        await store.close()


async def list_leases(settings: Settings,
                      names: tuple[str, ...] | None) -> list[LeaseInfo]:
    return await _list_leases(settings, _store(settings, settings.store.dsn or ""))


ENTRY = BackendEntry(create=create, needs_dsn=True, takes_replica=True,
                     check_dsn=check_postgres_url, validate=check_names,
                     schema_sql=schema_sql, apply_schema=apply_schema, list_leases=list_leases)
