"""The advisory lock's hand-over hint: the holder's own session, its ``application_name``
naming the successor (:class:`sidecar.lease.Successor`).

Nothing to create and nothing a plain role may not do: any session may set its own
``application_name``, and every role sees every session's ``application_name`` in
``pg_stat_activity`` (the lock holder is found the same way). The releasing holder tags
the session that holds the lock ``lease-next <lock id> <identity>`` just before it lets
go, and sets its own name back after the hint's bound. The session stays open after the
release, so the hint lives on; it ends with the bound, or with the session — a dead
holder leaves no hint. One round trip on a session that is already there: a session
of its own for the hint cost a connect, longer than a claim horizon on a loaded host.

Standbys queued inside the server (``pg_advisory_lock``) are served in order when the
lock is freed, whatever any hint says. The statement that tags the session also cancels
the waits of the other queued sessions (``pg_cancel_backend``: allowed on sessions of
its own role); a standby whose wait ends reads the hint and queues no more. A wait that
is not cancelled (another role's, or one queued just after) and is granted at the
release is given back at once: the standby reads the hint before it uses a grant
(:meth:`~sidecar.lease.postgres_advisory.lease.AdvisoryLease.handing_to_other`), and the
named standby, queued behind it, has the lock a round trip later.
"""

from __future__ import annotations

import logging

from sidecar.lease.postgres_advisory.session import (
    DB_ERRORS,
    Connector,
    Session,
    application_name,
)

log = logging.getLogger("sidecar.lease.postgres")

PREFIX = "lease-next "
# Live hints for one lock in this database ($1: the LIKE pattern of the lock's tags).
HINTS = """select application_name from pg_stat_activity
           where application_name like $1 and datname = current_database()"""
# Tags this session as the hint ($1) and cancels the waits of the sessions queued for
# the lock ($2 $3 its halves) other than the named one's ($4), where the role may (its
# own sessions); the rest are given back when granted (see the module doc).
NAME_AND_CLEAR = """
select set_config('application_name', $1, false),
       (select count(pg_cancel_backend(l.pid))
        from pg_locks l join pg_stat_activity a on a.pid = l.pid
        where l.locktype = 'advisory' and not l.granted
        and l.classid = $2::int8::oid and l.objid = $3::int8::oid and l.objsubid = 1
        and a.application_name is distinct from $4
        and l.database = (select oid from pg_database where datname = current_database())
        and pg_has_role(a.usesysid, 'member'))"""


def _lock_tag(lock_id: int) -> str:
    return f"{PREFIX}{lock_id & 0xFFFF_FFFF_FFFF_FFFF:x} "


def tag(lock_id: int, identity: str) -> str:
    """The hint's ``application_name``, cut to PostgreSQL's 63 bytes (identities longer
    than about 35 bytes are compared by that prefix)."""
    return application_name(_lock_tag(lock_id) + identity)


class Hint:
    """The hint of one lease: written by its holder, read by its standbys."""

    def __init__(self, connector: Connector, lock_id: int, halves: tuple[int, int],
                 identity: str) -> None:
        self._db = connector
        self._lock_id = lock_id
        self._halves = halves
        self._own_name = application_name(identity)
        self._own_tag = tag(lock_id, identity)

    async def name(self, session: Session, identity: str) -> None:
        """Tag ``session`` (the holder's) with the hint, and clear the lock's queue of
        other standbys' waits where the role may: one round trip."""
        try:
            await session.conn.fetchrow(NAME_AND_CLEAR, tag(self._lock_id, identity),
                                        *self._halves, application_name(identity))
        except DB_ERRORS as exc:
            raise self._db.error("name the next holder", exc) from None

    async def unname(self, session: Session) -> None:
        """The hint's bound is over: ``session`` carries our own name again."""
        await session.conn.execute("select set_config('application_name', $1, false)",
                                   self._own_name)

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
