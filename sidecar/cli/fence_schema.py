"""``lease-sidecar fence-schema --print | --apply``: the fencing guard (:mod:`sidecar.fence`)
for the application's database.

The guard belongs where the application writes, which need not be where the lease lives
(a ``kubernetes`` lease, an application on PostgreSQL), so the dialect comes from
``--dialect``, else from the DSN's form, else from ``LEASE_BACKEND``. ``--apply`` is
idempotent; it runs the script through the row-lease drivers (asyncpg, pyodbc).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from sidecar import config, fence
from sidecar.base.errors import ConfigError

# The row backend whose DSN syntax, driver and checks a dialect shares.
_BACKEND_OF = {"postgres": "postgres-row", "sqlserver": "sqlserver"}
_DIALECT_OF = {"postgres": "postgres", "postgres-row": "postgres", "sqlserver": "sqlserver"}
# The longest a connection or the script may take: a DDL script, once.
TIMEOUT = 30.0


def dialect_for(given: str | None, dsn: str | None, backend: str | None) -> str:
    """``--dialect`` if given; else a ``postgresql://`` URL means PostgreSQL and an ODBC
    string SQL Server; else the SQL backend's own. A one-line error otherwise."""
    if given:
        return given
    if dsn:
        return "postgres" if re.match(r"(?i)^\s*postgres(ql)?://", dsn) else "sqlserver"
    if backend in _DIALECT_OF:
        return _DIALECT_OF[backend]
    raise ConfigError(f"fence-schema: --dialect: say postgres or sqlserver (the "
                      f"{backend or 'sqlite'} backend keeps no SQL to go by)")


async def run(flags: Mapping[str, Any], apply: bool,
              setup_logs: Callable[[str], None]) -> int:
    """Print or apply the guard; ``flags`` are the parsed ``fence-schema`` flags;
    ``setup_logs`` is given the log level once the settings are loaded."""
    dsn = flags.get("dsn") or os.environ.get("LEASE_DSN") or None
    dialect = dialect_for(flags.get("dialect"), dsn, os.environ.get("LEASE_BACKEND"))
    if apply and not dsn:
        raise ConfigError("fence-schema --apply: --dsn / LEASE_DSN: name the application's "
                          "database")
    # The settings of the dialect's row backend: its DSN check, schema name rule, ODBC
    # driver and secret masking, whatever backend the lease itself is on.
    settings = config.load({**flags, "backend": _BACKEND_OF[dialect]}, dsn_required=apply)
    setup_logs(settings.log_level)
    schema = settings.store.schema
    if not apply:
        print(fence.script(dialect, schema))
        return 0
    dsn = settings.store.dsn or ""
    if dialect == "postgres":
        from sidecar.lease.sql.asyncpg_driver import AsyncpgDriver

        driver: Any = AsyncpgDriver(dsn, timeout=TIMEOUT, label="fence-schema")
        text = fence.postgres_provision(schema)
    else:
        from sidecar.lease.sql.pyodbc_driver import PyodbcDriver

        driver = PyodbcDriver(dsn, odbc_driver=settings.store.odbc_driver,
                              login_timeout=TIMEOUT, query_timeout=TIMEOUT,
                              label="fence-schema")
        text = fence.sqlserver_script(schema)
    try:
        await driver.script(text)
    finally:
        await driver.close()
    where = (f'"{schema}".{fence.POSTGRES_FUNCTION}' if dialect == "postgres"
             else f"[{schema}].[{fence.SQLSERVER_PROCEDURE}]")
    print(f"fence schema applied ({dialect}, {where})")
    return 0
