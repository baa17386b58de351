"""PostgreSQL timelines: fencing tokens that outrank a promotion, and no claim across one.

Every promotion of a standby starts a new *timeline* (1 for a cluster made by initdb).
A promoted standby may never have received the last commits of its old primary, so
counters it continues (transaction ids, sequences) can repeat or go back. Both
PostgreSQL backends therefore put the timeline in the token's high bits::

    token = timeline * 2^42 + counter        (counter: txid, or the row lease's sequence)

A token drawn after a promotion outranks every token of the timelines before it, and
stays a JSON-safe integer (≤ 2^53 - 1, exact in JavaScript). Tokens from before this
layout (plain counters) are smaller than every new one, since the timeline is ≥ 1. A
timeline ≥ 2^11 or a counter ≥ 2^42 would break the order: the lease refuses to hold
then, with a one-line reason (fail closed). The timeline is read from the name of the
WAL file of the current position (:data:`TIMELINE`), which a plain role may do.

A promotion also ends the old primary's holder's proof without telling it: it claims
until its last successful renew + its validity (``renew_deadline`` for the advisory
lock, ``lease_duration`` for rows), and its lock or row may not exist on the new
primary. So a holder granted on a timeline that began less than that long ago — as far
as anybody here can prove — waits before its first claim (``Grant.claim_delay``) until
then. What proves a timeline old (:class:`Timelines`, :func:`checkpoint_age`): timeline 1
was never promoted; this process saw the timeline earlier; or the server's latest
checkpoint was taken on it (``pg_control_checkpoint()``, if the role may run it) that
long ago. Anything else counts as "just promoted".

``pg_upgrade`` starts the new cluster at timeline 1 again (it runs ``pg_resetwal -l
00000001…``) while transaction ids and sequences go on: on a cluster that ever failed
over, every token after the upgrade would be smaller than every token before. So the
high bits are the *era*, ``timeline + base``, with ``base`` kept in a one-row table
(:data:`ERA_TABLE`) that pg_upgrade carries over like any data. Whenever a sidecar's
session starts it runs :func:`era_sql`: the table remembers the highest era handed out,
and a timeline whose era would be lower (the upgrade) raises ``base`` to that highest
era, so the next tokens outrank all earlier ones. ``base`` jumps to the highest era
itself, not just past it: a standby promoted later without that write (the upgrade's
first era lost with the last commits) computes ``timeline + highest`` from the highest
era the upgrade copied, still above the era it lost. Without the table (created by
``lease-sidecar schema --apply``) the era is the timeline, as before.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("sidecar.lease")

COUNTER_BITS = 42
TIMELINE_LIMIT = 1 << 11   # timelines 1 … 2047
COUNTER_LIMIT = 1 << COUNTER_BITS
# The server's current timeline: the first 8 hex digits of the WAL file name of the
# current write position. Fails on a standby (recovery in progress), where no lease may
# be granted anyway.
TIMELINE = "('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int8"
# When the server's postmaster started, in microseconds since the epoch. An era read from
# the table holds for the server it was read on, and a timeline alone does not name that
# server: a pg_upgrade starts timelines over, so a store that last read the era on
# timeline 1 before a failover (2) and an upgrade (1 again) saw "its" timeline and drew
# tokens below those handed out on timeline 2. Every restart, promotion and upgrade
# starts a new postmaster.
SERVER_START = "(extract(epoch FROM pg_postmaster_start_time()) * 1000000)::int8"
# The latest checkpoint's timeline and age by the server's clock. checkpoint_time is
# stored in whole seconds (rounded down), hence the extra second in checkpoint_age.
CHECKPOINT = ("select timeline_id::int8, "
              "extract(epoch from clock_timestamp() - checkpoint_time)::float8 "
              "from pg_control_checkpoint()")
# A commit that draws a token must be flushed before its reply: with synchronous_commit
# off (set for a role, a database or the server), a crash right after it loses the commit
# and the counters go back with it — the same transaction id or sequence value, the same
# token, is drawn again, and a row lease's takeover vanishes while its holder claims. So
# the sidecar's own statements turn "off" into "on" ({local}: for the statement's own
# transaction, which works through a transaction pooler too, or for the session);
# "local", "remote_write", "on" and "remote_apply" already flush before the reply and
# stay as set (a failover that loses a commit is answered by the timeline).
DURABLE_COMMIT = ("set_config('synchronous_commit', CASE current_setting('synchronous_commit') "
                  "WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, {local})")


# The era table (one row) in the schema LEASE_SCHEMA names.
ERA_TABLE = "token_era"


def era_ddl(schema: str, create_schema: bool = True) -> str:
    """The era table, idempotent (part of ``lease-sidecar schema``)."""
    table = f'"{schema}"."{ERA_TABLE}"'
    return ((f'CREATE SCHEMA IF NOT EXISTS "{schema}";\n' if create_schema else "")
            + f"CREATE TABLE IF NOT EXISTS {table} (\n"
            "    id      int PRIMARY KEY CHECK (id = 1),\n"
            "    base    int NOT NULL,\n"
            "    highest int NOT NULL\n"
            ");\n"
            f"INSERT INTO {table} (id, base, highest) VALUES (1, 0, 0) "
            "ON CONFLICT (id) DO NOTHING;")


def era_sql(schema: str) -> str:
    """``(timeline, base, server start)``: the server's timeline and the era's base,
    recording this timeline's era (see the module doc), durably, and the server's
    :data:`SERVER_START`, which the era holds for. The row is written every time, so that
    sidecars starting together after an upgrade wait for one another's write and each
    computes the base from the row as the last one left it (not from a snapshot older
    than that write). Once per session (the advisory lock) or per server a row lease
    store writes to: rare."""
    table = f'"{schema}"."{ERA_TABLE}"'
    lower = "cur.t + e.base < e.highest"
    return (f"WITH cur AS (SELECT {TIMELINE} AS t, {SERVER_START} AS s, "
            f"{durable_commit(transaction=True)} AS d) "
            f"UPDATE {table} e SET "
            f"base = CASE WHEN {lower} THEN e.highest ELSE e.base END, "
            f"highest = greatest(e.highest, cur.t + CASE WHEN {lower} THEN e.highest "
            "ELSE e.base END) "
            "FROM cur WHERE e.id = 1 RETURNING cur.t, e.base, cur.s")


def durable_commit(transaction: bool) -> str:
    """SQL that makes this transaction's (or this session's) commits flush before their
    reply (see :data:`DURABLE_COMMIT`)."""
    return DURABLE_COMMIT.format(local="true" if transaction else "false")


# A token that would not fit tells the user what to read.
OUT_OF_RANGE = ("fencing token out of range (timeline ≥ 2048 or counter ≥ 2^42, the "
                "token would pass 2^53 - 1): refusing to hold; see "
                "docs/high-availability.md")


def token(timeline: int, counter: int, base: int = 0) -> int | None:
    """``(timeline + base) * 2^42 + counter`` (``base``: the era's, :func:`era_sql`), or
    None when either part is out of range."""
    era = timeline + base
    if not (1 <= era < TIMELINE_LIMIT and 0 <= counter < COUNTER_LIMIT):
        return None
    return (era << COUNTER_BITS) + counter


def timeline_of(token: int) -> int:
    """The era a token was drawn in: its timeline where no pg_upgrade happened (0 for a
    token from before this layout)."""
    return token >> COUNTER_BITS


class Timelines:
    """What one sidecar process has seen of its server's timelines, on its own clock."""

    def __init__(self) -> None:
        self._first_seen: dict[int, float] = {}

    def saw(self, timeline: int, at: float) -> None:
        """A reply at ``at`` (monotonic) reported ``timeline``: it began before ``at``."""
        self._first_seen.setdefault(timeline, at)

    def age(self, timeline: int, now: float) -> float:
        """Seconds the timeline is known to have existed: infinite for 1 (never
        promoted), else since this process first saw it (0 when it never did)."""
        if timeline <= 1:
            return math.inf
        return now - self._first_seen.get(timeline, now)


async def checkpoint_age(ask: Callable[[], Awaitable[Any]], timeline: int,
                         where: str) -> float:
    """Seconds the timeline is known to have existed from the server's latest checkpoint
    (taken on ``timeline``, so after its promotion); 0 when it cannot tell: the
    checkpoint is older than the promotion, or the role may not run
    ``pg_control_checkpoint()`` (managed services may revoke it). ``ask`` runs
    :data:`CHECKPOINT` and returns its one row."""
    try:
        row = await ask()
    except Exception as exc:  # any failure only means "cannot tell": wait
        log.debug("pg_control_checkpoint() unavailable; a new timeline counts as just "
                  "promoted", extra={"where": where, "error": " ".join(str(exc).split())})
        return 0.0
    checkpoint_timeline, age = row
    if int(checkpoint_timeline) != timeline:
        return 0.0
    return max(0.0, float(age) - 1.0)


def claim_delay(hold: float, known_age: float) -> float:
    """Seconds to wait before the first claim: the old primary's holders may claim for
    ``hold`` after the promotion, which was at least ``known_age`` ago."""
    return max(0.0, hold - known_age)
