"""The row-lease statements in SQLite, on one connection in one worker thread.

Rollback journal, not WAL: closing the last connection to a WAL database deletes
``{path}-wal`` and ``{path}-shm`` *by name*; after a replacement those names belong to
the new database, and the holder that just stepped down would pull them from under it.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from sidecar.base.errors import BackendError
from sidecar.lease.rowlease import HINT_SUFFIX, Refused, Row, is_hint
from sidecar.lease.sqlite.file_identity import FileGuard, Replaced
from sidecar.lease.sqlite.watch import CommitWatch

T = TypeVar("T")
# A call of :meth:`SqliteStore._batched`: runs inside the shared transaction and
# returns what to do once it has committed (whose value, or error, is the caller's).
Step = Callable[[sqlite3.Connection], Callable[[], T]]
# The kinds of shared transaction: acquires and releases; reads.
WRITE = "BEGIN IMMEDIATE"
READ = "BEGIN"

# How long a statement waits for another process's lock on the file.
BUSY_TIMEOUT = 2.0
# How long a standby's look for another's commit waits for a writer to finish: one that
# is mid-commit deletes its journal when done, and the watch looks again then.
COMMIT_WAIT = 0.05

# Seconds since the epoch by SQLite's clock, to the millisecond.
NOW = "((julianday('now') - 2440587.5) * 86400.0)"

SCHEMA = """
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

# The acquire transaction: sweep, look, and only if no live row is left (and no live
# hand-over hint names another contender) draw a version and insert. A live row
# survived the sweep and stays untouched — ours too: an acquire comes only from a
# contender that does not hold the lease, so a live row under our identity belongs to
# another process (or to our previous term) and must run out first. An acquire that
# finds the lease held writes nothing, so it commits without touching the disk:
# standbys look on every commit they see, and a sync per look slowed every holder's
# renew on a busy disk. ``metadata`` holds the release record (as on PostgreSQL,
# :mod:`sidecar.lease.sql.dialect`): ``released:<version>`` on a row its holder released
# once its claims had run out; the acquire reads it before its sweep removes the row.
# The sweep removes expired rows, but keeps a row that carries its release record for
# one lease duration (the acquirer's ``:duration``) past its release, unless it is the
# row being acquired: the record is worth a claim horizon to that lease's next holder,
# and in a burst of moves (a shard group's members joining or stopping together) every
# other contender's acquire swept it first, so nearly every moved shard waited a horizon
# of its own. A kept row is expired: no read sees it live, and only its own name's
# acquire takes it over.
_SWEEP = ("DELETE FROM {table} WHERE expires_at <= {now} AND (name = :name "
          "OR metadata IS NOT 'released:' || version OR expires_at <= {now} - :duration)")
_RECORDED = ("SELECT 1 FROM {table} WHERE name = :name AND expires_at <= {now} "
             "AND metadata = 'released:' || version")
_INSERT = (
    "UPDATE {table}_version SET value = value + 1 WHERE id = 1",
    """INSERT INTO {table} (name, owner, acquired_at, renewed_at, expires_at, version)
       SELECT :name, :owner, {now}, {now}, {now} + :duration, value
       FROM {table}_version WHERE id = 1
       ON CONFLICT (name) DO NOTHING""",
)
_DRAWN = "SELECT value FROM {table}_version WHERE id = 1"
_FLOOR = "UPDATE {table}_version SET value = :floor WHERE id = 1 AND value < :floor"
_RENEW = """UPDATE {table} SET renewed_at = {now}, expires_at = {now} + :duration
            WHERE name = :name AND owner = :owner AND expires_at > {now}
            RETURNING owner, version, expires_at"""
_RELEASE = ("UPDATE {table} SET expires_at = min(expires_at, {now}), "
            "metadata = CASE WHEN :record THEN 'released:' || version END "
            "WHERE name = :name AND owner = :owner AND version = :version")
_RELEASE_ANY = "DELETE FROM {table} WHERE name = :name"
_READ = "SELECT owner, version, expires_at FROM {table} WHERE name = :name AND expires_at > {now}"
# A shard group's member record (:mod:`sidecar.lease.rowgroup`): a row with the lease
# columns (version 0: it is no lease and draws no token), and the live members.
_MEMBER = """INSERT INTO {table} (name, owner, acquired_at, renewed_at, expires_at, version)
             VALUES (:name, :owner, {now}, {now}, {now} + :duration, 0)
             ON CONFLICT (name) DO UPDATE SET owner = excluded.owner,
                 renewed_at = excluded.renewed_at, expires_at = excluded.expires_at"""
_MEMBERS = ("SELECT owner FROM {table} WHERE substr(name, 1, length(:prefix)) = :prefix "
            "AND expires_at > {now}")


def _row(found: tuple[Any, ...] | None, won: bool = True) -> Row | None:
    if found is None:
        return None
    owner, version, expires = found
    return Row(owner=owner, version=int(version),
               expires_at=datetime.fromtimestamp(float(expires), tz=UTC), won=won)


class SqliteStore:
    """A :class:`~sidecar.lease.rowlease.RowStore` on one SQLite file, guarded against
    the file being deleted or replaced (:mod:`sidecar.lease.sqlite.file_identity`)."""

    def __init__(self, path: str, table: str, holdoff: float = 0.0) -> None:
        self._path = path
        self._table = table
        self._guard = FileGuard(path, holdoff)
        self._watch = CommitWatch(path)
        # One thread owns the connection: sqlite3 objects must stay on one thread, and
        # a busy file must never block the event loop.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-lease")
        self._conn: sqlite3.Connection | None = None
        # Per kind of transaction (its BEGIN statement): the calls waiting for the next
        # shared one (:meth:`_batched`), and the kinds with one on its way to the worker.
        self._queue_lock = threading.Lock()
        self._queued: dict[str, list[tuple[Step[Any], asyncio.Future[Any]]]] = {
            WRITE: [], READ: []}
        self._flush_due: set[str] = set()
        self._flushing: set[asyncio.Future[None]] = set()  # kept: a task needs a reference
        # SQLite's data_version as our last acquire saw the file (only another
        # connection's commit changes it), and as the last acquire of each name saw it;
        # empty: no acquire on this connection yet.
        self._acquired_at_version: int | None = None
        self._acquired_at: dict[str, int] = {}

    def _sql(self, text: str) -> str:
        return text.format(table=self._table, now=NOW)

    def _connect(self) -> sqlite3.Connection:
        if self._conn is not None:
            try:
                self._guard.check()
            except Replaced:
                # Closing is safe in rollback-journal mode: nothing is removed by name.
                self._conn.close()
                self._conn = None
                raise
            return self._conn
        directory = os.path.dirname(self._path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        with self._guard.opening() as opening:
            # data_version counts per connection
            self._acquired_at_version = None
            self._acquired_at.clear()
            conn = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT, isolation_level=None)
            try:
                self._leave_wal(conn)
                conn.executescript(self._sql(SCHEMA))
                identity = opening.identity()
                (counter,) = conn.execute(self._sql(_DRAWN)).fetchone()
                floor = opening.token_floor(counter)
                if counter < floor:
                    conn.execute(self._sql(_FLOOR), {"floor": floor})
                opening.admit(identity)
            except BaseException:
                conn.close()
                raise
        self._conn = conn
        return conn

    @staticmethod
    def _leave_wal(conn: sqlite3.Connection) -> None:
        """A database made by an older version may be in WAL mode (see the module
        docstring)."""
        (mode,) = conn.execute("PRAGMA journal_mode").fetchone()
        if str(mode).lower() == "wal":
            try:
                conn.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.OperationalError as exc:
                raise sqlite3.OperationalError(
                    f"cannot leave WAL mode ({exc}): is a sidecar of an older version "
                    "still using this file?") from None

    def _broken(self, exc: sqlite3.Error | OSError) -> BackendError:
        """The error a failed call reports; the handle is closed, so that the next call
        reopens it instead of failing forever."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        return BackendError(f"sqlite {self._path}: {exc}")

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            try:
                return work(self._connect())
            except BackendError:
                raise
            except (sqlite3.Error, OSError) as exc:
                raise self._broken(exc) from None

        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def _batched(self, step: Step[T], begin: str = WRITE) -> T:
        """Run ``step`` in one transaction (``begin``: :data:`WRITE`, the write lock up
        front, so every read in it sees one consistent state; or :data:`READ`) with
        every other call of that kind queued until the transaction starts: for writes
        one commit, one disk sync and one turn at the file's write lock for all of them;
        for reads one turn at the shared lock. A shard group's member acquires or
        releases dozens of shards at once when members join or stop together, and its
        standbys each read their hand-over hint before every acquire; each in a
        transaction of its own, those (and the other members', each waiting its turn at
        the lock with SQLite's growing busy sleeps) queued up to seconds. The outcome is
        the same as running the steps one after another with nothing in between; a step
        that fails before it writes (a hold-off refusal) fails alone, a database error
        fails the whole transaction."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._queue_lock:
            self._queued[begin].append((step, future))
            due = begin in self._flush_due
            self._flush_due.add(begin)
        if not due:
            task = asyncio.ensure_future(self._flush(begin))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)
        return await future

    async def _flush(self, begin: str) -> None:
        try:
            outcomes = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._commit_queued, begin)
        except Exception as exc:  # the worker is gone (closed): nobody may be left waiting
            outcomes = [(future, None, exc) for _, future in self._take(begin)]
        for future, value, error in outcomes:
            if future.done():
                continue  # its caller stopped waiting; the write stands, as before
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

    def _take(self, begin: str) -> list[tuple[Step[Any], asyncio.Future[Any]]]:
        with self._queue_lock:
            batch, self._queued[begin] = self._queued[begin], []
            self._flush_due.discard(begin)
        return batch

    def _commit_queued(self, begin: str
                       ) -> list[tuple[asyncio.Future[Any], Any, BaseException | None]]:
        """On the worker thread: the queued steps in one transaction (see :meth:`_batched`)."""
        batch = self._take(begin)
        finishers: list[tuple[asyncio.Future[Any], Callable[[], Any] | None,
                              BaseException | None]] = []
        try:
            conn = self._connect()
            conn.execute(begin)
            try:
                for step, future in batch:
                    try:
                        finishers.append((future, step(conn), None))
                    except Refused as exc:  # refused before it wrote anything
                        finishers.append((future, None, exc))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        except Exception as exc:
            # Every caller gets the error: none may be left waiting.
            error = self._broken(exc) if isinstance(exc, (sqlite3.Error, OSError)) else exc
            return [(future, None, error) for _, future in batch]
        outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        for future, finish, failed in finishers:
            if finish is None:
                outcomes.append((future, None, failed))
                continue
            try:
                outcomes.append((future, finish(), None))
            except Exception as exc:
                outcomes.append((future, None, exc))
        return outcomes

    async def acquire(self, name: str, owner: str, duration: float) -> Row | None:
        params = {"name": name, "owner": owner, "duration": duration}

        def work(conn: sqlite3.Connection) -> Callable[[], Row | None]:
            self._guard.check_holdoff()
            recorded = conn.execute(self._sql(_RECORDED), params).fetchone() is not None
            conn.execute(self._sql(_SWEEP), params)
            found = conn.execute(self._sql(_READ), params).fetchone()
            # The hand-over hint is looked at in this transaction, not only by the
            # elector's read before it: a standby that read "no hint" while the
            # holder's release was committing queued on the write lock behind it
            # and took the lease the release had just handed to another; the named
            # one then waited for two more commits (this insert, and the lease
            # given back) and its own busy retries: the late sqlite hand-overs,
            # hundreds of ms when commits were slow.
            hint = None if is_hint(name) else conn.execute(
                self._sql(_READ), {"name": name + HINT_SUFFIX}).fetchone()
            handed_to = hint[0] if hint is not None and hint[0] != owner else None
            inserted = found is None and handed_to is None
            if inserted:
                for statement in _INSERT:
                    conn.execute(self._sql(statement), params)
                found = conn.execute(self._sql(_READ), params).fetchone()
            (drawn,) = conn.execute(self._sql(_DRAWN)).fetchone()
            (seen,) = conn.execute("PRAGMA data_version").fetchone()
            self._acquired_at_version = self._acquired_at[name] = seen

            def committed() -> Row | None:
                self._guard.saw(drawn)
                if found is None and handed_to is not None:
                    raise Refused(f"standing aside: the lease is being handed to {handed_to}")
                # Ours iff this transaction inserted it: it carries the version drawn
                # here (a row that expired between the sweep and the look stays, untaken).
                row = _row(found, won=inserted and found is not None
                           and int(found[1]) == drawn)
                if row is not None and row.won:
                    self._guard.record_token(row.version)
                    row = replace(row, previous_claims_ended=recorded)
                return row

            return committed

        return await self._batched(work)

    async def renew(self, name: str, owner: str, duration: float,
                    version: int) -> Row | None:
        # ``version`` is not checked: one file has no promotion to lose a write in, and
        # renew never changes the version here.
        params = {"name": name, "owner": owner, "duration": duration}
        return await self._run(
            lambda conn: _row(conn.execute(self._sql(_RENEW), params).fetchone()))

    async def release(self, name: str, owner: str, version: int,
                      record: bool = False) -> None:
        def work(conn: sqlite3.Connection) -> Callable[[], None]:
            conn.execute(self._sql(_RELEASE), {"name": name, "owner": owner,
                                               "version": version, "record": int(record)})
            return lambda: None

        await self._batched(work)

    async def release_to(self, name: str, owner: str, version: int, record: bool,
                         hint: str, successor: str, bound: float) -> None:
        """Release our row and write the hand-over hint row ``hint`` (owned by
        ``successor``, live for ``bound`` seconds) in one commit: standbys see the free
        lease and the hint at once, and the hand-over waits for one commit (a few disk
        syncs) instead of two. An earlier hint is replaced."""
        def work(conn: sqlite3.Connection) -> Callable[[], None]:
            # The earlier hint goes by name, live or expired (acquires sweep the rest).
            conn.execute(self._sql(_RELEASE_ANY), {"name": hint})
            for statement in _INSERT:
                conn.execute(self._sql(statement),
                             {"name": hint, "owner": successor, "duration": bound})
            conn.execute(self._sql(_RELEASE), {"name": name, "owner": owner,
                                               "version": version, "record": int(record)})
            return lambda: None

        await self._batched(work)

    async def beat_group(self, owner: str, duration: float, held: Mapping[str, int],
                         member: str, advertise: bool,
                         members: str) -> tuple[dict[str, int], list[str]]:
        """A shard group's round trip (:class:`sidecar.lease.rowgroup.GroupStore`) in one
        transaction: one commit, whatever the number of shards."""
        def work(conn: sqlite3.Connection) -> tuple[dict[str, int], list[str]]:
            conn.execute("BEGIN IMMEDIATE")
            try:
                renewed = {}
                for name in held:
                    found = conn.execute(self._sql(_RENEW), {
                        "name": name, "owner": owner, "duration": duration}).fetchone()
                    if found is not None:
                        renewed[name] = int(found[1])
                if advertise:
                    conn.execute(self._sql(_MEMBER), {"name": member, "owner": owner,
                                                      "duration": duration})
                else:
                    conn.execute(self._sql(_RELEASE_ANY), {"name": member})
                live = [owner for (owner,) in conn.execute(self._sql(_MEMBERS),
                                                           {"prefix": members})]
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return renewed, live

        return await self._run(work)

    async def read(self, name: str) -> Row | None:
        def work(conn: sqlite3.Connection) -> Callable[[], Row | None]:
            row = _row(conn.execute(self._sql(_READ), {"name": name}).fetchone())
            return lambda: row

        return await self._batched(work, READ)

    async def wait_for_release(self, timeout: float, name: str | None = None) -> None:
        """Sleep until another process has committed (a release, an expiry sweep) since
        our last acquire of ``name`` looked (of any name, without one), or timeout.

        Per name: the leases of a shard group share this store, and a commit seen by
        another shard's acquire after ours, but before our wait began, was taken for
        one we had seen; the release of our own shard then woke nobody, and its next
        holder came at its retry, a renew interval later (the long tail of a burst of
        moves)."""
        await self._watch.wait(timeout, lambda: self._committed_since_acquire(name))

    async def _committed_since_acquire(self, name: str | None) -> bool:
        """Another connection committed since our last acquire (of ``name``) read the
        file (or we cannot tell: no such acquire on this connection yet). Without a
        connection (a failed call closed it) the elector's backoff decides when to try
        again. Never waits long for a writer: one that is mid-commit shows again when
        its commit ends."""
        def look() -> bool:
            conn = self._conn
            seen = self._acquired_at_version if name is None else self._acquired_at.get(name)
            if conn is None:
                return False
            if seen is None:
                return True
            try:
                conn.execute(f"PRAGMA busy_timeout = {round(COMMIT_WAIT * 1000)}")
                try:
                    (now,) = conn.execute("PRAGMA data_version").fetchone()
                finally:
                    conn.execute(f"PRAGMA busy_timeout = {round(BUSY_TIMEOUT * 1000)}")
            except sqlite3.Error:
                return True  # the next acquire says what is wrong
            return bool(now != seen)

        return await asyncio.get_running_loop().run_in_executor(self._pool, look)

    async def close(self) -> None:
        self._watch.close()

        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._pool, shut)
        self._pool.shutdown(wait=False)
