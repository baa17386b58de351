"""The T-SQL of the sqlserver backend, checked with a real T-SQL parser (sqlglot).

No SQL Server runs here (the live suite is tests/integration/test_sqlserver_live.py), so
these tests pin what can be checked without one: every statement parses as T-SQL exactly
as the pyodbc driver sends it (``?`` parameters), and the parts the design depends on —
lock hints, OUTPUT columns, server-time functions, owner filters, the table definition —
are present in the parsed tree, not just somewhere in the text.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone

import pytest
import sqlglot
from sqlglot import exp

from sidecar.lease.sql.dialect import PostgresDialect, Statement, TsqlDialect, rowversion_to_int
from sidecar.lease.sql.pyodbc_driver import _datetimeoffset, odbc_connection_string

DIALECT = TsqlDialect()
STATEMENTS = {
    "acquire": DIALECT.acquire, "renew": DIALECT.renew, "release": DIALECT.release,
    "read": DIALECT.read, "read_replica": DIALECT.read_replica, "list_all": DIALECT.list_all,
}
OUTPUT = ["inserted.OwnerInstanceId", "inserted.ExpiresAtUtc", "inserted.RowVersion"]


def parse(statement: Statement) -> list[exp.Expression]:
    text, _ = statement.qmark()  # exactly what the pyodbc driver sends
    return [e for e in sqlglot.parse(text, read="tsql") if e is not None]


def one(tree: list[exp.Expression], kind: type[exp.Expression]) -> exp.Expression:
    found = [node for root in tree for node in root.find_all(kind)]
    assert len(found) == 1, f"expected one {kind.__name__}, found {len(found)}"
    return found[0]


def conditions(node: exp.Expression | None) -> set[str]:
    """The ANDed predicates of a WHERE, as T-SQL text."""
    assert isinstance(node, exp.Where)
    predicate = node.this
    parts = predicate.flatten() if isinstance(predicate, exp.And) else [predicate]
    return {part.sql("tsql") for part in parts}


@pytest.mark.parametrize("name", [*STATEMENTS, "schema"])
def test_every_statement_parses_as_tsql_without_fallbacks(name: str) -> None:
    text = DIALECT.schema_script() if name == "schema" else STATEMENTS[name].qmark()[0]
    tree = sqlglot.parse(text, read="tsql")
    assert tree and all(e is not None for e in tree)
    # exp.Command is sqlglot's "did not understand, kept as text" node.
    assert not [n for e in tree for n in e.find_all(exp.Command)]


def test_acquire_is_one_batch_of_sweep_then_locked_merge_with_output() -> None:
    tree = parse(DIALECT.acquire)
    kinds = [type(e) for e in tree]
    assert kinds.index(exp.Delete) < kinds.index(exp.Merge)
    sweep = one(tree, exp.Delete)
    assert conditions(sweep.args["where"]) == {"ExpiresAtUtc <= SYSDATETIMEOFFSET()"}
    # Skips rows others hold rather than waiting on them while holding rows of its own.
    assert [v.name for h in sweep.this.args["hints"] for v in h.expressions] == ["READPAST"]

    merge = one(tree, exp.Merge)
    hints = merge.this.args["hints"]
    assert [v.name for h in hints for v in h.expressions] == ["UPDLOCK", "HOLDLOCK", "ROWLOCK"]
    assert [c.sql("tsql") for c in merge.args["returning"].expressions] == OUTPUT

    whens = merge.args["whens"].expressions
    matched = [w for w in whens if w.args.get("matched")]
    inserted = [w for w in whens if not w.args.get("matched")]
    assert len(matched) == 1 and len(inserted) == 1
    # Matched: takeover of an expired row only — a live row is never refreshed, not even
    # one naming us (a second process with our identity); else: lose.
    assert matched[0].args["condition"].sql("tsql") == (
        "target.ExpiresAtUtc <= SYSDATETIMEOFFSET()")
    assert isinstance(matched[0].args["then"], exp.Update)
    assert isinstance(inserted[0].args["then"], exp.Insert)


def test_renew_and_release_filter_on_owner_and_renew_on_live_rows() -> None:
    renew = one(parse(DIALECT.renew), exp.Update)
    assert conditions(renew.args["where"]) == {
        "LeaseName = ?", "OwnerInstanceId = ?", "ExpiresAtUtc > SYSDATETIMEOFFSET()"}
    assert [c.sql("tsql") for c in renew.args["returning"].expressions] == OUTPUT
    # Release ends exactly our term's row as we last wrote it: a release whose worker
    # thread outlived the elector's wait must not delete the next term's row.
    release = one(parse(DIALECT.release), exp.Delete)
    assert conditions(release.args["where"]) == {
        "LeaseName = ?", "OwnerInstanceId = ?",
        "RowVersion = CAST(CAST(? AS BIGINT) AS BINARY(8))"}


def test_replica_read_is_a_dirty_read_without_a_clock() -> None:
    select = one(parse(DIALECT.read_replica), exp.Select)
    table = select.find(exp.Table)
    assert [v.name for h in table.args["hints"] for v in h.expressions] == ["READUNCOMMITTED"]
    # The replica's clock is not the primary's: only the version decides.
    assert select.find(exp.CurrentTimestampLTZ) is None
    assert [c.sql("tsql") for c in select.expressions] == [
        "OwnerInstanceId", "ExpiresAtUtc", "RowVersion"]


@pytest.mark.parametrize("name", list(STATEMENTS))
def test_all_time_comes_from_the_server(name: str) -> None:
    tree = parse(STATEMENTS[name])
    text = STATEMENTS[name].text.upper()
    for client_or_other_clock in ("GETDATE", "GETUTCDATE", "SYSUTCDATETIME", "SYSDATETIME()",
                                  "CURRENT_TIMESTAMP"):
        assert client_or_other_clock not in text
    # The only time-like parameter is a duration, never a client timestamp.
    assert set(STATEMENTS[name].names) <= {"name", "owner", "duration_ms", "version"}
    if name in ("acquire", "renew", "read"):
        assert any(n for e in tree for n in e.find_all(exp.CurrentTimestampLTZ))


def test_table_is_exactly_the_design() -> None:
    tree = sqlglot.parse(DIALECT.schema_script(), read="tsql")
    creates = [n for e in tree for n in e.find_all(exp.Create)]
    table = next(c for c in creates if c.args["kind"] == "TABLE")
    columns = {
        col.name: (col.args["kind"].sql("tsql"),
                   [c.sql("tsql") for c in col.args.get("constraints") or []])
        for col in table.find_all(exp.ColumnDef)
    }
    assert columns == {
        "LeaseName": ("NVARCHAR(200)", ["NOT NULL", "CONSTRAINT [PK_Leases] PRIMARY KEY"]),
        "OwnerInstanceId": ("NVARCHAR(128)", ["NOT NULL"]),
        "AcquiredAtUtc": ("DATETIMEOFFSET(7)", ["NOT NULL"]),
        "RenewedAtUtc": ("DATETIMEOFFSET(7)", ["NOT NULL"]),
        "ExpiresAtUtc": ("DATETIMEOFFSET(7)", ["NOT NULL"]),
        "Metadata": ("NVARCHAR(1024)", ["NULL"]),
        "RowVersion": ("ROWVERSION", ["NOT NULL"]),
    }
    assert table.this.this.sql("tsql") == "[lease].[Leases]"
    index = next(c for c in creates if c.args["kind"] == "INDEX")
    assert index.this.sql("tsql") == "[IX_Leases_ExpiresAtUtc] ON [lease].[Leases](ExpiresAtUtc)"
    # Idempotent: every CREATE sits under an IF guard.
    assert all(c.find_ancestor(exp.IfBlock) is not None for c in creates)
    guards = [i.this.sql("tsql") for e in tree for i in e.find_all(exp.IfBlock)]
    assert any("SCHEMA_ID(N'lease') IS NULL" in g for g in guards)
    assert any("OBJECT_ID(N'[lease].[Leases]', N'U') IS NULL" in g for g in guards)


def test_schema_and_table_names_are_configurable_and_validated() -> None:
    custom = TsqlDialect("ops", "JobLeases")
    assert "[ops].[JobLeases]" in custom.acquire.text
    assert "[IX_JobLeases_ExpiresAtUtc]" in custom.schema_script()
    for bad in ("lease]; DROP TABLE x; --", "1abc", "a b", ""):
        with pytest.raises(ValueError, match="not a plain identifier"):
            TsqlDialect(bad, "Leases")
        with pytest.raises(ValueError, match="not a plain identifier"):
            TsqlDialect("lease", bad)
        with pytest.raises(ValueError, match="not a plain identifier"):
            PostgresDialect(bad, "leases")


def test_rowversion_is_big_endian_and_keeps_order() -> None:
    assert rowversion_to_int(b"\x00\x00\x00\x00\x00\x00\x07\xd1") == 2001
    versions = [b"\x00\x00\x00\x00\x00\x00\x00\xff", b"\x00\x00\x00\x00\x00\x00\x01\x00",
                b"\x00\x00\x00\x01\x00\x00\x00\x00"]
    assert [rowversion_to_int(v) for v in versions] == sorted(rowversion_to_int(v)
                                                              for v in versions)
    assert rowversion_to_int(bytearray(b"\x00" * 7 + b"\x02")) == 2


def test_datetimeoffset_values_decode_with_their_offset() -> None:
    raw = struct.pack("<6hI2h", 2030, 1, 2, 3, 4, 5, 123456000, 2, 30)
    value = _datetimeoffset(raw)
    assert value == datetime(2030, 1, 2, 3, 4, 5, 123456,
                             tzinfo=timezone(timedelta(hours=2, minutes=30)))
    assert value.astimezone(UTC).hour == 0


def test_placeholders_compile_per_driver_and_leave_casts_alone() -> None:
    statement = Statement("SELECT :name, x::float8, :owner, :name")
    assert statement.qmark() == ("SELECT ?, x::float8, ?, ?", ("name", "owner", "name"))
    assert statement.numeric() == ("SELECT $1, x::float8, $2, $1", ("name", "owner"))


def test_odbc_driver_comes_from_the_setting_unless_the_dsn_names_one() -> None:
    dsn = "SERVER=db,1433;DATABASE=app;UID=u;PWD=p"
    assert odbc_connection_string(dsn, None) == "DRIVER={FreeTDS};" + dsn
    assert odbc_connection_string(dsn, "ODBC Driver 18 for SQL Server").startswith(
        "DRIVER={ODBC Driver 18 for SQL Server};")
    named = "Driver={ODBC Driver 17 for SQL Server};" + dsn
    assert odbc_connection_string(named, "FreeTDS") == named
    assert odbc_connection_string("DSN=prod;UID=u", None) == "DSN=prod;UID=u"


def test_postgres_statements_parse_as_postgres() -> None:
    dialect = PostgresDialect()
    for statement in (dialect.acquire, dialect.renew, dialect.release, dialect.read,
                      dialect.read_replica, dialect.list_all):
        tree = sqlglot.parse(statement.numeric()[0], read="postgres")
        assert tree and not [n for e in tree for n in e.find_all(exp.Command)]


def test_cli_prints_the_tsql_script_without_connecting() -> None:
    """A real ``lease-sidecar schema --print`` process; the DSN points nowhere."""
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "schema", "--backend", "sqlserver",
         "--dsn", "SERVER=192.0.2.1;UID=u;PWD=secret", "--table", "JobLeases", "--print"],
        capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == TsqlDialect("lease", "JobLeases").schema_script()
    assert "secret" not in result.stdout + result.stderr


@pytest.mark.parametrize(("backend", "own", "other"), [
    ("sqlserver", "pyodbc", "asyncpg"), ("postgres-row", "asyncpg", "pyodbc")])
def test_each_sql_backend_imports_its_own_driver_only(backend: str, own: str,
                                                      other: str) -> None:
    """The two share one entry builder; loading one must not load the other's library.
    The entry alone loads neither (``schema --print`` needs no driver); ``load_driver``,
    which config loading calls for every command that connects, loads its own."""
    def loaded(call: str) -> set[str]:
        probe = ("import json, sys; from sidecar.lease import backend_entry, load_driver; "
                 f"{call}({backend!r}); print(json.dumps(sorted(sys.modules)))")
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True,
                                text=True, timeout=30, check=True)
        return {name.split(".")[0] for name in json.loads(result.stdout)}

    assert not {own, other} & loaded("backend_entry")
    with_driver = loaded("load_driver")
    assert own in with_driver and other not in with_driver
