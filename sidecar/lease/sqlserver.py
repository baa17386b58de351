"""``sqlserver``: the TTL row lease in SQL Server, over pyodbc.

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

from typing import TYPE_CHECKING

from sidecar.base.dsn import check_odbc
from sidecar.lease.sql.dialect import TsqlDialect
from sidecar.lease.sql.entry import SqlRowEntry
from sidecar.settings import StoreSettings

if TYPE_CHECKING:
    from sidecar.lease.sql.pyodbc_driver import PyodbcDriver


def _driver(store: StoreSettings, dsn: str, timeout: float, label: str) -> PyodbcDriver:
    # Imported on first use: ``schema --print`` shows the DDL without pyodbc installed.
    from sidecar.lease.sql.pyodbc_driver import PyodbcDriver

    return PyodbcDriver(dsn, odbc_driver=store.odbc_driver, login_timeout=timeout,
                        query_timeout=timeout, label=label)


ENTRY = SqlRowEntry("sqlserver", TsqlDialect, _driver, check_odbc,
                    "sidecar.lease.sql.pyodbc_driver",
                    # SQL Server's convention: PascalCase object names.
                    default_table="Leases").entry()
