"""The fencing guard's text (sidecar/fence.py) and ``lease-sidecar fence-schema``'s choices.

The PostgreSQL guard runs for real in tests/integration/test_fence.py. No SQL Server runs
here (its live suite is tests/integration/test_fence_sqlserver_live.py, skipped without
one), so its T-SQL is checked as the lease's is (tests/unit/test_tsql.py): with a real
T-SQL parser, sqlglot, on the text exactly as it is sent. sqlglot has no ``THROW``, so
each ``THROW`` is found and checked on its own, then replaced by a ``PRINT`` (parsed as a
plain command) for the parse of the rest; nothing else is left unparsed.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import sqlglot
from sqlglot import exp

from sidecar import fence
from sidecar.base.errors import ConfigError
from sidecar.cli.fence_schema import dialect_for

THROW = re.compile(r"THROW (\d+),\s*(N'(?:[^']|'')*'|@\w+), 1;")


def parse_tsql(text: str, throws: bool = True) -> list[exp.Expression]:
    """Parse with every THROW (checked by the caller) swapped for a PRINT."""
    swapped = THROW.sub("PRINT 'throw';", text) if throws else text
    assert not throws or "THROW" not in swapped, "a THROW the pattern does not know"
    tree = [e for e in sqlglot.parse(swapped, read="tsql") if e is not None]
    unparsed = [n.sql("tsql") for e in tree for n in e.find_all(exp.Command)
                if n.sql("tsql") != "PRINT 'throw'"]
    assert not unparsed, unparsed
    return tree


def body_text(schema: str) -> str:
    return fence.sqlserver_procedure(schema).replace("'", "''")


def nodes(tree: list[exp.Expression], kind: type[exp.Expression]) -> list[exp.Expression]:
    return [n for root in tree for n in root.find_all(kind)]


def hints(node: exp.Expression) -> list[str]:
    table = node.find(exp.Table)
    assert table is not None
    return [v.name for h in table.args.get("hints") or [] for v in h.expressions]


# -- SQL Server ---------------------------------------------------------------------------
def test_procedure_locks_the_row_to_the_end_of_the_transaction() -> None:
    tree = parse_tsql(fence.sqlserver_procedure())
    [create] = nodes(tree, exp.Create)
    assert create.args["kind"] == "PROCEDURE"
    assert create.this.this.sql("tsql") == "[lease].[lease_fence]"
    [select] = nodes(tree, exp.Select)
    assert hints(select) == ["UPDLOCK", "HOLDLOCK"]
    assert select.args["where"].this.sql("tsql") == "Name = @name"
    [insert] = nodes(tree, exp.Insert)
    [update] = nodes(tree, exp.Update)
    assert update.args["where"].this.sql("tsql") == "Name = @name"
    # The token only moves up: the update is reached only for a higher token.
    conditions = [i.this.sql("tsql") for i in nodes(tree, exp.IfBlock)]
    assert conditions == ["@@TRANCOUNT = 0",
                          "@name IS NULL OR @name = N'' OR @token IS NULL OR @token < 0",
                          "@highest IS NULL", "@token > @highest", "@token < @highest"]
    ifs = nodes(tree, exp.IfBlock)
    assert ifs[2].find(exp.Insert) is insert and ifs[3].find(exp.Update) is update
    # An error ends the caller's whole transaction (XACT_ABORT), not one statement.
    sets = [s.sql("tsql", comments=False) for s in nodes(tree, exp.Set)]
    assert "SET XACT_ABORT ON" in sets
    assert insert.find(exp.CurrentTimestampLTZ) is not None


def test_procedure_throws_the_documented_numbers() -> None:
    text = fence.sqlserver_procedure()
    throws = THROW.findall(text)
    assert [int(number) for number, _ in throws] == [
        fence.SQLSERVER_BAD_CALL_ERROR, fence.SQLSERVER_BAD_CALL_ERROR,
        fence.SQLSERVER_STALE_ERROR]
    assert all(50000 <= int(number) <= 2147483647 for number, _ in throws)
    # The stale one is thrown only under IF @token < @highest, with the message clients
    # recognise (sidecar.client parses it).
    stale = text[text.index("IF @token < @highest"):]
    assert f"THROW {fence.SQLSERVER_STALE_ERROR}, @message, 1;" in stale
    assert f"N'{fence.STALE_MESSAGE} '" in stale


def test_script_is_idempotent_and_creates_the_procedure_through_sp_executesql() -> None:
    script = fence.sqlserver_script("ops")
    tree = parse_tsql(script, throws=False)  # the procedure's THROWs are in a literal
    creates = nodes(tree, exp.Create)
    table = next(c for c in creates if c.args["kind"] == "TABLE")
    assert table.this.this.sql("tsql") == "[ops].[LeaseFence]"
    columns = {col.name: col.args["kind"].sql("tsql") for col in table.find_all(exp.ColumnDef)}
    assert columns == {"Name": "NVARCHAR(200)", "Token": "BIGINT",
                       "AdvancedAtUtc": "DATETIMEOFFSET(7)"}
    assert all(c.find_ancestor(exp.IfBlock) is not None for c in creates)
    guards = [i.this.sql("tsql") for i in nodes(tree, exp.IfBlock)]
    assert "SCHEMA_ID(N'ops') IS NULL" in guards
    assert "OBJECT_ID(N'[ops].[LeaseFence]', N'U') IS NULL" in guards
    # The procedure comes last, the exact text with its quotes doubled; CREATE OR ALTER
    # replaces it on the next apply.
    last = nodes(tree, exp.Execute)[-1]
    assert last.this.sql("tsql") == "sp_executesql"
    assert script.endswith("EXEC sp_executesql N'" + body_text("ops") + "';")
    [body] = last.expressions
    assert isinstance(body, exp.National)  # N'…', with its quotes undoubled
    assert body.this == fence.sqlserver_procedure("ops")
    assert body.this.startswith("CREATE OR ALTER PROCEDURE [ops].[lease_fence]")


def test_the_call_the_clients_send_parses_as_tsql() -> None:
    text = fence.call("sqlserver", "lease", "?")
    [execute] = [e for e in sqlglot.parse(text, read="tsql") if e is not None]
    assert isinstance(execute, exp.Execute)
    assert execute.this.sql("tsql") == "[lease].[lease_fence]"
    assert [p.sql("tsql") for p in execute.expressions] == ["@name = ?", "@token = ?"]


# -- PostgreSQL -----------------------------------------------------------------------------
def test_postgres_call_casts_its_parameters() -> None:
    assert fence.call("postgres", "app", "$") == (
        'SELECT "app".lease_fence(CAST($1 AS text), CAST($2 AS bigint))')
    tree = sqlglot.parse_one(fence.call("postgres", "app", "%s").replace("%s", "NULL"),
                             read="postgres")
    assert [c.to.sql() for c in tree.find_all(exp.Cast)] == ["TEXT", "BIGINT"]


def test_postgres_script_names_only_its_own_objects() -> None:
    script = fence.postgres_script("app")
    created = re.findall(r"CREATE (?:OR REPLACE )?(?:SCHEMA|TABLE|FUNCTION)(?: IF NOT EXISTS)? "
                         r"(\S+?)(?:\(| |;)", script)
    assert created == ['"app"', '"app".lease_fence', '"app".lease_fence']
    assert f"ERRCODE = '{fence.STALE_SQLSTATE}'" in script
    # A token's transactions share its lock, the next leader takes the recorded token's
    # alone; the two-key form, apart from the postgres backend's one-key lease locks.
    name_key = f"hashtext(lease_name) # {fence.LOCK_CLASS}"
    shared = script.index(f"pg_advisory_xact_lock_shared({name_key}, "
                          "(fencing_token % 2147483648)::integer)")
    assert f"pg_advisory_xact_lock({name_key}, (highest % 2147483648)::integer)" in script
    # The shared lock comes before the read it protects.
    assert shared < script.index("SELECT token INTO highest")
    assert 0 < fence.LOCK_CLASS < 2**31
    provision = fence.postgres_provision("app")
    assert provision.startswith("SELECT pg_advisory_xact_lock(")
    assert provision.endswith(script)


@pytest.mark.parametrize("bad", ["x;drop", "1abc", "a b", ""])
def test_a_bad_schema_name_is_refused(bad: str) -> None:
    for build in (fence.postgres_script, fence.sqlserver_script):
        with pytest.raises(ValueError, match="not a plain identifier"):
            build(bad)


def test_the_stale_sqlstate_is_outside_the_standard_and_postgresql_classes() -> None:
    state = fence.STALE_SQLSTATE
    assert re.fullmatch(r"[0-9A-Z]{5}", state)
    # SQL:2011: classes starting with 5-9 or I-Z are the implementation's; PostgreSQL's
    # own such classes are 53 54 55 57 58 72 F0 HV P0 XX.
    assert state[0] in "56789IJKLMNOPQRSTUVWXYZ"
    assert state[:2] not in {"53", "54", "55", "57", "58", "72", "P0", "XX"}


# -- fence-schema's dialect ------------------------------------------------------------------
def test_dialect_comes_from_the_flag_then_the_dsn_then_the_backend() -> None:
    assert dialect_for("sqlserver", "postgresql://h/db", "postgres") == "sqlserver"
    assert dialect_for(None, "postgresql://h/db", "kubernetes") == "postgres"
    assert dialect_for(None, "DRIVER={X};SERVER=h", None) == "sqlserver"
    assert dialect_for(None, None, "postgres-row") == "postgres"
    assert dialect_for(None, None, "sqlserver") == "sqlserver"
    with pytest.raises(ConfigError, match="--dialect: say postgres or sqlserver"):
        dialect_for(None, None, "kubernetes")


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_fence_schema_print_connects_to_nothing() -> None:
    result = cli("fence-schema", "--print", "--dialect", "postgres", "--schema", "app")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == fence.postgres_script("app")
    result = cli("fence-schema", "--print", "--dialect", "sqlserver")
    assert result.stdout.strip() == fence.sqlserver_script()


def test_fence_schema_errors_are_one_line() -> None:
    env = {"PATH": "/usr/bin:/bin"}
    for args, message in (
            (("--print",), "--dialect: say postgres or sqlserver"),
            (("--apply", "--dialect", "postgres"), "--dsn / LEASE_DSN: name the application"),
            (("--apply", "--dsn", "mysql://h/db"), "LEASE_DSN / --dsn: "),
            (("--print", "--dialect", "postgres", "--schema", "a;b"), "not a plain identifier"),
    ):
        result = cli("fence-schema", *args, env=env)
        assert result.returncode == 2, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
