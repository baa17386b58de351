"""``postgres``: a session-level advisory lock on a dedicated, non-pooled connection.

Each lease name gets its own ``asyncpg.connect`` connection (never a pool: a pooled or
PgBouncer-multiplexed session could hand the lock to someone else's code, or lose it).
The lock lives exactly as long as that session, so:

- no schema and no rows; the lock id is the first 8 bytes of
  SHA-256(``{key_prefix}.{name}``) as a signed big-endian bigint (:func:`lock_id`),
  stable across processes and versions, unlike Python's ``hash()``;
- a crashed holder's lock passes on the moment PostgreSQL ends its session; standbys wait
  for it *inside the server* (``pg_advisory_lock`` under ``lock_timeout``), so they get
  it within milliseconds without polling. Because of that, the new holder waits one
  ``claim_horizon`` before it publishes (the elector's rule for every backend), letting
  the dead holder's last claims run out;
- the holder heartbeats (checks ``pg_locks`` for its own pid) every renew interval; a
  heartbeat that has not succeeded within ``renew_deadline`` ends the claim
  (``Grant.valid_for``), and a dropped connection (asyncpg termination listener) ends
  it at once: ``try_renew`` then answers "not held" without a round trip and
  :attr:`AdvisoryLease.lost` is set for an elector that wants to wake up;
- the session's own settings make the *server* wait longer than the client before it
  ends a silent session (TCP keepalives and ``tcp_user_timeout`` beyond
  ``renew_deadline + claim_horizon``), and ``idle_session_timeout`` (PostgreSQL 14+) of
  about the lease duration frees the lock of a frozen holder while the heartbeat keeps
  a healthy session busy. On PostgreSQL 13 and older there is no such setting: a frozen
  (SIGSTOPped) holder keeps the lock until it resumes or dies, because the kernel
  keeps answering TCP keepalives for a stopped process;
- fencing token: a transaction id drawn right after the lock was granted
  (``pg_current_xact_id()``, ``txid_current()`` before 13). Transaction ids are 64-bit
  (with epoch) and assigned in increasing order per cluster, so the next holder, who
  can only get the lock after this one let go, always draws a larger one.

Uncertain lock state never survives: when a lock-changing call fails or times out
half-way (did the server grant it or not?), the connection is dropped, which frees any
lock it may hold.

A transaction pooler (PgBouncer ``pool_mode=transaction`` or ``statement``) breaks the
one assumption all of this rests on: that our client connection *is* one server session.
Behind it, session advisory locks are re-entrant per server session, so two clients
handed the same server session both "get" the lock, and the session (with the lock)
outlives a killed client. So every connection gets a random marker, stored in a
session-level setting of its server session when it connects, and every statement that
takes, checks or gives back the lock first checks, in the same statement, that it runs
on the session that carries our marker (a pooler that hands our session to another client
lets that client overwrite it, one that swaps sessions shows us one without it), and
that this session does not already hold the key while we think we hold nothing (a
session shared with, or left behind by, another client). A sidecar alone on a transaction
pool gives those checks nothing to see, so after every grant through a pooler a fresh
connection checks that it gets a session of its own (``_probe_pooler``). Any of these is
a misconfiguration that never heals: the lease fails closed at once, logs one line naming
the pooler and ``postgres-row``, and reports it to the runtime, which exits with code 2.
Session pooling (``pool_mode=session``) passes every check and works. Statements are never
named prepared statements (``statement_cache_size=0``): behind a transaction pooler a
named statement can be bound on another client's session, where the same name may hold
a different statement; an unnamed one is parsed and run in one server link (asyncpg
sends Parse/Describe with Flush, not Sync, so the pooler keeps the link).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

from sidecar.clock import Clock
from sidecar.dsn import check_postgres_url
from sidecar.errors import BackendError
from sidecar.lease import BackendEntry, Grant, Holder, LeaseInfo
from sidecar.redact import redact
from sidecar.settings import Settings

log = logging.getLogger("sidecar.lease.postgres")

# Ways an asyncpg call fails because of the server or the connection (not a bug here).
# InternalClientError: asyncpg's protocol state after the server ended the session unasked.
_DB_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError,
              asyncpg.exceptions.InternalClientError, OSError, TimeoutError)

# The custom setting that carries a connection's marker on its server session.
MARKER_SETTING = "lease_sidecar.session"
_OURS = f"current_setting('{MARKER_SETTING}', true) is not distinct from $3::text"
# Our own server session holds the key ($4, $5: pg_locks' classid/objid of the key).
_MINE = """exists(select 1 from pg_locks where locktype = 'advisory' and granted
            and pid = pg_backend_pid() and classid = $4::int8::oid
            and objid = $5::int8::oid and objsubid = 1)"""
# A statement that lands on a session carrying another client's marker wipes it, so that
# client's next statement there fails its check too: one client seeing the sharing makes
# the others see it, instead of one refusing while the other keeps leading.
_POISON = f"set_config('{MARKER_SETTING}', 'shared', false)"
# Heartbeat: (this statement ran on our session, that session holds the lock).
_HOLDS = (f"select ours, {_MINE.replace('$4', '$1').replace('$5', '$2')}, "
          f"case when not ours then {_POISON} end from (select {_OURS} as ours) me")
# Checked before any lock call, in the same statement: the CTE runs first and once.
_CHECK = f"me as (select {_OURS} as ours, {_MINE} as already)"
# Who holds a lock in this database (application_name is visible even across roles).
_HOLDER = """select a.application_name from pg_locks l join pg_stat_activity a on a.pid = l.pid
             where l.locktype = 'advisory' and l.granted and l.classid = $1::int8::oid
             and l.objid = $2::int8::oid and l.objsubid = 1
             and l.database = (select oid from pg_database where datname = current_database())"""
# Every session holding or awaiting a bigint advisory lock in this database (standbys
# wait inside the server, so a contended lease shows its waiters even between holders).
_ALL_LOCKS = """select l.classid::int8, l.objid::int8, l.granted, a.application_name, a.pid,
                a.backend_start
                from pg_locks l join pg_stat_activity a on a.pid = l.pid
                where l.locktype = 'advisory' and l.objsubid = 1
                and l.database = (select oid from pg_database
                                  where datname = current_database())"""
def _durable(param: str) -> str:
    """SQL that makes the token's transaction commit synchronously.

    A transaction that only drew an xid commits asynchronously (nothing to flush), so a
    crash right after an acquisition could hand the same xid — the same fencing token —
    to the next holder. A transactional WAL message gives the commit something to flush
    (and to wait for synchronous replicas, where configured).
    """
    return f"pg_logical_emit_message(true, 'lease-sidecar', {param}::text)"


# Unlock only on our own session: behind a pooler the statement may land on another's.
_UNLOCK = (f"select {_OURS.replace('$3', '$2')}, case when {_OURS.replace('$3', '$2')} then "
           "(select bool_and(pg_advisory_unlock($1)) from generate_series(1, $3)) end")
# Session settings and the marker in one statement; the real backend pid comes back.
_APPLY = ("select pg_backend_pid(), (select count(set_config(name, value, false)) "
          "from unnest($1::text[], $2::text[]) s(name, value)), "
          f"set_config('{MARKER_SETTING}', $3, false)")

POOLER = ("a transaction pooler is in the way (PgBouncer pool_mode=transaction): the postgres "
          "backend's advisory lock needs a server session of its own; use "
          "LEASE_BACKEND=postgres-row through the pooler, or connect to PostgreSQL directly "
          "or through pool_mode=session")

# asyncpg's errors for a named prepared statement missing on, or already defined in, the
# server session: what a transaction pooler does to a client's prepared statements.
_PREPARED_STATEMENT_ERRORS = (asyncpg.exceptions.InvalidSQLStatementNameError,
                              asyncpg.exceptions.DuplicatePreparedStatementError)


def lock_id(key_prefix: str, name: str) -> int:
    """First 8 bytes of SHA-256(``{key_prefix}.{name}``) as a signed big-endian bigint."""
    digest = hashlib.sha256(f"{key_prefix}.{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def lock_halves(key: int) -> tuple[int, int]:
    """``(classid, objid)`` as pg_locks shows a bigint advisory key."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


def key_from_halves(classid: int, objid: int) -> int:
    """The signed bigint key back from pg_locks' ``classid``/``objid``."""
    return int.from_bytes(((classid << 32) | objid).to_bytes(8, "big"), "big", signed=True)


def application_name(identity: str) -> str:
    """The identity cut to PostgreSQL's 63-byte limit (on a character boundary)."""
    return identity.encode()[:63].decode(errors="ignore")


def session_settings(settings: Settings, server_version: int) -> dict[str, str]:
    """Per-session settings so the server outlasts the client's own step-down.

    The client stops claiming ``renew_deadline`` after its last successful heartbeat was
    sent, and no claim outlives that; the server must not end the session (freeing the
    lock) sooner. ``server_version`` is ``server_version_num`` (e.g. 150004).
    """
    silent = math.ceil(settings.timing.renew_deadline + settings.timing.claim_horizon + 1.0)
    values = {
        # Keepalive probes start after this much silence; the session dies after
        # idle + interval * count seconds without an answer.
        "tcp_keepalives_idle": str(max(1, silent - 3)),
        "tcp_keepalives_interval": "1",
        "tcp_keepalives_count": "3",
    }
    if server_version >= 120000:
        # Unacknowledged data (e.g. a heartbeat reply) for this long ends the session.
        values["tcp_user_timeout"] = str(silent * 1000)
    if server_version >= 140000:
        timing = settings.timing
        idle = max(timing.lease_duration, timing.renew_deadline + timing.claim_horizon + 0.5)
        values["idle_session_timeout"] = f"{round(idle * 1000)}ms"
    return values


@dataclass
class Session:
    """One client connection and what its connect statement learned of the server side."""

    conn: asyncpg.Connection
    # Random per connection, stored in the server session by the connect statement.
    marker: str
    # pg_backend_pid() of the server session that ran the connect statement.
    backend_pid: int
    # The pid in the protocol's key data is not the session's: a proxy answered the
    # startup (PgBouncer makes up its own). Fine by itself (session pooling); it only
    # decides how a session that already holds our key is read (see ``_check``).
    proxied: bool
    # An in-server wait on this session ended in lock_timeout. PostgreSQL can grant the
    # lock and still raise lock_timeout when the two race (seen in about 7 % of tight
    # races here), and a session-level lock survives its statement's error: the session
    # may hold the lock although we were told no.
    maybe_holds: bool = False


class _Conn:
    """Connecting with the session settings; errors become one redacted line."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.where = redact(settings.store.dsn) or "postgres"
        # Connecting and ordinary queries must answer well within the renew deadline.
        self.timeout = max(1.0, settings.timing.renew_deadline)

    def error(self, what: str, exc: BaseException) -> BackendError:
        detail = " ".join((str(exc) or type(exc).__name__).split())
        return BackendError(f"postgres {self.where}: {what}: {detail}")

    async def open(self) -> Session:
        try:
            conn = await asyncpg.connect(
                self.settings.store.dsn, timeout=self.timeout, command_timeout=self.timeout,
                # Unnamed statements only: see the module docstring.
                statement_cache_size=0,
                server_settings={"application_name": application_name(
                    self.settings.identity)})
        except (*_DB_ERRORS, ValueError) as exc:
            raise self.error("cannot connect", exc) from None
        marker = uuid.uuid4().hex
        try:
            values = session_settings(self.settings, _version_num(conn))
            pid, _, _ = await conn.fetchrow(_APPLY, list(values), list(values.values()),
                                            marker)
        except _DB_ERRORS as exc:
            conn.terminate()
            raise self.error("cannot apply session settings", exc) from None
        return Session(conn, marker, int(pid), proxied=conn.get_server_pid() != pid)


def _version_num(conn: asyncpg.Connection) -> int:
    v = conn.get_server_version()
    return v.major * 10000 + v.minor


def _prepared_statement_error(exc: BaseException) -> str | None:
    """Evidence of a transaction pooler in an asyncpg error, or None."""
    if isinstance(exc, _PREPARED_STATEMENT_ERRORS):
        return f"prepared statements vanish or clash between statements: {first_line(exc)}"
    return None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class AdvisoryLease:
    """One lease name: one dedicated connection, one advisory lock."""

    def __init__(self, settings: Settings, name: str,
                 on_pooler: Callable[[str, str], None] | None = None) -> None:
        self.name = name
        # Set the moment the connection holding the lock drops; cleared on acquisition.
        self.lost = asyncio.Event()
        self._claims_wait_until = 0.0  # loop time before which no claim (server restart)
        self.key = lock_id(settings.store.key_prefix, name)
        self._halves = lock_halves(self.key)
        self._settings = settings
        self._db = _Conn(settings)
        self._session: Session | None = None
        # Session-level advisory locks stack: each grant needs one unlock.
        self._levels = 0
        self._token: int | None = None
        # One operation at a time on the connection; the in-server wait holds it too.
        self._busy = asyncio.Lock()
        self._message = f"{settings.identity} acquired {name}"
        self._waiter: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        # Once a transaction pooler was seen: the refusal, for good (it never heals).
        self.pooler: str | None = None
        self._on_pooler = on_pooler

    @property
    def pid(self) -> int | None:
        """Backend pid of the dedicated session (what pg_locks shows as the holder)."""
        session = self._session
        return session.backend_pid if session and not session.conn.is_closed() else None

    # -- the Lease protocol ----------------------------------------------------------
    async def try_acquire(self) -> Grant:
        await self._settle_waiter()
        async with self._busy:
            if self.pooler:
                return self._refused()
            if self._levels and self._alive():
                return self._held()
            loop = asyncio.get_running_loop()
            for attempt in (1, 2):
                reused = self._session is not None
                previous, started = self._session, loop.time()
                session = await self._connection()
                if (session is not previous
                        and loop.time() - started > self._settings.timing.renew_deadline / 2):
                    # The grant's validity counts from the elector's send time, before
                    # this slow connect (a session pool with fewer servers than
                    # sidecars queues it): most of it would be spent on arrival and
                    # the term would end before its first heartbeat. Ask on the next
                    # try, on the session we now have.
                    return Grant(held=False, reason="connected slowly; asking for the lock "
                                                    "on the next try")
                try:
                    ours, already, token, uptime, _, _ = await session.conn.fetchrow(
                        self._try_lock_sql(session.conn), self.key, self._message,
                        session.marker, *self._halves)
                except _DB_ERRORS as exc:
                    self._drop()  # granted or not, a dropped session holds nothing
                    if evidence := _prepared_statement_error(exc):
                        return self.pooler_seen(evidence)
                    # An idle session the server ended (idle_session_timeout): reconnect once.
                    if attempt == 1 and reused and session.conn.is_closed():
                        continue
                    raise self._db.error("acquire", exc) from None
                break
            refusal = self._check(session, ours, already)
            if refusal is not None:
                return refusal
            if token is None:
                holder = await self._holder(session.conn)
                return Grant(held=False, holder=holder,
                             reason=f"held by {holder}" if holder else "held by another session")
            self._granted(token, uptime)
            return self._held()

    async def try_renew(self) -> Grant:
        async with self._busy:
            if self.pooler:
                return self._refused()
            if not self._levels or not self._alive():
                return self._gone()
            session = self._session
            assert session is not None
            try:
                ours, holds, _ = await session.conn.fetchrow(_HOLDS, *self._halves,
                                                          session.marker)
            except _DB_ERRORS as exc:
                if evidence := _prepared_statement_error(exc):
                    return self.pooler_seen(evidence)
                if session.conn.is_closed():
                    return self._gone()
                raise self._db.error("heartbeat", exc) from None
            if not ours:
                return self.pooler_seen("the heartbeat ran on a server session without this "
                                        "connection's marker")
            if not holds:
                # Only our own session can unlock, and the statement ran on it.
                self._drop()
                return Grant(held=False, reason="the session no longer holds the lock")
            return self._held()

    async def release(self) -> None:
        await self._settle_waiter()
        async with self._busy:
            levels, self._levels, self._token = self._levels, 0, None
            session = self._session
            if not levels or session is None or session.conn.is_closed():
                return
            try:
                ours, _ = await session.conn.fetchrow(_UNLOCK, self.key, session.marker,
                                                      levels)
            except _DB_ERRORS as exc:
                self._drop()  # closing the session frees the lock as well
                raise self._db.error("release", exc) from None
            if not ours:
                self.pooler_seen("the release ran on a server session without this "
                                 "connection's marker")

    async def describe(self) -> Holder:
        session = await self._db.open()
        try:
            return Holder(holder=await self._holder(session.conn))
        finally:
            await _close(session.conn)

    async def wait_for_change(self, timeout: float) -> None:
        """Block in the server until the lock is ours or ``timeout`` passes.

        The in-server wait runs as its own task: cancelling this call (the elector does
        when its sleep ends) leaves that wait to finish by its ``lock_timeout``, so a
        grant that races the cancel is still counted, never lost.
        """
        if self._levels or self.pooler:
            await asyncio.sleep(timeout)
            return
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.create_task(self._wait_lock(timeout),
                                               name=f"pg-advisory-wait-{self.name}")
        await asyncio.shield(self._waiter)

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(BaseException):
                await self._probe
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            # Ending the session ends the in-server wait (and frees a lock it may just
            # have been granted) instead of letting it run out its lock_timeout.
            self._drop()
            await waiter
        with contextlib.suppress(BackendError):
            await self.release()
        async with self._busy:
            session, self._session = self._session, None
            if session is not None:
                await _close(session.conn)

    def pooler_seen(self, evidence: str) -> Grant:
        """A transaction pooler is in the way: stop claiming at once and for good.

        Dropping the connection ends nothing on the server behind a pooler (the server
        session may keep the lock until the pooler closes it); every other contender
        refuses to take a lock from such a session, so nobody claims meanwhile.
        """
        first = self.pooler is None
        self.pooler = f"{POOLER} ({evidence})"
        self._drop()
        self.lost.set()  # wakes a holder's elector, whose next renew is refused
        if first and self._on_pooler is not None:
            self._on_pooler(self.name, self.pooler)
        return self._refused()

    # -- internals -------------------------------------------------------------------
    async def _probe_pooler(self, session: Session) -> None:
        """Behind a pooler, right after a grant: does a fresh connection get a server
        session of its own, as session pooling promises?

        The lock statements' checks need a second client to share or swap a session
        before they can see anything; a sidecar left alone on a transaction pool (its
        rivals refused and exited) would otherwise lead on, unwarned. A transaction
        pooler hands this fresh connection a pooled session — by default the one
        released last, ours — still carrying our marker (or another client's); a
        session pooler gives it a new or reset session (no marker), or makes it wait
        for one (a timeout here, which says nothing). Runs beside the term, not before
        it: the checks in every lock statement, not this probe, keep claims apart.
        """
        try:
            conn = await asyncpg.connect(
                self._settings.store.dsn, timeout=self._db.timeout, statement_cache_size=0,
                server_settings={"application_name": application_name(
                    self._settings.identity)})
        except (*_DB_ERRORS, ValueError):
            return
        try:
            marker, pid = await conn.fetchrow(
                f"select current_setting('{MARKER_SETTING}', true), pg_backend_pid()",
                timeout=self._db.timeout)
        except _DB_ERRORS:
            return
        finally:
            await _close(conn)
        if pid == session.backend_pid or marker:
            self.pooler_seen("a fresh connection was handed a server session that already "
                             "carried a connection's marker: a transaction pooler, or a "
                             "session pool without a server reset")

    def _check(self, session: Session, ours: bool, already: bool) -> Grant | None:
        """The refusal when a lock statement did not run on our own, clean session."""
        if not ours:
            return self.pooler_seen("a lock statement ran on a server session without this "
                                    "connection's marker")
        if not already:
            return None
        if session.proxied and not session.maybe_holds:
            return self.pooler_seen("the server session already held the lock this client "
                                    "never took: it is shared with, or was left by, another "
                                    "client")
        # Our own session holds a lock we have not counted (a grant that raced
        # lock_timeout, or, straight to PostgreSQL, a cause unknown): the state is
        # uncertain, and ending the session frees it (a session pooler resets it).
        reason = ("this session holds the lock it was refused (a grant that raced "
                  "lock_timeout); reconnecting to free it" if session.maybe_holds else
                  "this session held the lock unknown to us; reconnecting to free it")
        log.warning(reason, extra={"lease": self.name, "lock_id": self.key,
                                   "pid": session.backend_pid})
        self._drop()
        return Grant(held=False, reason=reason)

    async def _wait_lock(self, timeout: float) -> None:
        async with self._busy:
            if self._levels or self.pooler:
                return
            try:
                session = await self._connection()
            except BackendError:
                return  # the elector's next try_acquire reports it
            wait_ms = f"{max(1, round(timeout * 1000))}ms"
            try:
                # One round trip: lock_timeout (local to this statement's transaction)
                # ends the wait in the server; the client timeout only guards against a
                # hung server. The xid is drawn after the CTE granted the lock.
                ours, already, token, uptime, _, _ = await session.conn.fetchrow(
                    self._wait_lock_sql(session.conn), self.key, self._message,
                    session.marker, *self._halves, wait_ms,
                    timeout=timeout + self._db.timeout)
            except asyncpg.LockNotAvailableError:
                # Still held by someone else, or granted in a race with lock_timeout: the
                # next lock statement's held-key check tells, and frees it.
                session.maybe_holds = True
                return
            except _DB_ERRORS as exc:
                self._drop()  # timed out or broken: whether it was granted is unknown
                if evidence := _prepared_statement_error(exc):
                    self.pooler_seen(evidence)
                return
            if self._check(session, ours, already) is None:
                self._granted(token, uptime)

    async def _settle_waiter(self) -> None:
        """Let a pending in-server wait finish (it ends by its own lock_timeout)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            await asyncio.shield(waiter)

    async def _connection(self) -> Session:
        if self._session is None or self._session.conn.is_closed():
            self._drop()
            session = await self._db.open()
            session.conn.add_termination_listener(self._terminated)
            self._session = session
        return self._session

    def _terminated(self, conn: asyncpg.Connection) -> None:
        """The session ended (server restart, pg_terminate_backend, network)."""
        session = self._session
        if session is None or conn is not session.conn:
            return
        if self._levels:
            log.warning("lost the PostgreSQL session holding the lock", extra={
                "lease": self.name, "lock_id": self.key, "pid": session.backend_pid})
            self.lost.set()
        self._levels, self._token, self._session = 0, None, None

    def _drop(self) -> None:
        """Forget the connection; closing the socket ends the session and its locks."""
        session, self._session = self._session, None
        if self._levels:
            self.lost.set()
        self._levels, self._token = 0, None
        if session is not None and not session.conn.is_closed():
            session.conn.terminate()

    def _alive(self) -> bool:
        return self._session is not None and not self._session.conn.is_closed()

    def _granted(self, token: int, server_uptime: float) -> None:
        self._levels += 1
        self._token = int(token)
        # A holder from before a server restart may not have heard of it yet (a slow
        # path delays the reset) and claims until its last heartbeat + renew_deadline,
        # which was before the restart: our first claim waits until then.
        self._claims_wait_until = (asyncio.get_running_loop().time()
                                   + self._settings.timing.renew_deadline - float(server_uptime))
        self.lost.clear()
        session = self._session
        if session is not None and session.proxied and (
                self._probe is None or self._probe.done()):
            self._probe = asyncio.create_task(self._probe_pooler(session),
                                              name=f"pg-advisory-probe-{self.name}")
        log.debug("advisory lock granted", extra={"lease": self.name, "lock_id": self.key,
                                                  "pid": self.pid, "fencing_token": token})

    def _held(self) -> Grant:
        claim_delay = max(0.0, self._claims_wait_until - asyncio.get_running_loop().time())
        return Grant(held=True, valid_for=self._settings.timing.renew_deadline,
                     fencing_token=self._token, holder=self._settings.identity,
                     claim_delay=claim_delay)

    def _gone(self) -> Grant:
        self._levels, self._token = 0, None
        return Grant(held=False, reason="connection to PostgreSQL lost")

    def _refused(self) -> Grant:
        return Grant(held=False, reason=self.pooler or POOLER)

    async def _holder(self, conn: asyncpg.Connection) -> str | None:
        try:
            return await conn.fetchval(_HOLDER, *self._halves)
        except _DB_ERRORS as exc:
            raise self._db.error("look up the holder", exc) from None

    # Parameters of both: $1 key, $2 WAL message, $3 marker, $4 $5 the key's halves.
    # ``me`` runs first and once (the lock CTEs read it), so the checks see the session
    # as it was before this statement; the lock is only asked for on our own session
    # when that session does not hold it yet, and the xid only drawn after a grant.
    def _try_lock_sql(self, conn: asyncpg.Connection) -> str:
        return (f"with {_CHECK}, "
                f"lock as (select pg_try_advisory_lock($1) as got from me "
                f"where ours and not already) "
                f"select me.ours, me.already, case when lock.got then {_token_expr(conn)} end, "
                f"{_UPTIME}, case when lock.got then {_durable('$2')} end, "
                f"case when not me.ours then {_POISON} end "
                f"from me left join lock on true")

    def _wait_lock_sql(self, conn: asyncpg.Connection) -> str:
        # $6: lock_timeout, local to this statement's transaction.
        return (f"with {_CHECK}, "
                f"t as (select set_config('lock_timeout', $6, true) from me "
                f"where ours and not already), "
                f"lock as (select true as got from (select pg_advisory_lock($1) from t) l) "
                f"select me.ours, me.already, case when lock.got then {_token_expr(conn)} end, "
                f"{_UPTIME}, case when lock.got then {_durable('$2')} end, "
                f"case when not me.ours then {_POISON} end "
                f"from me left join lock on true")


# Seconds since the server (re)started, by the server's clock.
_UPTIME = "extract(epoch from clock_timestamp() - pg_postmaster_start_time())::float8"


def _token_expr(conn: asyncpg.Connection) -> str:
    if _version_num(conn) >= 130000:
        return "pg_current_xact_id()::text::int8"
    return "txid_current()"


async def _close(conn: asyncpg.Connection) -> None:
    try:
        await asyncio.wait_for(conn.close(), 2.0)
    except (*_DB_ERRORS, asyncio.CancelledError):
        conn.terminate()


class AdvisoryBackend:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._leases: dict[str, AdvisoryLease] = {}
        # Set once a transaction pooler was seen on any lease: the runtime exits with the
        # code of a bad setting (the DSN names a pooler the advisory lock cannot use).
        self.misconfigured = asyncio.Event()
        self.misconfiguration: str | None = None

    def lease(self, name: str) -> AdvisoryLease:
        if name not in self._leases:
            self._leases[name] = AdvisoryLease(self._settings, name, self._pooler_seen)
        return self._leases[name]

    def _pooler_seen(self, name: str, message: str) -> None:
        if self.misconfiguration is None:
            self.misconfiguration = message
            log.error(message, extra={"lease": name, "identity": self._settings.identity,
                                      "dsn": redact(self._settings.store.dsn)})
        # Every lease goes over the same DSN: none of them may claim any more.
        for lease in self._leases.values():
            if lease.pooler is None:
                lease.pooler_seen("another lease of this sidecar saw it")
        self.misconfigured.set()

    async def close(self) -> None:
        for lease in self._leases.values():
            await lease.close()


async def list_leases(settings: Settings, names: tuple[str, ...] | None) -> list[LeaseInfo]:
    """For ``lease-sidecar status``, from pg_locks: read-only, no schema, no lock taken.

    A lock id is a hash, so the leases cannot be listed: the names asked for (else the
    configured ones) are looked up. One "exists" while a session holds or awaits its
    lock; the holder's fencing token lives only in the holder (``GET /leader``).
    """
    db = _Conn(settings)
    conn = (await db.open()).conn
    try:
        rows = await conn.fetch(_ALL_LOCKS)
    except _DB_ERRORS as exc:
        raise db.error("list locks", exc) from None
    finally:
        await _close(conn)
    sessions: dict[int, list[asyncpg.Record]] = {}
    for row in rows:
        sessions.setdefault(key_from_halves(row[0], row[1]), []).append(row)
    result = []
    for name in names or settings.names:
        key = lock_id(settings.store.key_prefix, name)
        if key not in sessions:
            continue
        holder = next((r for r in sessions[key] if r["granted"]), None)
        details: dict[str, Any] = {"lock_id": key,
                                   "waiting": sum(not r["granted"] for r in sessions[key])}
        if holder is not None:
            details.update(pid=holder["pid"], backend_start=holder["backend_start"])
        result.append(LeaseInfo(lease=name, details=details,
                                holder=holder["application_name"] if holder else None))
    return result


def create(settings: Settings, clock: Clock) -> AdvisoryBackend:
    return AdvisoryBackend(settings)


ENTRY = BackendEntry(create=create, holds_by="session", needs_dsn=True,
                     check_dsn=check_postgres_url, list_leases=list_leases)
