"""The ``postgres`` backend's statements and the maths of its lock key.

The lock id is the first 8 bytes of SHA-256 of the lease's key (:meth:`StoreSettings.key
<sidecar.settings.StoreSettings.key>`) as a signed big-endian bigint: stable across processes and
versions, unlike Python's ``hash()``, and computable inside PostgreSQL with ``sha256()``.
``pg_locks`` shows a bigint key as two unsigned 32-bit halves (``classid``, ``objid``,
with ``objsubid = 1``).

Every statement that takes, checks or gives back the lock first checks, in the same
statement, that it runs on the server session carrying this connection's marker (see
:mod:`.session`), and a lock statement also that the session does not hold the key yet.
"""

from __future__ import annotations

import hashlib

from sidecar.lease.pg_timeline import TIMELINE, durable_commit


def lock_id(key: str) -> int:
    """First 8 bytes of SHA-256(``key``) as a signed big-endian bigint."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def lock_halves(key: int) -> tuple[int, int]:
    """``(classid, objid)`` as pg_locks shows a bigint advisory key."""
    unsigned = key & 0xFFFF_FFFF_FFFF_FFFF
    return unsigned >> 32, unsigned & 0xFFFF_FFFF


def key_from_halves(classid: int, objid: int) -> int:
    """The signed bigint key back from pg_locks' ``classid``/``objid``."""
    return int.from_bytes(((classid << 32) | objid).to_bytes(8, "big"), "big", signed=True)


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
# Seconds since the server (re)started, by the server's clock.
_UPTIME = "extract(epoch from clock_timestamp() - pg_postmaster_start_time())::float8"

# Heartbeat ($1 $2 the key's halves, $3 marker): (this statement ran on our session, that
# session holds the lock, the poison where it did not run on ours).
HOLDS = (f"select ours, {_MINE.replace('$4', '$1').replace('$5', '$2')}, "
         f"case when not ours then {_POISON} end from (select {_OURS} as ours) me")
# Unlock ($1 key, $2 marker, $3 how many grants) only on our own session: behind a pooler
# the statement may land on another client's.
UNLOCK = (f"select {_OURS.replace('$3', '$2')}, case when {_OURS.replace('$3', '$2')} then "
          "(select bool_and(pg_advisory_unlock($1)) from generate_series(1, $3)) end")
# Session settings ($1 names, $2 values), commits that flush before their reply (the
# token's transaction id must not repeat after a crash: pg_timeline.DURABLE_COMMIT) and
# the marker ($3) in one statement; the pid of the server session comes back.
APPLY = ("select pg_backend_pid(), (select count(set_config(name, value, false)) "
         "from unnest($1::text[], $2::text[]) s(name, value)), "
         f"{durable_commit(transaction=False)}, "
         f"set_config('{MARKER_SETTING}', $3, false)")
# What a fresh connection finds on the server session it was handed; it leaves a marker
# of its own there, so a transaction pooler that later hands that session to the lease's
# connection fails the lease's next check even when the probe itself found a clean one.
PROBE = (f"select current_setting('{MARKER_SETTING}', true), pg_backend_pid(), "
         f"set_config('{MARKER_SETTING}', 'probe', false)")
# Who holds a lock in this database (application_name is visible even across roles).
HOLDER = """select a.application_name from pg_locks l join pg_stat_activity a on a.pid = l.pid
            where l.locktype = 'advisory' and l.granted and l.classid = $1::int8::oid
            and l.objid = $2::int8::oid and l.objsubid = 1
            and l.database = (select oid from pg_database where datname = current_database())"""
# Every session holding or awaiting a bigint advisory lock in this database (standbys
# wait inside the server, so a contended lease shows its waiters even between holders).
ALL_LOCKS = """select l.classid::int8, l.objid::int8, l.granted, a.application_name, a.pid,
               a.backend_start
               from pg_locks l join pg_stat_activity a on a.pid = l.pid
               where l.locktype = 'advisory' and l.objsubid = 1
               and l.database = (select oid from pg_database
                                 where datname = current_database())"""


def try_lock_sql(server_version: int) -> str:
    """Take the lock if it is free: ``pg_try_advisory_lock``."""
    return _lock_sql("lock as (select pg_try_advisory_lock($1) as got from me "
                     "where ours and not already)", server_version)


def try_lock_many_sql(server_version: int) -> str:
    """Take every free lock of ``$1`` (distinct keys) in one statement and one commit: a
    shard group member that takes many shards at once (members that leave together free
    dozens each) paid one durable commit per shard on its one session, so the last shard
    waited for all the others' commits (hundreds of milliseconds).

    Parameters: $1 ``int8[]`` keys, $2 WAL message, $3 marker. Answers (ours, the keys the
    session held already, the keys granted, counter, timeline, server uptime, _, _), as
    :func:`_lock_sql` does for one key. The order is spelled out, since a statement's
    parts have none of their own: ``me`` (our marker, the locks the session holds) before
    any lock (``lock`` reads it); each key's lock only when ``me`` allows it (``CASE``
    evaluates in order, where the planner may reorder ``AND``); every lock before the
    counter (``lock``'s one row, its array complete, before the select list that draws
    the counter), so the counter is larger than any earlier holder's of every key.
    """
    return (f"with me as (select {_OURS} as ours, "
            "array(select (l.classid::int8 << 32) | l.objid::int8 from pg_locks l "
            "where l.locktype = 'advisory' and l.granted and l.objsubid = 1 "
            "and l.pid = pg_backend_pid()) as held), "
            "lock as (select array(select k from unnest($1::int8[]) k where case "
            "when me.ours and not k = any(me.held) then pg_try_advisory_lock(k) "
            "else false end) as got from me) "
            "select me.ours, array(select k from unnest($1::int8[]) k "
            "where k = any(me.held)), lock.got, "
            f"case when cardinality(lock.got) > 0 then {_token_expr(server_version)} end, "
            f"{TIMELINE}, {_UPTIME}, "
            f"case when cardinality(lock.got) > 0 then {_durable('$2')} end, "
            f"case when not me.ours then {_POISON} end "
            "from me, lock")


def wait_lock_sql(server_version: int) -> str:
    """Wait in the server for the lock, for at most ``$6`` (``lock_timeout``, local to this
    statement's transaction)."""
    return _lock_sql("t as (select set_config('lock_timeout', $6, true) from me "
                     "where ours and not already), "
                     "lock as (select true as got from (select pg_advisory_lock($1) from t) l)",
                     server_version)


def _lock_sql(lock_ctes: str, server_version: int) -> str:
    """A lock statement answering (ours, already, counter, timeline, server uptime, _, _).

    Parameters: $1 key, $2 WAL message, $3 marker, $4 $5 the key's halves. ``me`` runs
    first and once (the lock CTEs read it), so the checks see the session as it was
    before this statement; the lock is only asked for on our own session when that
    session does not hold it yet, and the token's counter only drawn after a grant.
    The server's timeline comes back with every attempt, granted or not: the process
    remembers when it first saw each one (:mod:`sidecar.lease.pg_timeline`).
    """
    return (f"with me as (select {_OURS} as ours, {_MINE} as already), {lock_ctes} "
            f"select me.ours, me.already, "
            f"case when lock.got then {_token_expr(server_version)} end, "
            f"{TIMELINE}, {_UPTIME}, case when lock.got then {_durable('$2')} end, "
            f"case when not me.ours then {_POISON} end "
            f"from me left join lock on true")


def _token_expr(server_version: int) -> str:
    """The fencing token's counter: a transaction id, drawn after the grant.

    Transaction ids are 64-bit (with epoch) and assigned in increasing order per cluster,
    so the next holder, who can only get the lock after this one let go, draws a larger
    one — on one timeline: a promoted standby may reuse ids it never received, which the
    timeline in the token's high bits outranks (:mod:`sidecar.lease.pg_timeline`).
    """
    if server_version >= 130000:
        return "pg_current_xact_id()::text::int8"
    return "txid_current()"


def _durable(param: str) -> str:
    """SQL that makes the token's transaction commit synchronously.

    A transaction that only drew an xid commits asynchronously (nothing to flush), so a
    crash right after an acquisition could hand the same xid — the same fencing token —
    to the next holder. A transactional WAL message gives the commit something to flush
    (and to wait for synchronous replicas, where configured).
    """
    return f"pg_logical_emit_message(true, 'lease-sidecar', {param}::text)"
