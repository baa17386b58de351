"""The fencing guard: SQL the *application* runs inside its own transaction, so that the
database itself refuses the writes of a leader that was paused past its claim.

One table and one routine, in a schema of the sidecar's (``LEASE_SCHEMA``, default
``lease``), with names of their own so they can live in the application's database:

- PostgreSQL: ``lease.lease_fence(name text, token bigint)`` over the table
  ``lease.lease_fence``;
- SQL Server: ``[lease].[lease_fence] @name, @token`` over ``[lease].[LeaseFence]``.

``lease_fence(name, token)`` locks the name until the transaction ends. A token lower
than the highest one recorded is refused with :data:`STALE_SQLSTATE` (SQL Server: error
:data:`SQLSERVER_STALE_ERROR`), and the error aborts the transaction; a higher one is
recorded under an exclusive lock; an equal one passes under a shared lock, so one
leader's transactions do not queue behind each other. A newer leader's first guarded
transaction therefore waits for the old leader's guarded transactions in flight to end,
and every old-leader transaction after it fails: a transaction's other writes commit only
if no newer leader wrote first. Every backend's tokens stay below 2^53 and fit ``bigint``.

On PostgreSQL the lock is a transaction-scoped advisory lock on the name (shared or
exclusive), not a row lock: a shared row lock writes the row (and, with several holders,
a multixact) in every transaction, which cost a third of a single-row insert's
throughput (bench/bench_fence.py); under REPEATABLE READ and SERIALIZABLE the row is
share-locked too, so a newer leader's commit fails the transaction (40001) instead of
staying unseen by its snapshot. On SQL Server it is ``UPDLOCK, HOLDLOCK`` on the row:
one leader's transactions queue there.

This module only builds text (``lease-sidecar fence-schema --print``); it imports
nothing beyond the standard library, so :mod:`sidecar.client` can share its facts.
``lease-sidecar fence-schema --apply`` (:mod:`sidecar.cli.fence_schema`) runs it.
"""

from __future__ import annotations

from sidecar.base.names import validate_identifier

# The SQLSTATE of a refused (stale) token on PostgreSQL: class "LF" (lease fence) lies in
# the range the SQL standard leaves to implementations, and PostgreSQL uses no "LF".
STALE_SQLSTATE = "LF001"
# A call that cannot be judged (no name, no or a negative token): the standard
# invalid_parameter_value.
BAD_CALL_SQLSTATE = "22023"
# SQL Server: THROW numbers (user errors are 50000 and up). The first is a refusal; the
# second a misuse (bad arguments, or no open transaction to guard).
SQLSERVER_STALE_ERROR = 50409
SQLSERVER_BAD_CALL_ERROR = 50410
# What starts the refusal's message on both servers (clients that see only a message,
# as ODBC's do, recognise it by this and by the number).
STALE_MESSAGE = "lease_fence: stale fencing token"

DIALECTS = ("postgres", "sqlserver")
POSTGRES_TABLE = "lease_fence"
POSTGRES_FUNCTION = "lease_fence"
SQLSERVER_TABLE = "LeaseFence"
SQLSERVER_PROCEDURE = "lease_fence"
# PostgreSQL: the guard's transaction-scoped advisory locks are (LOCK_CLASS,
# hashtext(name)), the two-key form, which shares no key with one-key advisory locks
# (the postgres backend's lease locks are those). The value is "fnce" in ASCII.
LOCK_CLASS = 0x666E6365
# The widest name either server stores: the lease-name column of the row leases.
MAX_NAME = 200


def postgres_script(schema: str = "lease") -> str:
    """The PostgreSQL DDL, idempotent (``CREATE … IF NOT EXISTS``, ``CREATE OR REPLACE``)."""
    s = _schema(schema)
    table = f'"{s}".{POSTGRES_TABLE}'
    return f"""CREATE SCHEMA IF NOT EXISTS "{s}";
CREATE TABLE IF NOT EXISTS {table} (
    name        varchar({MAX_NAME}) PRIMARY KEY,
    token       bigint       NOT NULL,
    advanced_at timestamptz  NOT NULL DEFAULT now()
);
-- Call it inside the transaction it guards, before (or with) the writes:
--   SELECT "{s}".{POSTGRES_FUNCTION}('jobs', 42);
-- A token lower than the highest seen raises SQLSTATE {STALE_SQLSTATE}.
CREATE OR REPLACE FUNCTION "{s}".{POSTGRES_FUNCTION}(lease_name text, fencing_token bigint)
RETURNS bigint
LANGUAGE plpgsql
AS $fence$
DECLARE
    highest bigint;
BEGIN
    IF lease_name IS NULL OR lease_name = '' OR fencing_token IS NULL
       OR fencing_token < 0 THEN
        RAISE EXCEPTION USING ERRCODE = '{BAD_CALL_SQLSTATE}', MESSAGE = format(
            'lease_fence: needs a lease name and a fencing token >= 0, got %L and %s',
            lease_name, coalesce(fencing_token::text, 'NULL'));
    END IF;
    SELECT token INTO highest FROM {table} WHERE name = lease_name;
    IF FOUND AND highest = fencing_token THEN
        -- The same leader again: its transactions share the name's lock.
        PERFORM pg_advisory_xact_lock_shared({LOCK_CLASS}, hashtext(lease_name));
    ELSIF NOT FOUND OR highest < fencing_token THEN
        -- A newer leader (or the first): it waits until every transaction that holds
        -- the lock under an older token has ended, and none starts anew meanwhile.
        PERFORM pg_advisory_xact_lock({LOCK_CLASS}, hashtext(lease_name));
        INSERT INTO {table} AS f (name, token) VALUES (lease_name, fencing_token)
        ON CONFLICT (name) DO UPDATE SET token = excluded.token, advanced_at = now()
        WHERE f.token < excluded.token;
    END IF;
    -- Again under the lock: a newer leader may have committed while this one waited.
    -- READ COMMITTED reads it with a fresh snapshot; a transaction with one snapshot
    -- for all its statements locks the row, so a newer commit fails it (40001) instead
    -- of staying unseen.
    IF current_setting('transaction_isolation') = 'read committed' THEN
        SELECT token INTO highest FROM {table} WHERE name = lease_name;
    ELSE
        SELECT token INTO highest FROM {table} WHERE name = lease_name FOR SHARE;
    END IF;
    IF highest > fencing_token THEN
        RAISE EXCEPTION USING ERRCODE = '{STALE_SQLSTATE}', MESSAGE = format(
            '{STALE_MESSAGE} %s for lease %L: the highest seen is %s',
            fencing_token, lease_name, highest),
            HINT = 'This process no longer leads: roll back and ask the sidecar again.';
    END IF;
    RETURN highest;
END
$fence$;"""


def postgres_provision(schema: str = "lease") -> str:
    """What ``fence-schema --apply`` runs on PostgreSQL: the DDL under a transaction-scoped
    advisory lock, since CREATE … IF NOT EXISTS alone can race on the catalog when several
    apply at once."""
    lock = f"lease-sidecar fence-schema {_schema(schema)}"
    return f"SELECT pg_advisory_xact_lock(hashtext('{lock}'));\n" + postgres_script(schema)


def sqlserver_procedure(schema: str = "lease") -> str:
    """The T-SQL procedure, as the server stores it (the script creates it through
    ``sp_executesql``: ``CREATE OR ALTER PROCEDURE`` must be alone in its batch)."""
    s = _schema(schema)
    table = f"[{s}].[{SQLSERVER_TABLE}]"
    return f"""CREATE OR ALTER PROCEDURE [{s}].[{SQLSERVER_PROCEDURE}]
    @name NVARCHAR({MAX_NAME}), @token BIGINT
AS
BEGIN
    SET NOCOUNT ON;
    -- An error rolls the caller's whole transaction back, not only this statement.
    SET XACT_ABORT ON;
    DECLARE @highest BIGINT;
    IF @@TRANCOUNT = 0
    BEGIN
        THROW {SQLSERVER_BAD_CALL_ERROR},
            N'lease_fence: call it inside the transaction it guards', 1;
    END;
    IF @name IS NULL OR @name = N'' OR @token IS NULL OR @token < 0
    BEGIN
        THROW {SQLSERVER_BAD_CALL_ERROR},
            N'lease_fence: needs a lease name and a fencing token >= 0', 1;
    END;
    -- UPDLOCK, HOLDLOCK: the row (or, while it is missing, its key range) stays locked
    -- until the transaction ends.
    SELECT @highest = Token FROM {table} WITH (UPDLOCK, HOLDLOCK) WHERE Name = @name;
    IF @highest IS NULL
    BEGIN
        INSERT INTO {table} (Name, Token, AdvancedAtUtc)
        VALUES (@name, @token, SYSDATETIMEOFFSET());
    END;
    IF @token > @highest
    BEGIN
        UPDATE {table} SET Token = @token, AdvancedAtUtc = SYSDATETIMEOFFSET()
        WHERE Name = @name;
    END;
    IF @token < @highest
    BEGIN
        DECLARE @message NVARCHAR(2048) = CONCAT(N'{STALE_MESSAGE} ', @token,
            N' for lease ''', @name, N''': the highest seen is ', @highest);
        THROW {SQLSERVER_STALE_ERROR}, @message, 1;
    END;
END"""


def sqlserver_script(schema: str = "lease") -> str:
    """The T-SQL DDL, idempotent, one batch."""
    s = _schema(schema)
    table = f"[{s}].[{SQLSERVER_TABLE}]"
    procedure = sqlserver_procedure(s).replace("'", "''")
    return f"""IF SCHEMA_ID(N'{s}') IS NULL
BEGIN
    EXEC sp_executesql N'CREATE SCHEMA [{s}]';
END;
IF OBJECT_ID(N'{table}', N'U') IS NULL
BEGIN
    CREATE TABLE {table} (
        Name          NVARCHAR({MAX_NAME})     NOT NULL
                      CONSTRAINT [PK_{SQLSERVER_TABLE}] PRIMARY KEY,
        Token         BIGINT            NOT NULL,
        AdvancedAtUtc DATETIMEOFFSET(7) NOT NULL
    );
END;
EXEC sp_executesql N'{procedure}';"""


def script(dialect: str, schema: str = "lease") -> str:
    """``fence-schema --print``'s text for ``dialect``."""
    return postgres_script(schema) if _dialect(dialect) == "postgres" else sqlserver_script(
        schema)


def call(dialect: str, schema: str = "lease", placeholder: str = "%s") -> str:
    """The statement an application sends, name first and token second, with the driver's
    ``placeholder`` (``%s`` psycopg, ``$1``/``$2`` asyncpg (pass ``$``), ``?`` ODBC)."""
    first, second = ("$1", "$2") if placeholder == "$" else (placeholder, placeholder)
    s = _schema(schema)
    if _dialect(dialect) == "postgres":
        return (f'SELECT "{s}".{POSTGRES_FUNCTION}(CAST({first} AS text), '
                f"CAST({second} AS bigint))")
    return f"EXEC [{s}].[{SQLSERVER_PROCEDURE}] @name = {first}, @token = {second}"


def _schema(schema: str) -> str:
    return validate_identifier("schema", schema)


def _dialect(dialect: str) -> str:
    if dialect not in DIALECTS:
        raise ValueError(f"fence dialect {dialect!r} is not one of {', '.join(DIALECTS)}")
    return dialect
