"""The pyodbc driver path, for real: unixODBC + psqlODBC against the PostgreSQL test bed.

No SQL Server can run here, so the driver layer the ``sqlserver`` backend uses (threads,
login and query timeouts, a connection per call with ODBC pooling, error mapping, replica
confirmation) runs against PostgreSQL through PostgreSQL's ODBC driver, with the
PostgreSQL dialect. Needs the Debian packages ``unixodbc`` and ``odbc-postgresql``.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pyodbc
import pytest

from sidecar.base.clock import SystemClock
from sidecar.base.errors import BackendError, NotFound
from sidecar.config import load
from sidecar.lease import sqlserver
from sidecar.lease.rowlease import ReplicaCheck, RowLease
from sidecar.lease.sql.dialect import PostgresDialect, Statement
from sidecar.lease.sql.pyodbc_driver import PyodbcDriver
from sidecar.lease.sql.store import SqlRowStore
from testkit.support import REPO, free_port
from tests.integration.row_contract import LONG, RowStoreContract, fresh, store_factory

pytestmark = pytest.mark.postgres
PG_ODBC = "PostgreSQL Unicode"


@pytest.fixture(scope="module", autouse=True)
def psqlodbc_installed() -> None:
    if PG_ODBC not in pyodbc.drivers():
        pytest.fail(f"ODBC driver {PG_ODBC!r} missing: apt-get install unixodbc "
                    "odbc-postgresql", pytrace=False)


def odbc_dsn(url: str, **override: str) -> str:
    """postgresql://user:pw@host:port/db → a psqlODBC connection string."""
    parts = urlsplit(url)
    fields = {"DRIVER": f"{{{PG_ODBC}}}", "SERVER": parts.hostname, "PORT": str(parts.port),
              "DATABASE": parts.path.lstrip("/"), "UID": parts.username,
              "PWD": parts.password, **override}
    return ";".join(f"{key}={value}" for key, value in fields.items())


def driver(dsn: str, login: float = 5, query: float = 5, **kw) -> PyodbcDriver:
    return PyodbcDriver(dsn, odbc_driver=None, login_timeout=login, query_timeout=query,
                        label="odbc", **kw)


@pytest.fixture
async def make_store(pg_dsn: str):
    async with store_factory(lambda replica, dsn: SqlRowStore(
            PostgresDialect(), driver(dsn or odbc_dsn(pg_dsn)), replica=replica)) as make:
        yield make


class TestOdbcContract(RowStoreContract):
    """The shared row-lease contract over pyodbc + psqlODBC."""


async def test_calls_run_in_threads_and_never_block_the_loop(pg_dsn: str) -> None:
    odbc = driver(odbc_dsn(pg_dsn))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.ensure_future(ticker())
    try:
        rows = await odbc.fetch(Statement("SELECT 1 FROM pg_sleep(1)"), {})
    finally:
        task.cancel()
        await odbc.close()
    assert rows == [(1,)]
    assert ticks >= 40, f"the event loop ticked only {ticks} times during a 1 s query"


async def test_query_timeout_cancels_the_statement_on_the_server(pg, pg_dsn: str) -> None:
    odbc = driver(odbc_dsn(pg_dsn), query=1)
    started = time.monotonic()
    try:
        with pytest.raises(BackendError, match=r"query timed out after 1s"):
            await odbc.fetch(Statement("SELECT pg_sleep(30)"), {})
    finally:
        await odbc.close()
    assert time.monotonic() - started < 10
    # Cancelled on the server, not just abandoned by the client.
    running = pg.psql("SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)' "
                      "AND state = 'active'")
    assert running == "0"


async def test_login_timeout_against_a_server_that_never_answers(pg_dsn: str) -> None:
    with socket.socket() as silent:  # accepts TCP, never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        odbc = driver(odbc_dsn(pg_dsn, PORT=str(port)), login=2)
        started = time.monotonic()
        try:
            with pytest.raises(BackendError, match="network unreachable"):
                await odbc.fetch(Statement("SELECT 1"), {})
        finally:
            await odbc.close()
    assert time.monotonic() - started < 8


async def test_errors_map_to_one_clear_line_without_the_password(pg, pg_dsn: str) -> None:
    cases = {
        "login failed for user lease": odbc_dsn(pg_dsn, PWD="wrong-password-123"),
        "ODBC driver not installed: No Such Driver": odbc_dsn(pg_dsn,
                                                              DRIVER="{No Such Driver}"),
        "network unreachable": odbc_dsn(pg_dsn, PORT=str(free_port())),
    }
    for expected, dsn in cases.items():
        odbc = driver(dsn)
        try:
            with pytest.raises(BackendError) as caught:
                await odbc.fetch(Statement("SELECT 1"), {})
        finally:
            await odbc.close()
        message = str(caught.value)
        assert expected in message and "\n" not in message
        assert pg.password not in message and "wrong-password-123" not in message


async def test_a_missing_table_is_not_found(pg_dsn: str) -> None:
    """``status`` tells "no lease table" (exit 3) from an unreachable server (exit 1)."""
    store = SqlRowStore(PostgresDialect("nowhere"), driver(odbc_dsn(pg_dsn)))
    try:
        with pytest.raises(NotFound) as caught:
            await store.list_all()
    finally:
        await store.close()
    assert "schema --apply" in str(caught.value) and "\n" not in str(caught.value)


async def test_sqlserver_backend_names_the_missing_default_driver() -> None:
    """The real sqlserver backend module: no DRIVER= in the DSN → FreeTDS, not installed."""
    settings = load({"backend": "sqlserver", "dsn": "SERVER=127.0.0.1,1433;UID=sa;PWD=s3cret",
                     "identity": "a"}, env={})
    backend = sqlserver.ENTRY.create(settings, SystemClock())
    try:
        with pytest.raises(BackendError) as caught:
            await backend.lease("x").try_acquire()
    finally:
        await backend.close()
    assert "ODBC driver not installed: FreeTDS" in str(caught.value)
    assert "s3cret" not in str(caught.value)


POOL_PROBE = """
import asyncio, json, sys
from sidecar.lease.sql.dialect import Statement
from sidecar.lease.sql.pyodbc_driver import PyodbcDriver

async def main():
    odbc = PyodbcDriver(sys.argv[1], odbc_driver=None, login_timeout=5, query_timeout=5)
    pids = [(await odbc.fetch(Statement("SELECT pg_backend_pid()"), {}))[0][0]
            for _ in range(5)]
    await odbc.close()
    print(json.dumps(pids))

asyncio.run(main())
"""


def probe_pids(dsn: str, env: dict[str, str]) -> list[int]:
    result = subprocess.run([sys.executable, "-c", POOL_PROBE, dsn], capture_output=True,
                            text=True, timeout=60, env={**os.environ, **env}, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def pooling_odbcinst(directory: Path) -> Path:
    """The system's odbcinst.ini plus driver-manager pooling, as a deployment would set it."""
    system = subprocess.run(["odbcinst", "-j"], capture_output=True, text=True, check=True)
    path = next(line.split(":", 1)[1].strip() for line in system.stdout.splitlines()
                if line.startswith("DRIVERS"))
    ini = configparser.ConfigParser()
    ini.optionxform = str  # keep key case
    ini.read(path)
    ini["ODBC"] = {"Pooling": "Yes"}
    ini[PG_ODBC]["CPTimeout"] = "60"
    with open(directory / "odbcinst.ini", "w") as fh:
        ini.write(fh)
    return directory


def test_a_connection_per_call_reused_by_odbc_pooling(pg_dsn: str, tmp_path: Path) -> None:
    """Separate processes, because unixODBC reads its pooling setting once per process."""
    dsn = odbc_dsn(pg_dsn)
    unpooled = probe_pids(dsn, {})
    assert len(set(unpooled)) == 5, "each call should open (and close) its own connection"
    pooled = probe_pids(dsn, {"ODBCSYSINI": str(pooling_odbcinst(tmp_path))})
    assert len(set(pooled)) == 1, "with Pooling=Yes the calls should share one connection"


async def test_replica_confirmation_over_odbc_against_a_real_standby(
        pg_standby, pg_dsn: str, pg_standby_dsn: str, make_store) -> None:
    primary = make_store()
    pg_standby.wait_replayed()
    replica = make_store(replica=True, dsn=odbc_dsn(pg_standby_dsn))
    name = fresh()
    lease = RowLease(primary, "n", name, "a", duration=LONG, safety_margin=1.0,
                     replica=ReplicaCheck(replica, timeout=1.0))
    pg_standby.pause_replay()
    try:
        grant = await lease.try_acquire()
        assert not grant.held and "replica" in grant.reason
        assert await primary.read(name) is None
    finally:
        pg_standby.resume_replay()
    grant = await lease.try_acquire()
    assert grant.held
    row = await replica.read(name)
    assert row is not None and row.owner == "a" and row.version == grant.fencing_token
