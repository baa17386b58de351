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

from sidecar.config import Settings, check_dsn
from sidecar.dsn import check_odbc
from sidecar.lease.sql.dialect import TsqlDialect
from sidecar.lease.sql.pyodbc_driver import PyodbcDriver
from sidecar.lease.sql.store import SqlRowBackend, SqlRowStore, check_names, request_timeout
from sidecar.lease.sql.store import list_holders as _list_holders


def _store(settings: Settings, dsn: str, replica: bool = False) -> SqlRowStore:
    timeout = request_timeout(settings)
    driver = PyodbcDriver(dsn, odbc_driver=settings.odbc_driver, login_timeout=timeout,
                          query_timeout=timeout,
                          label="sqlserver replica" if replica else "sqlserver")
    return SqlRowStore(TsqlDialect(settings.schema, settings.table_name), driver,
                       replica=replica)


def validate_settings(settings: Settings) -> None:
    """Refuse up front an ODBC string the driver manager cannot parse, or long names."""
    check_dsn(settings, check_odbc)
    check_names(settings)


def create(settings: Settings) -> SqlRowBackend:
    replica = _store(settings, settings.replica_dsn, replica=True) if settings.replica_dsn else None
    return SqlRowBackend(settings, _store(settings, settings.dsn or ""), replica)


def schema_sql(settings: Settings) -> str:
    return TsqlDialect(settings.schema, settings.table_name).schema_script()


async def apply_schema(settings: Settings) -> None:
    store = _store(settings, settings.dsn or "")
    try:
        await store.apply_schema()
    finally:
        await store.close()


async def list_holders(settings: Settings) -> list[dict]:
    return await _list_holders(settings, _store(settings, settings.dsn or ""))
