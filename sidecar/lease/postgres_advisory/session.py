"""One dedicated server session per lease: how it is opened, what it is told, and what a
pooler in between gives away.

The lock lives exactly as long as the server session, so a lease never uses a pool. The
session's own settings make the *server* wait longer than the client before it ends a
silent session (:func:`session_settings`).

A transaction pooler (PgBouncer ``pool_mode=transaction`` or ``statement``) breaks the one
assumption the lock rests on: that our client connection *is* one server session. Behind
it, session advisory locks are re-entrant per server session, so two clients handed the
same server session both "get" the lock, and the session (with the lock) outlives a killed
client. So every connection stores a random marker in a session-level setting of its
server session when it connects (:data:`.sql.APPLY`), and every lock statement checks it
(:mod:`.sql`); a sidecar alone on a transaction pool gives those checks nothing to see, so
after a grant through a pooler a fresh connection checks that it gets a session of its own
(:meth:`Connector.hands_out_used_sessions`).

Statements are never named prepared statements (``statement_cache_size=0``): behind a
transaction pooler a named statement can be bound on another client's session, where the
same name may hold a different statement; an unnamed one is parsed and run in one server
link (asyncpg sends Parse/Describe with Flush, not Sync, so the pooler keeps the link).
Session pooling (``pool_mode=session``) passes every check and works.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from dataclasses import dataclass

import asyncpg

from sidecar.base.errors import BackendError
from sidecar.base.redact import redact
from sidecar.lease import pg_session
from sidecar.lease.pg_session import PREPARED_STATEMENT_ERRORS, error_line, version_num
from sidecar.lease.pg_timeline import ERA_TABLE, era_ddl, era_sql
from sidecar.lease.postgres_advisory.sql import APPLY, PROBE
from sidecar.settings import Timing

log = logging.getLogger("sidecar.lease.postgres")

# Ways an asyncpg call fails because of the server or the connection (not a bug here).
# InternalClientError: asyncpg's protocol state after the server ended the session unasked.
DB_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError,
             asyncpg.exceptions.InternalClientError, OSError, TimeoutError)

POOLER = ("a transaction pooler is in the way (PgBouncer pool_mode=transaction): the postgres "
          "backend's advisory lock needs a server session of its own; use "
          "LEASE_BACKEND=postgres-row through the pooler, or connect to PostgreSQL directly "
          "or through pool_mode=session")


def application_name(identity: str) -> str:
    """The identity cut to PostgreSQL's 63-byte limit (on a character boundary)."""
    return identity.encode()[:63].decode(errors="ignore")


def session_settings(timing: Timing, server_version: int) -> dict[str, str]:
    """Per-session settings so the server outlasts the client's own step-down.

    The client stops claiming ``renew_deadline`` after its last successful heartbeat was
    sent, and no claim outlives that; the server must not end the session (freeing the
    lock) sooner. ``idle_session_timeout`` (PostgreSQL 14+) of about the lease duration
    frees the lock of a frozen holder, while the heartbeat keeps a healthy session busy;
    older servers have no such setting, and the kernel keeps answering TCP keepalives for
    a stopped process. ``server_version`` is ``server_version_num`` (e.g. 150004).
    """
    silent = math.ceil(timing.renew_deadline + timing.claim_horizon + 1.0)
    values = {
        # A role's statement_timeout, lock_timeout or idle_in_transaction_session_timeout
        # would cancel the in-server wait (whose lock_timeout is set per statement) or end
        # the session: a reconnect each time (:mod:`sidecar.lease.pg_session`).
        **pg_session.overrides(server_version),
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
    # decides how a session that already holds our key is read (``AdvisoryLease._check``).
    proxied: bool
    # An in-server wait on this session ended in lock_timeout. PostgreSQL can grant the
    # lock and still raise lock_timeout when the two race, and a session-level lock
    # survives its statement's error: the session may hold the lock although we were
    # told no.
    maybe_holds: bool = False
    # A fresh connection is to check that this session is not handed around: when it
    # opens, after each grant, and again after a check that could not tell.
    probe_due: bool = True
    # The token era's base on this session's server (sidecar.lease.pg_timeline): tokens
    # are (timeline + base) * 2^42 + counter. 0 where the era table is missing.
    era_base: int = 0


class Connector:
    """Opens the sessions of one DSN; errors become one redacted line."""

    def __init__(self, dsn: str | None, identity: str, timing: Timing,
                 schema: str = "lease", ensure_schema: bool = False) -> None:
        self.dsn = dsn
        # Where the token era's table is (LEASE_SCHEMA), if it is anywhere; created where
        # it is missing with LEASE_ENSURE_SCHEMA.
        self._schema = schema
        self._era = era_sql(schema)
        self._ensure_schema = ensure_schema
        self._era_missing_logged = False
        self.where = redact(dsn) or "postgres"
        self._application_name = application_name(identity)
        self._timing = timing
        # Connecting and ordinary statements get the renew deadline (at least 1 s): a
        # heartbeat slower than that could not keep the claim anyway.
        self.timeout = max(1.0, timing.renew_deadline)
        # The role's timeouts are named once, on the first session.
        self._reported = False

    def error(self, what: str, exc: BaseException) -> BackendError:
        detail = pg_session.describe(exc) or " ".join((str(exc) or type(exc).__name__).split())
        return BackendError(f"postgres {self.where}: {what}: {detail}")

    async def open(self, era: bool = False) -> Session:
        """A session with our settings and a fresh marker; with ``era`` (a lease's own
        session) also the token era's base, recorded for this server."""
        try:
            conn = await asyncpg.connect(
                self.dsn, timeout=self.timeout, command_timeout=self.timeout,
                statement_cache_size=0,  # unnamed statements only (module docstring)
                server_settings={"application_name": self._application_name})
        except (*DB_ERRORS, ValueError) as exc:
            raise self.error("cannot connect", exc) from None
        marker = uuid.uuid4().hex
        if not self._reported:
            self._reported = True
            await pg_session.report(conn, backend="postgres", overridden=True)
        try:
            values = session_settings(self._timing, version_num(conn))
            pid, _, _, _ = await conn.fetchrow(APPLY, list(values), list(values.values()),
                                               marker)
            era_base = await self._era_base(conn) if era else 0
        except DB_ERRORS as exc:
            conn.terminate()
            raise self.error("cannot apply session settings", exc) from None
        return Session(conn, marker, int(pid), proxied=conn.get_server_pid() != pid,
                       era_base=era_base)

    async def _era_base(self, conn: asyncpg.Connection) -> int:
        """The token era's base (:func:`sidecar.lease.pg_timeline.era_sql`), recording this
        server's era; 0 where the era table is missing (the era is then the timeline,
        and a warning says what a pg_upgrade would do)."""
        try:
            row = await conn.fetchrow(self._era)
        except asyncpg.UndefinedTableError:
            if self._ensure_schema:
                await create_era_table(conn, self._schema)
                self._ensure_schema = False
                return await self._era_base(conn)
            if not self._era_missing_logged:
                self._era_missing_logged = True
                log.warning("no token era table: after a pg_upgrade of a cluster that ever "
                            "failed over, fencing tokens would be smaller than before; "
                            "create it with `lease-sidecar schema --apply`",
                            extra={"backend": "postgres", "table": ERA_TABLE})
            return 0
        return int(row[1]) if row is not None else 0

    async def hands_out_used_sessions(self, session: Session,
                                      quiet: asyncio.Lock) -> bool | None:
        """Does a fresh connection get a server session that already carries a marker?
        None: it could not tell (no connection, or no answer in time).

        The lock statements' checks need a second client to share or swap a session before
        they can see anything; a sidecar left alone on a transaction pool (its rivals
        refused and exited) would otherwise lead on, unwarned, and standbys whose lock
        waits keep landing on their own pooled sessions would never meet the session a
        killed holder left with the lock. The probe's statement runs while the lease's own
        statements are held back (``quiet``, the lease's lock): the server session the lease
        used last is then idle, and a transaction pooler, which by default hands out the
        session released last, gives it to the probe, still carrying our marker (or
        another client's). Where it opens a new one instead, the probe's own marker stays
        on it, and the pooler hands that session, now the one released last, to our next
        statement, whose check fails. Without ``quiet`` a heartbeat in flight kept our
        session busy, the probe got another, and our session, released after it, came
        back to us: nothing seen, ever (seen in CI on a loaded machine). A session pooler
        gives the probe a new or reset session and never hands it to us, or makes it wait
        for one: the wait, which holds the lease's statements back, is cut at one renew
        interval, and says nothing (None).
        """
        try:
            conn = await asyncpg.connect(
                self.dsn, timeout=self.timeout, statement_cache_size=0,
                server_settings={"application_name": self._application_name})
        except (*DB_ERRORS, ValueError):
            return None
        try:
            async with quiet:
                marker, pid, _ = await conn.fetchrow(
                    PROBE, timeout=min(self.timeout, self._timing.renew_interval))
        except DB_ERRORS:
            return None
        finally:
            await close(conn)
        return bool(pid == session.backend_pid or marker)


async def create_era_table(conn: asyncpg.Connection, schema: str) -> None:
    """The token era's table, idempotent: ``schema --apply`` and LEASE_ENSURE_SCHEMA.
    Guarded like the row lease's provisioning: sidecars starting together would race on
    the catalog."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))",
                           f"lease-sidecar schema {schema}.{ERA_TABLE}")
        await conn.execute(era_ddl(schema))


class Link:
    """One lease's dedicated session over time, and the grants it holds on it.

    Session-level advisory locks stack: each grant needs one unlock, so grants are
    counted. Dropping the session (closing the socket) ends it on the server and frees its
    locks, so a session whose lock state is uncertain is dropped, never kept.
    """

    def __init__(self, connector: Connector, name: str, lock_id: int) -> None:
        self._db = connector
        self._name = name
        self._lock_id = lock_id
        # Set the moment the session holding the lock drops; cleared on a grant.
        self.lost = asyncio.Event()
        self.session: Session | None = None
        self.levels = 0
        self.token: int | None = None

    @property
    def pid(self) -> int | None:
        """Backend pid of the session (what pg_locks shows as the holder)."""
        session = self.session
        return session.backend_pid if session and not session.conn.is_closed() else None

    def alive(self) -> bool:
        return self.session is not None and not self.session.conn.is_closed()

    async def connect(self) -> Session:
        """The live session, opened anew when there is none."""
        if self.session is None or self.session.conn.is_closed():
            self.drop()
            session = await self._db.open(era=True)
            session.conn.add_termination_listener(self._terminated)
            self.session = session
        return self.session

    def granted(self, token: int) -> None:
        self.levels += 1
        self.token = int(token)
        self.lost.clear()

    def forget(self) -> int:
        """Stop counting the grants (given back, or gone); how many there were."""
        levels, self.levels, self.token = self.levels, 0, None
        return levels

    def drop(self) -> None:
        """Forget the session; closing the socket ends the session and its locks."""
        session, self.session = self.session, None
        if self.levels:
            self.lost.set()
        self.levels, self.token = 0, None
        if session is not None and not session.conn.is_closed():
            session.conn.terminate()

    async def close(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            await close(session.conn)

    def _terminated(self, conn: asyncpg.Connection) -> None:
        """The session ended (server restart, pg_terminate_backend, network)."""
        session = self.session
        if session is None or conn is not session.conn:
            return
        if self.levels:
            log.warning("lost the PostgreSQL session holding the lock", extra={
                "lease": self._name, "lock_id": self._lock_id, "pid": session.backend_pid})
            self.lost.set()
        self.levels, self.token, self.session = 0, None, None


async def close(conn: asyncpg.Connection) -> None:
    """Close politely for up to 2 s, else drop the socket (which ends the session too)."""
    try:
        await asyncio.wait_for(conn.close(), 2.0)
    except (*DB_ERRORS, asyncio.CancelledError):
        conn.terminate()


def pooler_evidence(exc: BaseException) -> str | None:
    """Evidence of a transaction pooler in an asyncpg error, or None."""
    if isinstance(exc, PREPARED_STATEMENT_ERRORS):
        return f"prepared statements vanish or clash between statements: {error_line(exc)}"
    return None
