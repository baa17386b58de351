"""``sqlite``: the embedded default — a TTL row lease in a local file.

For contenders on one host (a VM, a laptop, tests). The "database clock" is this host's
wall clock as SQLite reads it; the claim itself runs on the monotonic clock, so a wall
clock stepped forward by more than the safety margin could let a standby take over while
the holder still claims — the README lists this limit.

Fencing tokens come from a one-row counter that only grows, so a token never repeats
even though release deletes the row.

**The file itself can go** (deleted, or replaced by a rename or a restored copy). A
process holding it open would keep renewing on the vanished inode while a newcomer leads
on a new file at the same path. So before every statement the store compares the open
file's identity (device, inode, taken when it was opened) with what the path names now;
on a difference it closes the old file, logs one warning, and the holder steps down at
once (``Replaced``). Two more rules keep that safe:

- *Hold-off.* A database that replaced another at the path accepts no acquisition for
  one lease duration from when the replacement was noticed: by then every holder on the
  old file has stepped down (each renew checks the identity) and its claims have run out.
- *Tokens never go back for a path.* ``{path}-fence``, a small JSON file beside the
  database, records the identity of the database file in use, the highest token handed
  out (written before the new holder's first claim) and the hold-off deadline. A new or
  replaced database starts its counter above that token, and above the wall clock in
  microseconds when there is no fence to go by (a brand-new database, or the fence is
  gone too) — an SQLite file cannot commit a million acquisitions a second, so a counter
  seeded from an earlier wall-clock reading never gets there. The fence is updated under
  ``flock``, which also serialises the creation of a new database file.

Rollback journal, not WAL: closing the last connection to a WAL database deletes
``{path}-wal`` and ``{path}-shm`` *by name*; after a replacement those names belong to
the new database, and the holder that just stepped down would pull them from under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from sidecar.clock import Clock
from sidecar.dsn import check_sqlite
from sidecar.errors import BackendError, ConfigError, NotFound
from sidecar.lease import BackendEntry, Grant, LeaseInfo
from sidecar.lease.rowlease import Row, RowLease
from sidecar.settings import Settings

log = logging.getLogger("sidecar.lease.sqlite")

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

# The acquire transaction: sweep, draw a version, insert. A live row survived the sweep
# and stays untouched — ours too: an acquire comes only from a contender that does not
# hold the lease, so a live row under our identity belongs to another process (or to
# our previous term) and must run out first. The row is ours iff it carries the version
# drawn by this transaction.
_ACQUIRE = (
    "DELETE FROM {table} WHERE expires_at <= {now}",
    "UPDATE {table}_version SET value = value + 1 WHERE id = 1",
    """INSERT INTO {table} (name, owner, acquired_at, renewed_at, expires_at, metadata, version)
       SELECT :name, :owner, {now}, {now}, {now} + :duration, :metadata, value
       FROM {table}_version WHERE id = 1
       ON CONFLICT (name) DO NOTHING""",
)
_DRAWN = "SELECT value FROM {table}_version WHERE id = 1"
_RENEW = """UPDATE {table} SET renewed_at = {now}, expires_at = {now} + :duration
            WHERE name = :name AND owner = :owner AND expires_at > {now}
            RETURNING owner, version, expires_at"""
_RELEASE = "DELETE FROM {table} WHERE name = :name AND owner = :owner"
_READ = "SELECT owner, version, expires_at FROM {table} WHERE name = :name AND expires_at > {now}"

# How often a standby looks for a commit by another process when inotify is missing.
WATCH_INTERVAL = 0.1


def _row(found: tuple | None, won: bool = True) -> Row | None:
    if found is None:
        return None
    owner, version, expires = found
    return Row(owner=owner, version=int(version),
               expires_at=datetime.fromtimestamp(float(expires), tz=UTC), won=won)


class Replaced(BackendError):
    """The file at the path is not the database file we had open (deleted or replaced)."""


class HeldOff(BackendError):
    """The database replaced another; no acquisition before ``until`` (wall clock)."""

    def __init__(self, path: str, until: float) -> None:
        super().__init__(f"sqlite {path}: the database file replaced another one; no "
                         f"acquisition before {datetime.fromtimestamp(until, tz=UTC):%H:%M:%S}Z")
        self.until = until


Identity = tuple[int, int]


def _identity(path: str) -> Identity | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


@dataclass
class FenceRecord:
    identity: Identity | None  # the database file tokens were last handed out from
    token: int  # the highest token handed out at this path
    not_before: float  # wall clock: no acquisition before (after a replacement)


class Fence:
    """``{path}-fence``: see the module docstring. Every access holds an ``flock``."""

    def __init__(self, db_path: str) -> None:
        self.path = db_path + "-fence"
        self._fd: int | None = None

    def __enter__(self) -> Fence:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._fd is not None
        os.close(self._fd)  # releases the lock
        self._fd = None

    def read(self) -> FenceRecord | None:
        """The record, or None when there is none or it is unreadable (torn write)."""
        assert self._fd is not None
        raw = os.pread(self._fd, 4096, 0)
        try:
            data = json.loads(raw)
            dev, ino = data["dev"], data["ino"]
            return FenceRecord(identity=None if dev is None else (int(dev), int(ino)),
                               token=int(data["token"]), not_before=float(data["not_before"]))
        except (ValueError, KeyError, TypeError):
            return None

    def write(self, record: FenceRecord) -> None:
        assert self._fd is not None
        dev, ino = record.identity or (None, None)
        data = json.dumps({"dev": dev, "ino": ino, "token": record.token,
                           "not_before": record.not_before}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)


def wall_clock_us() -> int:
    return time.time_ns() // 1000


class SqliteStore:
    """Runs the row-lease statements on one connection in one worker thread."""

    def __init__(self, path: str, table: str, holdoff: float = 0.0) -> None:
        self._path = path
        self._table = table
        # How long a database that replaced another takes no acquisitions (the lease
        # duration: the longest an old holder's term can last).
        self._holdoff = holdoff
        # One thread owns the connection: sqlite3 objects must stay on one thread, and
        # a busy file must never block the event loop.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-lease")
        self._conn: sqlite3.Connection | None = None
        self._identity: Identity | None = None  # of the file self._conn has open
        self._not_before = 0.0  # wall clock: no acquisition before (hold-off)
        self._replaced_seen = False  # we saw the file change under us (until recorded)
        self._high = 0  # the highest version this process has seen at this path
        self._fence = Fence(path)
        self._seen_signature: tuple[tuple[int, int, int] | None, ...] | None = None
        self._basename = os.path.basename(path)
        self._inotify = None

    def _sql(self, text: str) -> str:
        return text.format(table=self._table, now=_NOW)

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            now = _identity(self._path)
            if now == self._identity:
                return self._conn
            # Closing is safe in rollback-journal mode: nothing is removed by name.
            self._conn.close()
            self._conn = None
            self._replaced_seen = True
            log.warning("sqlite database file was deleted or replaced; stepping down "
                        "and reopening", extra={
                            "path": self._path, "inode_was": self._identity[1]
                            if self._identity else None,
                            "inode_now": now[1] if now else None})
            raise Replaced(f"sqlite {self._path}: the database file was deleted or replaced")
        directory = os.path.dirname(self._path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with self._fence as fence:
            conn = self._open(fence)
        self._conn = conn
        return conn

    def _open(self, fence: Fence) -> sqlite3.Connection:
        """Open (or create) the database under the fence's lock; apply the token floor
        and the hold-off; record this file in the fence."""
        record = fence.read()
        before = _identity(self._path)
        if before is None:
            # Journals left by a deleted database would be taken for this one's.
            for suffix in ("-journal", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path + suffix)
        conn = sqlite3.connect(self._path, timeout=2.0, isolation_level=None)
        try:
            (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
            if str(mode).lower() == "wal":
                try:  # a database made by an older version
                    conn.execute("PRAGMA journal_mode=DELETE")
                except sqlite3.OperationalError as exc:
                    raise sqlite3.OperationalError(
                        f"cannot leave WAL mode ({exc}): is a sidecar of an older version "
                        "still using this file?") from None
            conn.executescript(self._sql(_SCHEMA))
            identity = _identity(self._path)
            if identity is None or (before is not None and identity != before):
                raise sqlite3.OperationalError("the database file changed while opening")
            (counter,) = conn.execute(self._sql(_DRAWN)).fetchone()
            replaced = self._replaced_seen or (
                record is not None and record.identity not in (None, identity))
            floor = self._high + 1
            if record is not None:
                floor = max(floor, record.token + 1)
            if counter == 0 or record is None:
                floor = max(floor, wall_clock_us())  # nothing (reliable) to go by
            if counter < floor:
                conn.execute(self._sql("UPDATE {table}_version SET value = :floor "
                                       "WHERE id = 1 AND value < :floor"), {"floor": floor})
            not_before = record.not_before if record and record.identity == identity else 0.0
            if replaced:
                not_before = max(not_before, time.time() + self._holdoff)
                log.warning("sqlite database file is new at this path; no acquisition for "
                            "one lease duration", extra={
                                "path": self._path, "not_before": not_before})
            fence.write(FenceRecord(identity=identity, not_before=not_before,
                                    token=max(record.token if record else 0, self._high)))
        except BaseException:
            conn.close()
            raise
        self._identity = identity
        self._not_before = not_before
        self._replaced_seen = False
        return conn

    def _record_token(self, token: int) -> None:
        """Before a new holder's first claim: the fence learns its token."""
        self._high = max(self._high, token)
        with self._fence as fence:
            record = fence.read() or FenceRecord(identity=self._identity, token=0,
                                                 not_before=0.0)
            if token > record.token:
                record.token = token
                fence.write(record)

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            try:
                return work(self._connect())
            except BackendError:
                raise
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
            if time.time() < self._not_before:
                raise HeldOff(self._path, self._not_before)
            # IMMEDIATE takes the write lock up front, so the sweep and the insert see
            # one consistent state; it is the "one round trip" of a server backend.
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in _ACQUIRE:
                    conn.execute(self._sql(statement), params)
                (drawn,) = conn.execute(self._sql(_DRAWN)).fetchone()
                found = conn.execute(self._sql(_READ), params).fetchone()
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            row = _row(found, won=found is not None and int(found[1]) == drawn)
            self._high = max(self._high, drawn)
            if row is not None and row.won:
                self._record_token(row.version)
            return row

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


class SqliteLease(RowLease):
    """A row lease that steps down when its database file is deleted or replaced."""

    async def try_acquire(self) -> Grant:
        try:
            return await super().try_acquire()
        except (Replaced, HeldOff) as exc:
            return Grant(held=False, reason=str(exc))

    async def try_renew(self) -> Grant:
        try:
            return await super().try_renew()
        except Replaced as exc:
            return Grant(held=False, reason=str(exc))

    async def release(self) -> None:
        # Our row was in the file that is gone; there is nothing to release.
        with contextlib.suppress(Replaced):
            await super().release()


class SqliteBackend:

    # Nothing found once connected can make this backend unsafe.
    misconfigured: asyncio.Event | None = None
    misconfiguration: str | None = None
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._store = SqliteStore(sqlite_path(settings.store.dsn or ""), settings.store.table_name,
                                  holdoff=settings.timing.lease_duration)

    def lease(self, name: str) -> RowLease:
        s = self._settings
        return SqliteLease(self._store, name=name, row_name=s.store.key(name),
                           owner=s.identity, duration=s.timing.lease_duration,
                           safety_margin=s.timing.safety_margin)

    async def close(self) -> None:
        await self._store.close()


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


def schema_sql(settings: Settings) -> str:
    return _SCHEMA.format(table=settings.store.table_name).strip()


async def apply_schema(settings: Settings) -> None:
    store = SqliteStore(sqlite_path(settings.store.dsn or ""), settings.store.table_name)
    try:
        await store.read("")  # connecting creates the file and the tables
    finally:
        await store.close()


_LIST = "SELECT name, owner, version, expires_at, expires_at > {now} FROM {table} ORDER BY name"


async def list_leases(settings: Settings, names: tuple[str, ...] | None) -> list[LeaseInfo]:
    """Every row under the key prefix, read through a read-only handle: ``status`` must
    never create the database file, its directory or the table."""
    path = sqlite_path(settings.store.dsn or "")
    table = settings.store.table_name
    prefix = settings.store.key("")

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


def create(settings: Settings, clock: Clock) -> SqliteBackend:
    return SqliteBackend(settings)


# check_sqlite refuses up front a DSN that is not one file shared by the contenders on
# this host (``:memory:``, a directory, a parent that is a file).
ENTRY = BackendEntry(create=create, check_dsn=check_sqlite, schema_sql=schema_sql,
                     apply_schema=apply_schema, list_leases=list_leases)
