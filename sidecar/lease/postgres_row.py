"""``postgres-row``: the TTL row lease of ``sqlserver`` in PostgreSQL, over asyncpg.

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

from typing import TYPE_CHECKING

from sidecar.base.dsn import check_postgres_url
from sidecar.lease.sql.dialect import PostgresDialect
from sidecar.lease.sql.entry import SqlRowEntry
from sidecar.settings import StoreSettings

if TYPE_CHECKING:
    from sidecar.lease.sql.asyncpg_driver import AsyncpgDriver


def _driver(store: StoreSettings, dsn: str, timeout: float, label: str) -> AsyncpgDriver:
    # Imported on first use: ``schema --print`` shows the DDL without asyncpg installed.
    from sidecar.lease.sql.asyncpg_driver import AsyncpgDriver

    return AsyncpgDriver(dsn, timeout=timeout, label=label)


ENTRY = SqlRowEntry("postgres-row", PostgresDialect, _driver, check_postgres_url,
                    "sidecar.lease.sql.asyncpg_driver").entry()
