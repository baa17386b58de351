"""``sqlserver``: the TTL row lease of the SQL Server lease design, over pyodbc.

``[lease].[Leases]`` (docs/design.md); acquire is one batch (sweep ``DELETE`` + ``MERGE …
WITH (UPDLOCK, HOLDLOCK, ROWLOCK)``), renew and release are single owner-filtered
statements, all time is ``SYSDATETIMEOFFSET()``, and ``RowVersion`` is the fencing token.
With ``LEASE_REPLICA_DSN`` an acquisition counts only once the replica shows the same
``RowVersion`` (read ``WITH (READUNCOMMITTED)``) within ``LEASE_REPLICA_TIMEOUT``.

There is no wake-up channel: standbys notice a release on their next retry
(``LEASE_RENEW_INTERVAL``). The ODBC driver is ``LEASE_ODBC_DRIVER`` (default FreeTDS)
when the connection string names none.
"""

from __future__ import annotations

from sidecar.clock import Clock
from sidecar.dsn import check_odbc
from sidecar.lease import BackendEntry, LeaseInfo
from sidecar.lease.sql.dialect import TsqlDialect
from sidecar.lease.sql.pyodbc_driver import PyodbcDriver
from sidecar.lease.sql.store import SqlRowBackend, SqlRowStore, check_names, request_timeout
from sidecar.lease.sql.store import list_leases as _list_leases
from sidecar.settings import Settings


def _store(settings: Settings, dsn: str, replica: bool = False) -> SqlRowStore:
    timeout = request_timeout(settings)
    driver = PyodbcDriver(dsn, odbc_driver=settings.store.odbc_driver, login_timeout=timeout,
                          query_timeout=timeout,
                          label="sqlserver replica" if replica else "sqlserver")
    return SqlRowStore(TsqlDialect(settings.store.schema, settings.store.table_name), driver,
                       replica=replica)


def create(settings: Settings, clock: Clock) -> SqlRowBackend:
    replica_dsn = settings.store.replica_dsn
    replica = _store(settings, replica_dsn, replica=True) if replica_dsn else None
    return SqlRowBackend(settings, _store(settings, settings.store.dsn or ""), replica)


def schema_sql(settings: Settings) -> str:
    return TsqlDialect(settings.store.schema, settings.store.table_name).schema_script()


async def apply_schema(settings: Settings) -> None:
    store = _store(settings, settings.store.dsn or "")
    try:
        await store.apply_schema()
    finally:
        await store.close()


async def list_leases(settings: Settings,
                      names: tuple[str, ...] | None) -> list[LeaseInfo]:
    return await _list_leases(settings, _store(settings, settings.store.dsn or ""))


ENTRY = BackendEntry(create=create, needs_dsn=True, takes_replica=True, check_dsn=check_odbc,
                     validate=check_names, schema_sql=schema_sql, apply_schema=apply_schema,
                     list_leases=list_leases)
