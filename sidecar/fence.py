"""The fencing guard: SQL the *application* runs inside its own transaction, so that the
database itself refuses the writes of a leader that was paused past its claim.

One table and one routine, in a schema of the sidecar's (``LEASE_SCHEMA``, default
``lease``), with names of their own so they can live in the application's database:

- PostgreSQL: ``lease.lease_fence(name text, token bigint)`` over the table
  ``lease.lease_fence``;
- SQL Server: ``[lease].[lease_fence] @name, @token`` over ``[lease].[LeaseFence]``.

``lease_fence(name, token)`` locks the name until the transaction ends. A token lower
than the highest one recorded is refused with :data:`STALE_SQLSTATE` (SQL Server: error
:data:`SQLSERVER_STALE_ERROR`), and the error aborts the transaction; an equal one passes
under a lock all of that token's transactions share, so one leader's transactions do not
queue behind each other; a higher one first waits until every transaction under the
token on record has ended, then records itself. Every old-leader transaction after it
fails: a transaction's other writes commit only if no newer leader wrote first. Every
backend's tokens stay below 2^53 and fit ``bigint``.

On PostgreSQL the lock is a transaction-scoped advisory lock on (name, token), shared by
the token's transactions and taken exclusively by the next leader, not a row lock: a
shared row lock writes the row (and, with several holders, a multixact) in every
transaction, which cost a third of a single-row insert's throughput
(bench/bench_fence.py). An equal token, the common case, costs the shared lock and one
read of the row, taken in that order so that no newer leader's commit falls between
them. Under REPEATABLE READ and SERIALIZABLE the row is share-locked too, so a newer
leader's commit fails the transaction (40001) instead of staying unseen by its snapshot.
On SQL Server it is ``UPDLOCK, HOLDLOCK`` on the row: one leader's transactions queue
there.

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
# PostgreSQL: the guard's transaction-scoped advisory locks are (hashtext(name) XOR
# LOCK_CLASS, token's low 31 bits), the two-key form, which shares no key with one-key
# advisory locks (the postgres backend's lease locks are those). The value is "fnce" in
# ASCII.
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
    waited_out bigint;
    locked text;
BEGIN
    IF lease_name IS NULL OR lease_name = '' OR fencing_token IS NULL
       OR fencing_token < 0 THEN
        RAISE EXCEPTION USING ERRCODE = '{BAD_CALL_SQLSTATE}', MESSAGE = format(
            'lease_fence: needs a lease name and a fencing token >= 0, got %L and %s',
            lease_name, coalesce(fencing_token::text, 'NULL'));
    END IF;
    -- First the lock every transaction under this token shares (an assignment, not
    -- PERFORM: a plain expression costs no query), then the read: a newer leader locks
    -- this token's key exclusively before it records its own, so either it waits for
    -- this transaction, or its commit is visible to the read below. The common case,
    -- an equal token, ends at the first test after the read: each statement counts in
    -- a transaction that does one insert.
    locked := pg_advisory_xact_lock_shared({_name_key()}, {_token_key("fencing_token")})::text;
    -- READ COMMITTED reads with a fresh snapshot; a transaction with one snapshot for
    -- all its statements share-locks the row, so a newer commit fails it (40001)
    -- instead of staying unseen.
    IF current_setting('transaction_isolation') = 'read committed' THEN
        SELECT token INTO highest FROM {table} WHERE name = lease_name;
    ELSE
        SELECT token INTO highest FROM {table} WHERE name = lease_name FOR SHARE;
    END IF;
    IF highest = fencing_token THEN
        RETURN highest;
    ELSIF highest IS NULL OR highest < fencing_token THEN
        -- A newer leader (or the first): wait until every transaction under the token
        -- on record has ended (none starts meanwhile: they queue behind this lock),
        -- then record this one under the row's lock. The token on record may change
        -- while this waits (a third leader): wait that one out too.
        LOOP
            IF highest IS NULL THEN
                INSERT INTO {table} (name, token) VALUES (lease_name, fencing_token)
                ON CONFLICT (name) DO NOTHING;
            ELSE
                locked := pg_advisory_xact_lock({_name_key()}, {_token_key("highest")})::text;
                waited_out := highest;
            END IF;
            SELECT token INTO highest FROM {table} WHERE name = lease_name FOR UPDATE;
            EXIT WHEN highest >= fencing_token OR highest = waited_out;
        END LOOP;
        IF highest < fencing_token THEN
            UPDATE {table} SET token = fencing_token, advanced_at = now()
            WHERE name = lease_name;
            highest := fencing_token;
        END IF;
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


def _name_key() -> str:
    """The guard's first lock key, in SQL: the name's hash, XOR the guard's mark."""
    return f"hashtext(lease_name) # {LOCK_CLASS}"


def _token_key(token: str) -> str:
    """The guard's lock key for a token, in SQL: its low 31 bits. Two tokens of one name
    share a key only when 2^31 apart, which a lease's successive holders do not come near
    (tokens grow by the writes between them); were they to, a new leader's concurrent
    first transactions could deadlock, and PostgreSQL would fail all but one (40P01):
    a retry, never a stale write."""
    return f"({token} % 2147483648)::integer"


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
