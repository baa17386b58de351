"""The advisory lock's hand-over hint: a session whose ``application_name`` names the
successor (:class:`sidecar.lease.Successor`).

Nothing to create and nothing a plain role may not do: any session may set its own
``application_name``, and every role sees every session's ``application_name`` in
``pg_stat_activity`` (the lock holder is found the same way). The releasing holder opens
one extra session tagged ``lease-next <lock id> <identity>`` and keeps it for the
hint's bound; it ends then, or with the holder's process — a dead holder leaves no hint.

Standbys queued inside the server (``pg_advisory_lock``) are served in order when the
lock is freed, whatever any hint says; so the holder, before it lets go, cancels the
waits of the other queued sessions (``pg_cancel_backend``: allowed on sessions of its
own role) and waits until every queued session is the named one's. Where it may not
cancel, a standby's in-server wait ends by itself within about one renew interval, and
a standby that sees the hint queues no more. Bounded: at worst the first queued standby
wins, as without a hint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sidecar.lease.postgres_advisory.session import (
    DB_ERRORS,
    Connector,
    Session,
    application_name,
    close,
)
from sidecar.settings import Timing

log = logging.getLogger("sidecar.lease.postgres")

PREFIX = "lease-next "
# Live hints for one lock in this database ($1: the LIKE pattern of the lock's tags).
HINTS = """select application_name from pg_stat_activity
           where application_name like $1 and datname = current_database()"""
# Sessions queued for the lock ($1 $2 its halves) other than the named one's ($3).
QUEUED_OTHERS = """select l.pid from pg_locks l join pg_stat_activity a on a.pid = l.pid
                   where l.locktype = 'advisory' and not l.granted
                   and l.classid = $1::int8::oid and l.objid = $2::int8::oid
                   and l.objsubid = 1 and a.application_name is distinct from $3
                   and l.database = (select oid from pg_database
                                     where datname = current_database())"""
# Ends their waits at once where the role may (its own sessions; else they end by
# their lock_timeout): the standby drops that session and, on its next try, reads the hint.
CANCEL = "select pg_cancel_backend(pid) from unnest($1::int[]) pid"
QUEUE_POLL = 0.02


def _lock_tag(lock_id: int) -> str:
    return f"{PREFIX}{lock_id & 0xFFFF_FFFF_FFFF_FFFF:x} "


def tag(lock_id: int, identity: str) -> str:
    """The hint's ``application_name``, cut to PostgreSQL's 63 bytes (identities longer
    than about 35 bytes are compared by that prefix)."""
    return application_name(_lock_tag(lock_id) + identity)


class Hint:
    """The hint of one lease: written by its holder, read by its standbys."""

    def __init__(self, connector: Connector, lock_id: int, halves: tuple[int, int],
                 identity: str, timing: Timing) -> None:
        self._db = connector
        self._lock_id = lock_id
        self._halves = halves
        self._own_tag = tag(lock_id, identity)
        self._timing = timing
        self._session: Session | None = None
        self._expiry: asyncio.Task[None] | None = None

    async def name(self, identity: str, bound: float) -> None:
        """Open the tagged session for ``bound`` seconds, then wait (bounded) until no
        other standby is queued for the lock."""
        await self.close()
        session = await self._db.open()
        try:
            await session.conn.execute("select set_config('application_name', $1, false)",
                                       tag(self._lock_id, identity))
        except DB_ERRORS as exc:
            await close(session.conn)
            raise self._db.error("name the next holder", exc) from None
        self._session = session
        self._expiry = asyncio.create_task(self._end_after(bound), name="pg-advisory-hint")
        loop = asyncio.get_running_loop()
        # A standby's in-server wait lasts its retry delay: the renew interval, +20 %.
        deadline = loop.time() + self._timing.renew_interval * 1.2 + 0.5
        target = application_name(identity)
        cancelled: set[int] = set()
        with contextlib.suppress(*DB_ERRORS):
            while loop.time() < deadline:
                queued = {row[0] for row in await session.conn.fetch(
                    QUEUED_OTHERS, *self._halves, target)}
                if not queued:
                    break
                if queued - cancelled:
                    cancelled |= queued
                    with contextlib.suppress(*DB_ERRORS):
                        await session.conn.fetch(CANCEL, list(queued))
                await asyncio.sleep(QUEUE_POLL)

    async def named_other(self, session: Session) -> str | None:
        """What a live hint names (cut as in :func:`tag`), unless it names us."""
        prefix = _lock_tag(self._lock_id)
        try:
            tags = await session.conn.fetch(HINTS, prefix + "%")
        except DB_ERRORS as exc:
            raise self._db.error("read the hand-over hint", exc) from None
        others: list[str] = [t[0] for t in tags if t[0] != self._own_tag]
        if not others or len(others) < len(tags):
            return None  # none, or one names us (an older one may linger: ours wins)
        return others[0][len(prefix):]

    async def close(self) -> None:
        expiry, self._expiry = self._expiry, None
        if expiry is not None:
            expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expiry
        session, self._session = self._session, None
        if session is not None:
            await close(session.conn)

    async def _end_after(self, bound: float) -> None:
        await asyncio.sleep(bound)
        session, self._session = self._session, None
        if session is not None:
            await close(session.conn)
