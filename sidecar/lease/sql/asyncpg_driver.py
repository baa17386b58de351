"""Statements over asyncpg: a small pool for lease statements, one LISTEN connection.

Each lease statement is one prepared statement per pooled connection; after the first
use a call is one Bind/Execute/Sync exchange — one round trip (the pool's reset query on
release is skipped, see ``_keep_session``). Nothing depends on session state, so a
transaction-pooling proxy (PgBouncer ``pool_mode=transaction``) may sit in between, with
two changes the driver makes by itself when it finds one:

- Named prepared statements are off (``statement_cache_size=0``). Through a transaction
  pooler a client's named statement lives on whichever server session prepared it: the
  next call may land on a session where the name is missing, or taken by another client
  ("prepared statement "__asyncpg_stmt_1__" already exists" — every asyncpg process
  numbers its statements from 1), or, worst, names another client's different statement.
  Unnamed statements are parsed and run in one server link (asyncpg sends Parse/Describe
  with Flush, then Bind/Execute/Sync: the pooler lets go of the server only at the Sync),
  at the price of a second round trip per call. This works with every PgBouncer version;
  ``max_prepared_statements`` (PgBouncer ≥ 1.21) is not needed.
- No LISTEN: a LISTEN through a transaction pooler registers on some pooled server
  session and its notifications reach whoever holds that session next (or nobody), so
  standbys fall back to polling at their retry interval (the renew interval).

A pooler is found at connect time: it answers the startup with process/key data of its
own (PgBouncer makes them up, so cancel requests come to it), which differs from the
``pg_backend_pid()`` of the server session. As a second line, a prepared-statement
error switches to unnamed statements at once (the failed call ran nothing on the server,
so it is retried once on the new pool). Session pooling is treated the same way (it
cannot be told apart): it only costs the same round trip and the wake-ups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import asyncpg

from sidecar.base.clock import Wakeups
from sidecar.base.errors import BackendError, NotFound
from sidecar.base.redact import redact
from sidecar.lease import pg_session
from sidecar.lease.pg_session import (
    PREPARED_STATEMENT_ERRORS,
    error_line,
    first_line,
    version_num,
)
from sidecar.lease.sql.dialect import Statement

log = logging.getLogger("sidecar.lease.sql")


class AsyncpgDriver:
    def __init__(self, dsn: str, *, timeout: float, label: str = "postgres-row",
                 max_size: int = 4) -> None:
        self._dsn = dsn
        self._timeout = timeout
        self._label = label
        self._max_size = max_size
        self._pool: asyncpg.Pool | None = None
        self._pool_lock = asyncio.Lock()
        self._listener: asyncpg.Connection | None = None
        self._listen_task: asyncio.Future[None] | None = None
        self._listening: set[str] = set()
        # Per (channel, payload), and (channel, None) for any payload: the payload is the
        # released lease's name, and a standby waits for its own lease's only.
        self._notified: Wakeups[tuple[str, str | None]] = Wakeups()
        # None until the first connection tells; True behind a pooler or proxy.
        self.pooled: bool | None = None

    # -- statements ----------------------------------------------------------------------
    async def fetch(self, statement: Statement,
                    params: Mapping[str, object]) -> list[tuple[Any, ...]]:
        text, names = statement.numeric()
        args = [params[n] for n in names]
        for attempt in (1, 2):
            pool = await self._get_pool()
            try:
                records = await pool.fetch(text, *args, timeout=self._timeout)
            except PREPARED_STATEMENT_ERRORS as exc:
                # Bind or Parse failed: the statement did not run, so once more is safe.
                if attempt == 2 or self.pooled:
                    raise self._error(exc) from None
                await self._switch_to_unnamed(pool, exc)
                continue
            except Exception as exc:
                raise self._error(exc) from None
            return [tuple(record) for record in records]
        raise AssertionError("unreachable")

    async def script(self, sql: str) -> None:
        """Run a parameterless script (DDL) in one transaction."""
        pool = await self._get_pool()
        try:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute(sql)
        except Exception as exc:
            raise self._error(exc) from None

    async def _get_pool(self) -> asyncpg.Pool:
        async with self._pool_lock:
            if self._pool is None:
                try:
                    if self.pooled is None:
                        await self._probe()
                    extra = {"statement_cache_size": 0} if self.pooled else {}
                    # min_size=0: no connection floor. asyncpg keeps a floor by
                    # reconnecting in the background and logs every failed try with a
                    # traceback; the lease calls' own errors already say the server is gone.
                    self._pool = await asyncpg.create_pool(
                        self._dsn, min_size=0, max_size=self._max_size,
                        timeout=self._timeout, command_timeout=self._timeout,
                        reset=_keep_session, init=self._init_session, **extra)
                except Exception as exc:
                    raise self._error(exc) from None
            return self._pool

    async def _probe(self) -> None:
        """Is a pooler between us and the server? (See the module docstring.)"""
        conn = await asyncpg.connect(self._dsn, timeout=self._timeout,
                                     command_timeout=self._timeout, statement_cache_size=0)
        try:
            pid = await conn.fetchval("SELECT pg_backend_pid()")
            self.pooled = pid != conn.get_server_pid()
            await pg_session.report(conn, backend=self._label, overridden=not self.pooled)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 2.0)
        if self.pooled:
            self._log_pooled("its process id differs from the server session's")

    async def _init_session(self, conn: asyncpg.Connection) -> None:
        """Every new connection: turn off the role's timeouts (:mod:`..pg_session`) on its
        own session; not behind a pooler, whose server sessions other clients share."""
        if not self.pooled:
            await pg_session.apply(conn, pg_session.overrides(version_num(conn)))

    async def _switch_to_unnamed(self, pool: asyncpg.Pool, exc: BaseException) -> None:
        async with self._pool_lock:
            if self._pool is pool:
                self._pool = None
                self.pooled = True
                self._log_pooled(f"prepared statements failed: {describe_error(exc)}")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(pool.close(), 5.0)
        await self._drop_listener()

    def _log_pooled(self, evidence: str) -> None:
        log.info("connected through a connection pooler: unnamed statements only (two round "
                 "trips per call) and no NOTIFY wake-ups (standbys poll at their retry "
                 "interval)", extra={"backend": self._label, "dsn": redact(self._dsn),
                                     "evidence": evidence})

    # -- wake-ups ------------------------------------------------------------------------
    async def wait_for_notify(self, channel: str, timeout: float, since: float,
                              payload: str | None = None) -> None:
        """Return on a NOTIFY on ``channel`` (carrying ``payload``, when one is given),
        or at once if one arrived after ``since``.

        Best effort: the first wait sets up the LISTEN connection (in a task of its own,
        so a short wait never cancels a half-open connect); while it is not up this just
        sleeps, and the caller's retry interval bounds how late a standby notices.
        """
        if self.pooled is None:
            # The pool's first connection tells whether a pooler is in between.
            with contextlib.suppress(BackendError):
                await self._get_pool()
        if self.pooled is not False:
            await asyncio.sleep(timeout)  # polling: the caller retries after this
            return
        if not self.is_listening(channel):
            if self._listen_task is None or self._listen_task.done():
                self._listen_task = asyncio.ensure_future(self._listen(channel))
            loop = asyncio.get_running_loop()
            started = loop.time()
            # Shielded: a wait that ends early must not abort a half-open connect.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._listen_task), timeout)
            timeout -= loop.time() - started
            if not self.is_listening(channel):
                await asyncio.sleep(max(0.0, timeout))
                return
        await self._notified.wait((channel, payload), timeout, since)

    def is_listening(self, channel: str) -> bool:
        return (self._listener is not None and not self._listener.is_closed()
                and channel in self._listening)

    async def _listen(self, channel: str) -> None:
        try:
            if self._listener is None or self._listener.is_closed():
                self._listening = set()
                self._listener = await asyncpg.connect(self._dsn, timeout=self._timeout)
                self._listener.add_termination_listener(self._listener_lost)
                await self._init_session(self._listener)  # idle by design
            await self._listener.add_listener(channel, self._on_notify)
            self._listening.add(channel)
        except Exception as exc:
            # Quiet: wake-ups are an optimisation; the lease statements report real trouble.
            log.debug("LISTEN unavailable", extra={"error": str(self._error(exc))})
            await self._drop_listener()

    def _on_notify(self, conn: object, pid: int, channel: str, payload: str) -> None:
        now = asyncio.get_running_loop().time()
        self._notified.announce((channel, None), now)
        self._notified.announce((channel, payload), now)

    async def _drop_listener(self) -> None:
        conn, self._listener = self._listener, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), 2.0)

    def _listener_lost(self, conn: object) -> None:
        # Reconnected quietly by the next wait.
        self._listener = None

    async def close(self) -> None:
        if self._listen_task is not None:
            self._listen_task.cancel()
            with contextlib.suppress(BaseException):
                await self._listen_task
        await self._drop_listener()
        if self._pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._pool.close(), 5.0)
            self._pool = None

    # -- errors --------------------------------------------------------------------------
    def _error(self, exc: BaseException) -> BackendError:
        # A missing table is "not found" to ``status``, which must never create it.
        kind = NotFound if isinstance(exc, asyncpg.UndefinedTableError) else BackendError
        return kind(f"{self._label} {redact(self._dsn)}: {describe_error(exc)}")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """Skip asyncpg's reset query on pool release (``RESET ALL; UNLISTEN *; …``): our
    statements leave no session state, and the reset would double the round trips."""


def describe_error(exc: BaseException) -> str:
    """One line: login failed, network unreachable, missing table, a timeout setting that
    ended the statement, or the server's words."""
    if (line := pg_session.describe(exc)) is not None:
        return line
    if isinstance(exc, asyncpg.InvalidAuthorizationSpecificationError):
        return f"login failed ({exc.__class__.__name__}: {first_line(str(exc))})"
    if isinstance(exc, asyncpg.UndefinedTableError):
        return (f"{first_line(str(exc))}; run `lease-sidecar schema --apply` to create the "
                "lease table")
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, OSError | asyncpg.ConnectionDoesNotExistError
                  | asyncpg.CannotConnectNowError):
        return f"network unreachable ({error_line(exc)})"
    return error_line(exc)
