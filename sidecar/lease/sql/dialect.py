"""SQL text of the row lease for PostgreSQL and for SQL Server (T-SQL).

Statements use ``:name`` placeholders; each driver compiles them to its own parameter
style (``$1`` for asyncpg, ``?`` for ODBC), so the SQL stays independent of the driver.
Every statement a lease operation runs is one statement or one batch: one round trip.

Both dialects take every time from the server (``now()``, ``SYSDATETIMEOFFSET()``), never
from the client, so client clock skew cannot move an expiry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Any

from sidecar.base.names import validate_identifier
from sidecar.lease import pg_timeline
from sidecar.lease.rowlease import Row
from sidecar.settings import MAX_IDENTITY

# ``:name`` but not the ``::`` of a PostgreSQL cast.
_PLACEHOLDER = re.compile(r"(?<![:\w]):([a-z_]+)\b")

# The lease-name column's size: a longer key (prefix included) cannot be stored. The
# owner column is MAX_IDENTITY wide.
MAX_ROW_NAME = 200


@dataclass(frozen=True)
class Statement:
    text: str

    @cached_property
    def names(self) -> tuple[str, ...]:
        """Parameter names in order of appearance (repeats included)."""
        return tuple(match.group(1) for match in _PLACEHOLDER.finditer(self.text))

    def qmark(self) -> tuple[str, tuple[str, ...]]:
        """ODBC style: one ``?`` per occurrence, values passed in that order."""
        return _PLACEHOLDER.sub("?", self.text), self.names

    def numeric(self) -> tuple[str, tuple[str, ...]]:
        """asyncpg style: ``$n`` per distinct name, values passed once each."""
        order: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in order:
                order.append(match.group(1))
            return f"${order.index(match.group(1)) + 1}"

        return _PLACEHOLDER.sub(number, self.text), tuple(order)


class Dialect:
    """What a :class:`~sidecar.lease.sql.store.SqlRowStore` needs from a dialect.

    ``acquire`` returns the row's columns plus a ``won`` column: true when this
    statement inserted the row or took an expired one over, false when it only read a
    live row; where ``acquire_reports_release``, then a column that is true when the row
    taken over carried the release record of its own term (``Row.previous_claims_ended``).
    """

    schema: str
    table: str
    # NOTIFY channel that release and the expiry sweep signal; None where there is none.
    channel: str | None
    acquire: Statement
    renew: Statement
    release: Statement
    read: Statement
    read_replica: Statement
    # Every row with a last ``live`` column (unexpired by the server's clock), for status.
    list_all: Statement
    # The latest checkpoint's (timeline, age in seconds), where versions carry a timeline.
    checkpoint: Statement | None = None
    # (timeline, base, server start) of the token's era (sidecar.lease.pg_timeline), where
    # versions carry one; its parameters ``era_tl``, ``era_base`` and ``era_start`` then go
    # with every write.
    era: Statement | None = None
    # A shard group's round trip (sidecar.lease.rowgroup: every held row renewed as
    # ``renew`` renews one, the member row written or dropped, the live members read;
    # rows ``('lease', name, version)`` and ``('member', owner, NULL)``) and the live
    # members alone (``lease-sidecar status``); None: the dialect has no shard groups.
    group_beat: Statement | None = None
    group_members: Statement | None = None
    # The acquire's row ends with the server's timeline (after ``won``), won or lost.
    acquire_reports_timeline = False
    # The release keeps the row, expired, with the release record in ``metadata``, and
    # the acquire reports whether the row it took over carried it (after ``won``).
    acquire_reports_release = False

    def schema_script(self) -> str:
        """The DDL, idempotent, as ``lease-sidecar schema --print`` shows it."""
        raise NotImplementedError

    def provision_script(self) -> str:
        """What ``schema --apply`` runs: the DDL, guarded where the server needs it."""
        return self.schema_script()

    def decode(self, row: tuple[Any, ...]) -> Row:
        raise NotImplementedError


class PostgresDialect(Dialect):
    """Table ``{schema}.{table}``; the version is ``timeline * 2^42 + nextval(sequence)``
    (:mod:`sidecar.lease.pg_timeline`), so the fencing token keeps growing across holders
    even though release deletes the row, and across a promotion even when the standby
    missed the last increments of the sequence. A version out of that range is NULL,
    which the table refuses (NOT NULL): the statement fails, nothing is held."""

    checkpoint = Statement(pg_timeline.CHECKPOINT)
    acquire_reports_timeline = True
    acquire_reports_release = True

    def __init__(self, schema: str = "lease", table: str = "leases") -> None:
        self.schema = validate_identifier("schema", schema)
        self.table = validate_identifier("table", table)
        t = f'"{schema}"."{table}"'
        seq = f'"{schema}"."{table}_version_seq"'
        # pg_notify takes any text as a channel; LISTEN needs it under 64 bytes.
        self.channel = f"{schema}.{table}"[:63]
        raw = "owner_instance_id, version, expires_at"
        row = "owner_instance_id, version, extract(epoch FROM expires_at)::float8"
        duration = "make_interval(secs => CAST(:duration AS float8))"
        # Drawn with every write of a row (an acquire, a renew), in the write's own
        # transaction, which is made to flush before its reply (pg_timeline's
        # DURABLE_COMMIT: a lost takeover would bring the previous term's row back, and
        # a lost sequence value come again).
        # The era (pg_timeline): the timeline plus the era's base, read by the store
        # (``era``); NULL — the write fails and the store reads the era again — when the
        # server is no longer the one it was read on: another timeline, or the same one
        # on a server started since (pg_timeline.SERVER_START: a pg_upgrade starts
        # timelines over). ``era_tl`` -1: no era table, the timeline is the era.
        era = "t + CAST(:era_base AS int8)"
        version = (f"(SELECT CASE WHEN (CAST(:era_tl AS int8) < 0 OR (t = CAST(:era_tl AS int8) "
                   "AND s = CAST(:era_start AS int8))) "
                   f"AND {era} BETWEEN 1 AND {pg_timeline.TIMELINE_LIMIT - 1} "
                   f"AND c < {pg_timeline.COUNTER_LIMIT} THEN (({era}) << "
                   f"{pg_timeline.COUNTER_BITS}) + c END "
                   f"FROM (SELECT {pg_timeline.TIMELINE} AS t, {pg_timeline.SERVER_START} AS s, "
                   f"nextval('{seq}') AS c, "
                   f"{pg_timeline.durable_commit(transaction=True)} AS d) v)")
        # ``metadata`` (a column of the design's table) holds the release record:
        # ``released:<version>`` once a holder released that term after its claims ran
        # out; the acquire that takes such a row over writes ``after-release``, any other
        # acquire NULL. The record names the version it was written on, so it only counts
        # for that very row: a takeover, a renew or a re-insert draws a new version.
        released = "'released:' || l.version"
        self._ddl = f"""CREATE SCHEMA IF NOT EXISTS "{schema}";
CREATE SEQUENCE IF NOT EXISTS {seq};
CREATE TABLE IF NOT EXISTS {t} (
    lease_name        varchar({MAX_ROW_NAME})  PRIMARY KEY,
    owner_instance_id varchar({MAX_IDENTITY})  NOT NULL,
    acquired_at       timestamptz   NOT NULL,
    renewed_at        timestamptz   NOT NULL,
    expires_at        timestamptz   NOT NULL,
    metadata          varchar(1024),
    version           bigint        NOT NULL
);
CREATE INDEX IF NOT EXISTS "{table}_expires_at_idx" ON {t} (expires_at);
{pg_timeline.era_ddl(schema, create_schema=False)}"""
        self.era: Statement | None = Statement(pg_timeline.era_sql(schema))
        # One statement. The sweep skips our own name on purpose: a data-modifying CTE
        # and the INSERT run on the same snapshot, so if the sweep deleted the very row
        # the upsert conflicts with, the outcome would hang on execution order. Our own
        # expired row is instead taken over by the upsert's WHERE (expired → take over).
        # The sweep must never wait while it holds a row: contenders of two names that
        # sweep each other's expired rows and then wait on their own row deadlock (seen
        # under stress; PostgreSQL breaks it after a second with an error). So it starts
        # only once the upsert has settled — reading ``won`` forces that, and the upsert's
        # wait is then the only one, taken while we hold nothing — and it skips rows
        # another transaction has locked (they are someone's upsert or sweep anyway).
        # When we lose, the last SELECT reads the row so the caller learns who holds it,
        # flagged ``won = false``: that read sees the statement's snapshot, which can
        # predate a rival's takeover that ON CONFLICT waited for, so only ``won`` decides.
        # Only a live row is taken over or reported — never refreshed, ours included:
        # acquire comes only from a contender that does not hold the lease, so a live row
        # naming us belongs to a second process with our identity (see rowlease). The
        # CROSS JOIN forces the NOTIFY for swept rows to be evaluated. The release
        # record is judged on the row the upsert itself locked and replaced (``l``), not
        # on the statement's snapshot, which may be older. The sweep leaves a row with
        # its release record for one lease duration (ours) past its release: the record
        # spares that lease's next holder a claim horizon, and in a burst of moves (a
        # shard group's members joining or stopping together) other names' acquires
        # swept nearly every one first.
        self.acquire = Statement(f"""WITH won AS (
    INSERT INTO {t} AS l (lease_name, owner_instance_id, acquired_at, renewed_at,
                          expires_at, version)
    VALUES (CAST(:name AS varchar), CAST(:owner AS varchar), now(), now(),
            now() + {duration}, {version})
    ON CONFLICT (lease_name) DO UPDATE SET
        owner_instance_id = excluded.owner_instance_id,
        acquired_at = excluded.acquired_at,
        renewed_at = excluded.renewed_at,
        expires_at = excluded.expires_at,
        version = excluded.version,
        metadata = CASE WHEN l.metadata = {released} THEN 'after-release' END
    WHERE l.expires_at <= now()
    RETURNING {raw}, metadata
), sweep AS (
    DELETE FROM {t} WHERE lease_name IN (
        SELECT lease_name FROM {t}
        WHERE expires_at <= now() AND lease_name <> CAST(:name AS varchar)
          AND (metadata IS DISTINCT FROM 'released:' || version
               OR expires_at <= now() - {duration})
          AND (SELECT count(*) FROM won) >= 0
        FOR UPDATE SKIP LOCKED)
    RETURNING lease_name
), woken AS (
    SELECT count(pg_notify('{self.channel}', lease_name)) AS n FROM sweep
)
SELECT {row}, won, after_release, {pg_timeline.TIMELINE} FROM (
    SELECT {raw}, true AS won, coalesce(metadata = 'after-release', false) AS after_release
    FROM won
    UNION ALL
    SELECT {raw}, false, false FROM {t}
    WHERE lease_name = CAST(:name AS varchar) AND expires_at > now()
      AND NOT EXISTS (SELECT 1 FROM won)
) AS r CROSS JOIN woken""")
        # Like ROWVERSION, every write draws a new version, so a replica showing the
        # version proves it has this exact write. Renew needs the version of our own
        # last write or a later one: after a promotion the row may be missing or an
        # older write of ours (the standby never got the newer one), and such a row
        # proves nothing — the holder steps down instead of reviving it. A later one is
        # our own renew that committed while its reply was lost (the driver timed out
        # waiting for a stalled synchronous standby, say): refusing it ended the term
        # and left the row blocking everyone, the holder too, for a whole lease. (A
        # later term of a second process with our identity cannot be live while a renew
        # of ours still counts: ours expires first, and a reply after our validity is
        # not used.)
        self.renew = Statement(f"""UPDATE {t}
SET renewed_at = now(), expires_at = now() + {duration},
    version = {version}
WHERE lease_name = CAST(:name AS varchar) AND owner_instance_id = CAST(:owner AS varchar)
  AND version >= CAST(:version AS int8) AND expires_at > now()
RETURNING {row}""")
        # Release expires our row of this term (exactly its version: a later term of a
        # second process with our identity must never get our release record) in place
        # and, when asked
        # (:meth:`sidecar.lease.Lease.release`), records the release. (Other names'
        # acquires leave such a row for a lease duration, then sweep it like any expired
        # row; a next holder that comes later inserts afresh and, finding no record,
        # waits one claim horizon.)
        self.release = Statement(f"""WITH gone AS (
    UPDATE {t} AS l SET expires_at = least(l.expires_at, now()),
        metadata = CASE WHEN CAST(:record AS int4) = 1 THEN {released} END
    WHERE lease_name = CAST(:name AS varchar) AND owner_instance_id = CAST(:owner AS varchar)
      AND version = CAST(:version AS int8)
    RETURNING lease_name
)
SELECT pg_notify('{self.channel}', lease_name) FROM gone""")
        self.read = Statement(
            f"SELECT {row} FROM {t} WHERE lease_name = CAST(:name AS varchar) "
            "AND expires_at > now()")
        # A standby's clock is not the primary's: compare versions, not expiry.
        self.read_replica = Statement(
            f"SELECT {row} FROM {t} WHERE lease_name = CAST(:name AS varchar)")
        # 1/0, not a boolean: ODBC drivers may hand a boolean over as the text '0'.
        self.list_all = Statement(
            f"SELECT lease_name, {row}, CASE WHEN expires_at > now() THEN 1 ELSE 0 END "
            f"FROM {t} ORDER BY lease_name")
        # One statement whatever the number of shards. The renew is ``renew``'s, row by
        # row (ours, unexpired, our last write's version or a later one; one version
        # drawn for the statement); a member row is no lease (version 0, never a token)
        # and is swept like any expired row. The members are read by prefix with
        # ``left`` (LIKE would take a name's ``_`` for a wildcard), on the statement's
        # snapshot: our own row as this statement leaves it comes from ``joined``
        # (nothing when ``gone`` dropped it; data-modifying CTEs always run).
        live_members = (f"SELECT lease_name, owner_instance_id FROM {t} WHERE left(lease_name, "
                        "length(CAST(:prefix AS varchar))) = CAST(:prefix AS varchar) "
                        "AND expires_at > now()")
        self.group_beat = Statement(f"""WITH renewed AS (
    UPDATE {t} AS l SET renewed_at = now(), expires_at = now() + {duration},
        version = {version}
    FROM unnest(CAST(:names AS varchar[]), CAST(:versions AS int8[])) AS h(name, held)
    WHERE l.lease_name = h.name AND l.owner_instance_id = CAST(:owner AS varchar)
      AND l.version >= h.held AND l.expires_at > now()
    RETURNING l.lease_name, l.version
), joined AS (
    INSERT INTO {t} (lease_name, owner_instance_id, acquired_at, renewed_at, expires_at,
                     version)
    SELECT CAST(:member AS varchar), CAST(:owner AS varchar), now(), now(),
           now() + {duration}, 0
    WHERE CAST(:advertise AS int4) = 1
    ON CONFLICT (lease_name) DO UPDATE SET owner_instance_id = excluded.owner_instance_id,
        renewed_at = excluded.renewed_at, expires_at = excluded.expires_at
    RETURNING owner_instance_id
), gone AS (
    DELETE FROM {t} WHERE lease_name = CAST(:member AS varchar)
      AND CAST(:advertise AS int4) = 0
    RETURNING lease_name
)
SELECT 'lease', lease_name, version FROM renewed
UNION ALL
SELECT 'member', owner_instance_id, NULL FROM joined
UNION ALL
SELECT 'member', owner_instance_id, NULL FROM ({live_members}) m
WHERE lease_name <> CAST(:member AS varchar)""")
        self.group_members = Statement(f"SELECT owner_instance_id FROM ({live_members}) m")

    def schema_script(self) -> str:
        return self._ddl

    def provision_script(self) -> str:
        # Several sidecars may start at once; CREATE … IF NOT EXISTS alone can still race
        # on the catalog, so provisioning holds a transaction-scoped advisory lock.
        lock = f"lease-sidecar schema {self.channel}"
        return f"SELECT pg_advisory_xact_lock(hashtext('{lock}'));\n" + self._ddl

    def decode(self, row: tuple[Any, ...]) -> Row:
        owner, version, expires = row
        return Row(owner=owner, version=int(version),
                   expires_at=datetime.fromtimestamp(float(expires), tz=UTC))


class TsqlDialect(Dialect):
    """``[schema].[table]`` as docs/design.md specifies it; ROWVERSION is the fencing token."""

    channel = None

    def __init__(self, schema: str = "lease", table: str = "Leases") -> None:
        self.schema = validate_identifier("schema", schema)
        self.table = validate_identifier("table", table)
        t = f"[{schema}].[{table}]"
        out = "inserted.OwnerInstanceId, inserted.ExpiresAtUtc, inserted.RowVersion"
        expiry = "DATEADD(millisecond, :duration_ms, SYSDATETIMEOFFSET())"
        # CREATE SCHEMA must be alone in its batch, hence sp_executesql. ``Metadata``
        # belongs to the design's table; the sidecar leaves it NULL.
        self._ddl = f"""IF SCHEMA_ID(N'{schema}') IS NULL
BEGIN
    EXEC sp_executesql N'CREATE SCHEMA [{schema}]';
END;
IF OBJECT_ID(N'{t}', N'U') IS NULL
BEGIN
    CREATE TABLE {t} (
        LeaseName       NVARCHAR({MAX_ROW_NAME})     NOT NULL CONSTRAINT [PK_{table}] PRIMARY KEY,
        OwnerInstanceId NVARCHAR({MAX_IDENTITY})     NOT NULL,
        AcquiredAtUtc   DATETIMEOFFSET(7) NOT NULL,
        RenewedAtUtc    DATETIMEOFFSET(7) NOT NULL,
        ExpiresAtUtc    DATETIMEOFFSET(7) NOT NULL,
        Metadata        NVARCHAR(1024)    NULL,
        RowVersion      ROWVERSION        NOT NULL
    );
END;
IF NOT EXISTS (SELECT 1 FROM sys.indexes
               WHERE name = N'IX_{table}_ExpiresAtUtc' AND object_id = OBJECT_ID(N'{t}'))
BEGIN
    CREATE INDEX [IX_{table}_ExpiresAtUtc] ON {t} (ExpiresAtUtc);
END;"""
        # One batch, one round trip. SYSDATETIMEOFFSET() is a runtime constant within a
        # statement. The sweep and the MERGE are separate statements run in order, so
        # (unlike PostgreSQL's CTEs) the MERGE sees the sweep's deletes. The lock hints
        # make MERGE's read-then-write atomic against a competing caller. The winner's
        # row goes to @won; when we lose, the live row is read instead, so one result set
        # names the holder; ``Won`` says which, so the store never mistakes a read row
        # for a win. As in the PostgreSQL acquire, a live row is never refreshed, not
        # even one naming us. READPAST: the sweep skips rows others hold instead of
        # waiting on them while it holds rows of its own (the deadlock the PostgreSQL
        # sweep had under stress).
        self.acquire = Statement(f"""SET NOCOUNT ON;
DECLARE @won TABLE (OwnerInstanceId NVARCHAR({MAX_IDENTITY}), ExpiresAtUtc DATETIMEOFFSET(7),
                    RowVersion BINARY(8));
DELETE FROM {t} WITH (READPAST) WHERE ExpiresAtUtc <= SYSDATETIMEOFFSET();
MERGE {t} WITH (UPDLOCK, HOLDLOCK, ROWLOCK) AS target
USING (SELECT :name AS LeaseName, :owner AS OwnerInstanceId) AS source
ON target.LeaseName = source.LeaseName
WHEN MATCHED AND target.ExpiresAtUtc <= SYSDATETIMEOFFSET() THEN
    UPDATE SET OwnerInstanceId = source.OwnerInstanceId,
               AcquiredAtUtc = SYSDATETIMEOFFSET(),
               RenewedAtUtc = SYSDATETIMEOFFSET(),
               ExpiresAtUtc = {expiry}
WHEN NOT MATCHED THEN
    INSERT (LeaseName, OwnerInstanceId, AcquiredAtUtc, RenewedAtUtc, ExpiresAtUtc)
    VALUES (source.LeaseName, source.OwnerInstanceId, SYSDATETIMEOFFSET(),
            SYSDATETIMEOFFSET(), {expiry})
OUTPUT {out} INTO @won;
IF EXISTS (SELECT 1 FROM @won)
    SELECT OwnerInstanceId, ExpiresAtUtc, RowVersion, CAST(1 AS BIT) AS Won FROM @won;
ELSE
    SELECT OwnerInstanceId, ExpiresAtUtc, RowVersion, CAST(0 AS BIT) AS Won FROM {t}
    WHERE LeaseName = :name AND ExpiresAtUtc > SYSDATETIMEOFFSET();""")
        self.renew = Statement(f"""UPDATE {t}
SET RenewedAtUtc = SYSDATETIMEOFFSET(), ExpiresAtUtc = {expiry}
OUTPUT {out}
WHERE LeaseName = :name AND OwnerInstanceId = :owner AND ExpiresAtUtc > SYSDATETIMEOFFSET();""")
        # Only our term's row as we last wrote it (its RowVersion): the worker thread
        # of a release the elector stopped waiting for still sends it, and without the
        # version it could delete the next term's row — ours again, or a second
        # process's under our identity.
        self.release = Statement(
            f"DELETE FROM {t} WHERE LeaseName = :name AND OwnerInstanceId = :owner "
            "AND RowVersion = CAST(CAST(:version AS BIGINT) AS BINARY(8));")
        self.read = Statement(
            f"SELECT OwnerInstanceId, ExpiresAtUtc, RowVersion FROM {t} "
            "WHERE LeaseName = :name AND ExpiresAtUtc > SYSDATETIMEOFFSET();")
        # Dirty reads on purpose: an AG secondary must not block on the redo thread, and
        # only a RowVersion byte-equal to the primary's counts anyway.
        self.read_replica = Statement(
            f"SELECT OwnerInstanceId, ExpiresAtUtc, RowVersion FROM {t} WITH (READUNCOMMITTED) "
            "WHERE LeaseName = :name;")
        self.list_all = Statement(
            f"SELECT LeaseName, OwnerInstanceId, ExpiresAtUtc, RowVersion, "
            "CASE WHEN ExpiresAtUtc > SYSDATETIMEOFFSET() THEN 1 ELSE 0 END "
            f"FROM {t} ORDER BY LeaseName;")

    def schema_script(self) -> str:
        return self._ddl

    def decode(self, row: tuple[Any, ...]) -> Row:
        owner, expires, version = row
        return Row(owner=owner, version=rowversion_to_int(version), expires_at=expires)


def rowversion_to_int(value: bytes) -> int:
    """ROWVERSION is 8 bytes, big-endian, and only grows within a database."""
    return int.from_bytes(bytes(value), "big")
