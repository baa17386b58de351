"""sidecar.client for real: a real ``lease-sidecar run`` (SQLite, short leases) says who
leads, the real PostgreSQL holds the guard, and the helpers for psycopg, asyncpg and pyodbc
(through unixODBC + psqlODBC: no SQL Server runs here, so the ODBC path runs the PostgreSQL
guard) write only while the claim holds and get :class:`StaleToken` once a newer term has
written. ``lease-sidecar exec`` hands its command the token and a file that keeps the
claim fresh for a long job.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import psycopg
import pyodbc
import pytest

from sidecar.client import (
    ClaimExpired,
    Leadership,
    NotLeader,
    StaleToken,
    asyncpg_transaction,
    fence_asyncpg,
    fence_psycopg,
    fence_pyodbc,
    psycopg_transaction,
    pyodbc_transaction,
)
from testkit.support import SidecarProcess, wait_until
from tests.testbed.pgbouncer_fixtures import StartBouncer

pytestmark = pytest.mark.postgres
FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "500ms", "--claim-horizon", "150ms"]
PG_ODBC = "PostgreSQL Unicode"


@pytest.fixture
def app_dsn(pg_dsn: str) -> str:
    result = subprocess.run([sys.executable, "-m", "sidecar", "fence-schema", "--apply",
                             "--dsn", pg_dsn], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE writes (id bigserial PRIMARY KEY, token bigint)")
    return pg_dsn


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path, "app-1", args=[
        "--dsn", str(tmp_path / "leases.db"), "--name", "jobs", *FAST]).start()
    try:
        proc.wait_http()
        wait_until(lambda: proc.leader() == 200, 15)
        yield proc
    finally:
        proc.stop()


def tokens(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [t for (t,) in conn.execute("SELECT token FROM writes ORDER BY id")]


def next_term(sidecar: SidecarProcess, leadership: Leadership, old: int) -> int:
    """POST /release; the sidecar sits out, then leads again with a higher token."""
    assert sidecar.release() == 202
    wait_until(lambda: not leadership.claim().leader, 10)
    with pytest.raises(NotLeader):
        leadership.claim().check()
    claim = leadership.wait(20)
    assert claim.holds() and claim.fencing_token is not None
    assert claim.fencing_token > old
    return claim.fencing_token


@pytest.mark.parametrize("source", ["url", "file"])
def test_psycopg_writes_only_under_a_claim_and_a_stale_token_is_refused(
        source: str, sidecar: SidecarProcess, app_dsn: str) -> None:
    leadership = (Leadership("jobs", url=f"{sidecar.url}/leader/jobs") if source == "url"
                  else Leadership("jobs", file=sidecar.state_dir / "jobs"))
    with psycopg.connect(app_dsn) as conn:
        with psycopg_transaction(conn, leadership) as claim:
            conn.execute("INSERT INTO writes (token) VALUES (%s)", (claim.fencing_token,))
        first = claim.fencing_token
        assert first is not None
        second = next_term(sidecar, leadership, first)
        with psycopg_transaction(conn, leadership) as claim:
            conn.execute("INSERT INTO writes (token) VALUES (%s)", (claim.fencing_token,))
        # A paused holder of the first term, past its check: the database refuses it.
        with pytest.raises(StaleToken) as caught, conn.transaction():
            fence_psycopg(conn, first, "jobs")
            conn.execute("INSERT INTO writes (token) VALUES (%s)", (first,))
        assert (caught.value.token, caught.value.highest) == (first, second)
        # The guard belongs inside a transaction.
        conn.autocommit = True
        with pytest.raises(ValueError, match="inside the transaction"):
            fence_psycopg(conn, second, "jobs")
    assert tokens(app_dsn) == [first, second]


def test_a_late_claim_is_refused_before_any_write(tmp_path: Path, app_dsn: str) -> None:
    path = tmp_path / "jobs"  # the file a frozen sidecar left behind
    path.write_text(json.dumps({"leader": True, "lease": "jobs", "fencing_token": 3,
                                "valid_until_ms": time.time_ns() // 1_000_000 - 1}))
    with psycopg.connect(app_dsn) as conn, pytest.raises(ClaimExpired), \
            psycopg_transaction(conn, Leadership("jobs", file=path)):
        pytest.fail("the unit ran on an expired claim")
    assert tokens(app_dsn) == []


async def test_asyncpg_directly_and_through_transaction_pooling(
        sidecar: SidecarProcess, app_dsn: str, pgbouncer: StartBouncer) -> None:
    bouncer = pgbouncer(pool_mode="transaction", pool_size=1)
    leadership = Leadership("jobs", url=f"{sidecar.url}/leader/jobs")
    pooled = bouncer.dsn_for(urlsplit(app_dsn).path.lstrip("/"))
    # No prepared statements behind the pooler (PgBouncer 1.18 cannot carry them).
    conns = [await asyncpg.connect(app_dsn),
             await asyncpg.connect(pooled, statement_cache_size=0)]
    try:
        first = None
        for conn in conns:
            async with asyncpg_transaction(conn, leadership) as claim:
                await conn.execute("INSERT INTO writes (token) VALUES ($1)",
                                   claim.fencing_token)
            first = claim.fencing_token
        assert first is not None
        second = next_term(sidecar, leadership, first)
        for conn in conns:
            async with asyncpg_transaction(conn, leadership) as claim:
                await conn.execute("INSERT INTO writes (token) VALUES ($1)",
                                   claim.fencing_token)
            with pytest.raises(StaleToken):
                async with conn.transaction():
                    await fence_asyncpg(conn, first, "jobs")
            with pytest.raises(ValueError, match="inside the transaction"):
                await fence_asyncpg(conn, second, "jobs")
    finally:
        for conn in conns:
            await conn.close()
    assert tokens(app_dsn) == [first, first, second, second]


def odbc(url: str) -> str:
    parts = urlsplit(url)
    return (f"DRIVER={{{PG_ODBC}}};SERVER={parts.hostname};PORT={parts.port};"
            f"DATABASE={parts.path.lstrip('/')};UID={parts.username};PWD={parts.password}")


def test_pyodbc_through_psqlodbc(sidecar: SidecarProcess, app_dsn: str) -> None:
    if PG_ODBC not in pyodbc.drivers():
        pytest.fail(f"ODBC driver {PG_ODBC!r} missing: apt-get install unixodbc "
                    "odbc-postgresql", pytrace=False)
    leadership = Leadership("jobs", file=sidecar.state_dir / "jobs")
    conn = pyodbc.connect(odbc(app_dsn), autocommit=False)
    try:
        with pyodbc_transaction(conn, leadership, dialect="postgres") as (cursor, claim):
            first = claim.fencing_token
            cursor.execute("INSERT INTO writes (token) VALUES (?)", first)
        with pytest.raises(RuntimeError), \
                pyodbc_transaction(conn, leadership, dialect="postgres") as (cursor, _):
            cursor.execute("INSERT INTO writes (token) VALUES (?)", -1)
            raise RuntimeError("the block failed: its write is rolled back")
        assert first is not None
        second = next_term(sidecar, leadership, first)
        with pyodbc_transaction(conn, leadership, dialect="postgres") as (cursor, _):
            cursor.execute("INSERT INTO writes (token) VALUES (?)", second)
        cursor = conn.cursor()
        with pytest.raises(StaleToken) as caught:
            fence_pyodbc(cursor, first, "jobs", dialect="postgres")
        assert caught.value.highest == second
        conn.rollback()
        conn.autocommit = True
        with pytest.raises(ValueError, match="autocommit"):
            fence_pyodbc(conn.cursor(), second, "jobs", dialect="postgres")
    finally:
        conn.close()
    assert tokens(app_dsn) == [first, second]


CHILD = """
import json, os, sys, time
import psycopg
from sidecar.client import Leadership, psycopg_transaction
leadership = Leadership.from_env()
seen = []
with psycopg.connect(sys.argv[1]) as conn:
    deadline = time.monotonic() + 1.5  # ten claim horizons: longer than any one claim
    while time.monotonic() < deadline:
        with psycopg_transaction(conn, leadership) as claim:
            conn.execute("INSERT INTO writes (token) VALUES (%s)", (claim.fencing_token,))
        seen.append([claim.fencing_token, claim.valid_until_ms])
        time.sleep(0.05)
json.dump({"env": {k: v for k, v in os.environ.items() if k.startswith("LEASE_")},
           "seen": seen}, open(sys.argv[2], "w"))
"""


def test_exec_gives_its_command_the_token_and_a_fresh_claim_for_a_long_job(
        tmp_path: Path, app_dsn: str) -> None:
    child, out = tmp_path / "child.py", tmp_path / "out.json"
    child.write_text(CHILD)
    runner = SidecarProcess(tmp_path, "exec-1", command="exec", args=[
        "--dsn", str(tmp_path / "leases.db"), "--name", "jobs", *FAST, "--",
        sys.executable, str(child), app_dsn, str(out)]).start()
    try:
        assert runner.proc is not None and runner.proc.wait(60) == 0, runner.logs()
    finally:
        runner.stop()
    report = json.loads(out.read_text())
    env, seen = report["env"], report["seen"]
    token = int(env["LEASE_FENCING_TOKEN"])
    assert {t for t, _ in seen} == {token}
    # The snapshot in the environment ran out long before the job ended; every unit ran
    # on a claim read afresh from the file, each one later than the snapshot.
    until = [u for _, u in seen]
    assert until == sorted(until) and until[-1] - int(env["LEASE_VALID_UNTIL_MS"]) > 1000
    assert tokens(app_dsn) == [token] * len(seen)
