"""``sqlite``: the embedded default — a TTL row lease in a local file.

For contenders on one host (a VM, a laptop, tests). The "database clock" is this host's
wall clock as SQLite reads it; the claim itself runs on the monotonic clock, so a wall
clock stepped forward by more than the safety margin could let a standby take over while
the holder still claims — docs/sqlite.md states this limit.

Fencing tokens come from a one-row counter that only grows, so a token never repeats
even though release deletes the row. The file itself can be deleted or replaced under a
running holder: :mod:`~sidecar.lease.sqlite.file_identity` makes the holder step down, holds a
new file off for one lease duration and keeps tokens growing for the path.
:mod:`~sidecar.lease.sqlite.store` runs the statements, :mod:`~sidecar.lease.sqlite.watch`
wakes standbys on another process's commit.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import urllib.parse
from datetime import UTC, datetime
from typing import Any

from sidecar.base.clock import Clock
from sidecar.base.dsn import check_sqlite
from sidecar.base.errors import BackendError, ConfigError, NotFound
from sidecar.lease import BackendEntry, LeaseInfo
from sidecar.lease.rowgroup import make_row_group
from sidecar.lease.rowlease import MEMBER_MARK, RowBackend, is_side_row
from sidecar.lease.sqlite.store import NOW, SCHEMA, SqliteStore
from sidecar.settings import Settings

_LIST = "SELECT name, owner, version, expires_at, expires_at > {now} FROM {table} ORDER BY name"


def sqlite_path(dsn: str) -> str:
    """``/path``, ``sqlite:///relative`` or ``sqlite:////absolute`` → a file path.

    Settings refuse anything else first; this refuses again (defence in depth): an
    in-memory or URI database is private to one process, so every contender would lead.
    """
    path = dsn[len("sqlite:///"):] if dsn.startswith("sqlite:///") else dsn
    if not path or path == ":memory:" or path.startswith("file:") or "://" in path:
        raise ConfigError(f"LEASE_DSN / --dsn: {dsn!r} is not a file path; the sqlite "
                          "backend needs a file that every contender opens")
    return path


def create(settings: Settings, clock: Clock) -> RowBackend:
    store = SqliteStore(sqlite_path(settings.store.dsn or ""), settings.store.table,
                        holdoff=settings.timing.lease_duration)
    return RowBackend.from_settings(settings, clock, store)


def schema_sql(settings: Settings) -> str:
    return SCHEMA.format(table=settings.store.table).strip()


async def apply_schema(settings: Settings) -> None:
    store = SqliteStore(sqlite_path(settings.store.dsn or ""), settings.store.table)
    try:
        await store.read("")  # connecting creates the file and the tables
    finally:
        await store.close()


async def list_leases(settings: Settings, names: tuple[str, ...] | None) -> list[LeaseInfo]:
    """Every row under the key prefix, read through a read-only handle: ``status`` must
    never create the database file, its directory or the table."""
    path = sqlite_path(settings.store.dsn or "")
    table = settings.store.table
    prefix = settings.store.key("")

    def read() -> list[tuple[Any, ...]]:
        if not os.path.isfile(path):
            raise NotFound(f"no such lease database: {path} (a sidecar creates it when it "
                           "starts; status creates nothing)")
        uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=2.0)
            try:
                return conn.execute(_LIST.format(now=NOW, table=table)).fetchall()
            finally:
                conn.close()
        except sqlite3.Error as exc:
            if "no such table" in str(exc):
                raise NotFound(f"no lease table {table} in {path}") from None
            raise BackendError(f"sqlite {path}: {exc}") from None

    return [LeaseInfo(lease=name[len(prefix):], holder=owner if live else None,
                      fencing_token=int(version),
                      expires_at=datetime.fromtimestamp(float(expires), tz=UTC))
            for name, owner, version, expires, live in await asyncio.to_thread(read)
            if name.startswith(prefix) and not is_side_row(name)]


_MEMBERS = ("SELECT owner FROM {table} WHERE substr(name, 1, length(?)) = ? "
            "AND expires_at > {now} ORDER BY owner")


async def list_members(settings: Settings, group_key: str) -> list[str]:
    """The live members of a shard group, read as :func:`list_leases` reads."""
    path = sqlite_path(settings.store.dsn or "")
    prefix = group_key + MEMBER_MARK

    def read() -> list[str]:
        if not os.path.isfile(path):
            raise NotFound(f"no such lease database: {path}")
        uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=2.0)
            try:
                query = _MEMBERS.format(now=NOW, table=settings.store.table)
                return [owner for (owner,) in conn.execute(query, (prefix, prefix))]
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise BackendError(f"sqlite {path}: {exc}") from None

    return await asyncio.to_thread(read)


# check_sqlite refuses up front a DSN that is not one file shared by the contenders on
# this host (``:memory:``, a directory, a parent that is a file).
ENTRY = BackendEntry(create=create, check_dsn=check_sqlite, schema_sql=schema_sql,
                     apply_schema=apply_schema, list_leases=list_leases,
                     default_dsn="/var/tmp/lease-sidecar/leases.sqlite3",
                     shard_group=make_row_group, list_members=list_members)
