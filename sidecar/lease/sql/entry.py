"""One row-lease backend on a SQL server, declared by its dialect and its driver.

``postgres-row`` and ``sqlserver`` differ only in the SQL text (the dialect), how it
reaches the server (the driver) and the syntax of their DSN; everything else — the
stores for the primary and the replica, the leases, provisioning, ``status`` — is here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.base.clock import Clock
from sidecar.base.errors import ConfigError
from sidecar.lease import BackendEntry, LeaseInfo
from sidecar.lease.rowgroup import make_row_group, member_key
from sidecar.lease.rowlease import MEMBER_MARK, RowBackend, is_side_row
from sidecar.lease.sql.dialect import MAX_ROW_NAME, Dialect
from sidecar.lease.sql.store import Driver, SqlRowStore
from sidecar.settings import Settings, StoreSettings, Timing

# (schema, table) -> the dialect's statements on that table
DialectFactory = Callable[[str, str], Dialect]
# (store settings, dsn, timeout, label for errors) -> a driver
DriverFactory = Callable[[StoreSettings, str, float, str], Driver]


def request_timeout(timing: Timing) -> float:
    """Login and query timeout: a stuck call must end well within one lease duration."""
    return max(2.0, min(timing.renew_interval * 2, timing.lease_duration / 3, 10.0))


def check_names(settings: Settings) -> None:
    """Names that would not fit the table's key column are a configuration error, not a
    crash. (The identity's limit is checked by config loading for every backend.)"""
    for name in settings.names:
        key = settings.store.key(name)
        if len(key) > MAX_ROW_NAME:
            raise ConfigError(f"LEASE_NAME / --name: {key!r} (with the key prefix) is longer "
                              f"than {MAX_ROW_NAME} characters")
    if settings.shards:
        member = member_key(settings.store.key(settings.name), settings.identity)
        if len(member) > MAX_ROW_NAME:
            raise ConfigError(f"LEASE_NAME / --name: the shard group's member rows "
                              f"({member!r}) would be longer than {MAX_ROW_NAME} characters")
    for shard in settings.shards:
        key = settings.store.key(shard)
        if len(key) > MAX_ROW_NAME:
            raise ConfigError(f"LEASE_SHARDS / --shards: {key!r} (with the key prefix) is "
                              f"longer than {MAX_ROW_NAME} characters")


@dataclass(frozen=True)
class SqlRowEntry:
    """The :class:`~sidecar.lease.BackendEntry` of a row lease on a SQL server."""

    backend: str
    dialect: DialectFactory
    driver: DriverFactory
    # The syntax check of LEASE_DSN and LEASE_REPLICA_DSN.
    check_dsn: Callable[[str], None]
    # The module of the driver: ``driver`` imports it on first use, so the dialect's DDL
    # prints without the client library (``schema --print``).
    driver_module: str
    default_table: str = "leases"

    def entry(self) -> BackendEntry:
        shards = self.dialect("lease", "leases").group_beat is not None
        return BackendEntry(create=self.create, needs_dsn=True, takes_replica=True,
                            default_table=self.default_table,
                            check_dsn=self.check_dsn, validate=check_names,
                            schema_sql=self.schema_sql, apply_schema=self.apply_schema,
                            list_leases=self.list_leases, load_driver=self.load_driver,
                            shard_group=make_row_group if shards else None,
                            list_members=self.list_members if shards else None)

    def load_driver(self) -> object:
        return importlib.import_module(self.driver_module)

    def store(self, settings: Settings, dsn: str, replica: bool = False) -> SqlRowStore:
        label = f"{self.backend} replica" if replica else self.backend
        driver = self.driver(settings.store, dsn, request_timeout(settings.timing), label)
        return SqlRowStore(self._dialect(settings), driver, replica=replica,
                           ensure_schema=settings.store.ensure_schema and not replica)

    def _dialect(self, settings: Settings) -> Dialect:
        return self.dialect(settings.store.schema, settings.store.table)

    def _primary(self, settings: Settings) -> SqlRowStore:
        return self.store(settings, settings.store.dsn or "")

    def create(self, settings: Settings, clock: Clock) -> RowBackend:
        check_names(settings)
        replica_dsn = settings.store.replica_dsn
        replica = self.store(settings, replica_dsn, replica=True) if replica_dsn else None
        return RowBackend.from_settings(settings, clock, self._primary(settings), replica)

    def schema_sql(self, settings: Settings) -> str:
        return self._dialect(settings).schema_script()

    async def apply_schema(self, settings: Settings) -> None:
        store = self._primary(settings)
        try:
            await store.apply_schema()
        finally:
            await store.close()

    async def list_leases(self, settings: Settings,
                          names: tuple[str, ...] | None) -> list[LeaseInfo]:
        """Every row under this key prefix, for ``lease-sidecar status``; only reads.

        The row's version is not the holder's fencing token here: it grows with every
        renew (for replica confirmation), while the holder keeps the version of its
        acquire.
        """
        prefix = settings.store.key("")
        store = self._primary(settings)
        try:
            rows = await store.list_all()
        finally:
            await store.close()
        return [LeaseInfo(lease=name[len(prefix):], holder=row.owner if live else None,
                          expires_at=row.expires_at, details={"row_version": row.version})
                for name, row, live in rows
                if name.startswith(prefix) and not is_side_row(name)]

    async def list_members(self, settings: Settings, group_key: str) -> list[str]:
        """The live members of a shard group, for ``lease-sidecar status``; only reads."""
        store = self._primary(settings)
        try:
            return await store.members(group_key + MEMBER_MARK)
        finally:
            await store.close()
