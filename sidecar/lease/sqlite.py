"""``sqlite``: the embedded default — a TTL row lease in a local file.

For contenders on one host (a VM, a laptop, tests). The "database clock" is this host's
wall clock as SQLite reads it; the claim itself runs on the monotonic clock, so a wall
clock stepped forward by more than the safety margin could let a standby take over while
the holder still claims — the README lists this limit.

Fencing tokens come from a one-row counter that only grows, so a token never repeats
even though release deletes the row.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TypeVar

from sidecar.config import Settings, check_dsn
from sidecar.dsn import check_sqlite
from sidecar.lease import BackendError, LeaseInfo, NotFound
from sidecar.lease.rowlease import Row, RowLease

T = TypeVar("T")

# Seconds since the epoch by SQLite's clock, to the millisecond.
_NOW = "((julianday('now') - 2440587.5) * 86400.0)"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {table} (
    name        TEXT PRIMARY KEY,
    owner       TEXT NOT NULL,
    acquired_at REAL NOT NULL,
    renewed_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    metadata    TEXT,
    version     INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS {table}_expires ON {table} (expires_at);
CREATE TABLE IF NOT EXISTS {table}_version (id INTEGER PRIMARY KEY CHECK (id = 1),
                                            value INTEGER NOT NULL);
INSERT OR IGNORE INTO {table}_version (id, value) VALUES (1, 0);
"""

# The acquire transaction: sweep, draw a version, insert / take over / refresh.
# The upsert's WHERE lets only our own row be refreshed: a live foreign row survived the
# sweep and stays untouched.
_ACQUIRE = (
    "DELETE FROM {table} WHERE expires_at <= {now}",
    "UPDATE {table}_version SET value = value + 1 WHERE id = 1",
    """INSERT INTO {table} (name, owner, acquired_at, renewed_at, expires_at, metadata, version)
       SELECT :name, :owner, {now}, {now}, {now} + :duration, :metadata, value
       FROM {table}_version WHERE id = 1
       ON CONFLICT (name) DO UPDATE SET
           renewed_at = excluded.renewed_at, expires_at = excluded.expires_at,
           metadata = excluded.metadata
       WHERE {table}.owner = excluded.owner""",
)
_RENEW = """UPDATE {table} SET renewed_at = {now}, expires_at = {now} + :duration
            WHERE name = :name AND owner = :owner AND expires_at > {now}
            RETURNING owner, version, expires_at"""
_RELEASE = "DELETE FROM {table} WHERE name = :name AND owner = :owner"
_READ = "SELECT owner, version, expires_at FROM {table} WHERE name = :name AND expires_at > {now}"

# How often a standby looks for a commit by another process when inotify is missing.
WATCH_INTERVAL = 0.1


def _row(found: tuple | None) -> Row | None:
    if found is None:
        return None
    owner, version, expires = found
    return Row(owner=owner, version=int(version),
               expires_at=datetime.fromtimestamp(float(expires), tz=UTC))


class SqliteStore:
    """Runs the row-lease statements on one connection in one worker thread."""

    def __init__(self, path: str, table: str) -> None:
        self._path = path
        self._table = table
        # One thread owns the connection: sqlite3 objects must stay on one thread, and
        # a busy file must never block the event loop.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-lease")
        self._conn: sqlite3.Connection | None = None
        self._seen_signature: tuple[tuple[int, int, int] | None, ...] | None = None
        self._basename = os.path.basename(path)
        self._inotify = None

    def _sql(self, text: str) -> str:
        return text.format(table=self._table, now=_NOW)

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            directory = os.path.dirname(self._path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            conn = sqlite3.connect(self._path, timeout=2.0, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(self._sql(_SCHEMA))
            self._conn = conn
        return self._conn

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            try:
                return work(self._connect())
            except (sqlite3.Error, OSError) as exc:
                # A broken handle is reopened next time instead of failing forever.
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                raise BackendError(f"sqlite {self._path}: {exc}") from None

        result = await asyncio.get_running_loop().run_in_executor(self._pool, call)
        # Our own commits change the files too; only someone else's should wake us.
        self._seen_signature = self._files_signature()
        return result

    async def acquire(self, name: str, owner: str, duration: float, metadata: str) -> Row | None:
        params = {"name": name, "owner": owner, "duration": duration, "metadata": metadata}

        def work(conn: sqlite3.Connection) -> Row | None:
            # IMMEDIATE takes the write lock up front, so the sweep and the upsert see
            # one consistent state; it is the "one round trip" of a server backend.
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _ACQUIRE:
                    conn.execute(self._sql(statement), params)
                found = conn.execute(self._sql(_READ), params).fetchone()
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return _row(found)

        return await self._run(work)

    async def renew(self, name: str, owner: str, duration: float) -> Row | None:
        params = {"name": name, "owner": owner, "duration": duration}
        return await self._run(
            lambda conn: _row(conn.execute(self._sql(_RENEW), params).fetchone()))

    async def release(self, name: str, owner: str) -> None:
        await self._run(lambda conn: conn.execute(self._sql(_RELEASE),
                                                  {"name": name, "owner": owner}))

    async def read(self, name: str) -> Row | None:
        return await self._run(
            lambda conn: _row(conn.execute(self._sql(_READ), {"name": name}).fetchone()))

    async def wait_for_release(self, timeout: float) -> None:
        """Sleep until another process commits (a release, an expiry sweep), or timeout.

        Any commit changes the database or WAL file. inotify tells us at once and for
        free; where it is unavailable we ``stat`` the files every ``WATCH_INTERVAL``.
        Our own commits are not news (see ``_run``); a missed change only delays the
        takeover to the next retry.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        watch = self._watch()
        while (left := deadline - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left if watch else min(left, WATCH_INTERVAL)):
                    if watch:
                        while not str((await watch.get()).name).startswith(self._basename):
                            pass
                    else:
                        await asyncio.sleep(left)
            signature = self._files_signature()
            if signature != self._seen_signature:
                self._seen_signature = signature
                return

    def _watch(self):  # type: ignore[no-untyped-def]
        """An inotify watch on the database's directory, or None (then we poll)."""
        if self._inotify is None:
            try:
                from asyncinotify import Inotify, Mask

                inotify = Inotify()
                inotify.add_watch(os.path.dirname(os.path.abspath(self._path)),
                                  Mask.MODIFY | Mask.CREATE | Mask.MOVED_TO | Mask.DELETE)
                self._inotify = inotify
            except (ImportError, OSError):
                self._inotify = False
        return self._inotify or None

    def _files_signature(self) -> tuple[tuple[int, int, int] | None, ...]:
        def one(path: str) -> tuple[int, int, int] | None:
            try:
                st = os.stat(path)
            except OSError:
                return None
            return st.st_ino, st.st_size, st.st_mtime_ns

        return one(self._path), one(self._path + "-wal")

    async def close(self) -> None:
        if self._inotify:
            self._inotify.close()
        self._inotify = False

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._pool, shut)
        self._pool.shutdown(wait=False)


class SqliteBackend:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._store = SqliteStore(sqlite_path(settings.dsn or ""), settings.table_name)

    def lease(self, name: str) -> RowLease:
        s = self._settings
        return RowLease(self._store, name=name, row_name=s.row_name(name), owner=s.identity,
                        duration=s.lease_duration, safety_margin=s.safety_margin)

    async def close(self) -> None:
        await self._store.close()


def sqlite_path(dsn: str) -> str:
    """``/path``, ``sqlite:///relative`` or ``sqlite:////absolute`` → a file path."""
    if dsn.startswith("sqlite:///"):
        return dsn[len("sqlite:///"):]
    return dsn


def schema_sql(settings: Settings) -> str:
    return _SCHEMA.format(table=settings.table_name).strip()


async def apply_schema(settings: Settings) -> None:
    store = SqliteStore(sqlite_path(settings.dsn or ""), settings.table_name)
    try:
        await store.read("")  # connecting creates the file and the tables
    finally:
        await store.close()


_LIST = "SELECT name, owner, version, expires_at, expires_at > {now} FROM {table} ORDER BY name"


async def list_leases(settings: Settings, names: tuple[str, ...] | None) -> list[LeaseInfo]:
    """Every row under the key prefix, read through a read-only handle: ``status`` must
    never create the database file, its directory or the table."""
    path = sqlite_path(settings.dsn or "")
    table = settings.table_name
    prefix = settings.row_name("")

    def read() -> list[tuple]:
        if not os.path.isfile(path):
            raise NotFound(f"no such lease database: {path} (a sidecar creates it when it "
                           "starts; status creates nothing)")
        uri = f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro"
        try:
            conn = sqlite3.connect(uri, uri=True, timeout=2.0)
            try:
                return conn.execute(_LIST.format(now=_NOW, table=table)).fetchall()
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
            if name.startswith(prefix)]


def validate_settings(settings: Settings) -> None:
    """Refuse up front a DSN that is not one file shared by the contenders on this host
    (``:memory:``, a directory, a parent that is a file): it would fail or never lead."""
    check_dsn(settings, check_sqlite)


def create(settings: Settings) -> SqliteBackend:
    return SqliteBackend(settings)
