"""The ``sqlserver`` backend against a live SQL Server — only when one is given.

CI here has no SQL Server, so this suite is skipped unless ``LEASE_TEST_MSSQL_DSN`` is
set. It runs the same row-lease contract as the PostgreSQL suites (over pyodbc and the
T-SQL dialect), plus provisioning, error mapping, replica confirmation and process
handover. Point it at a scratch database: it creates ``[lease].[Leases]`` there.

    export LEASE_TEST_MSSQL_DSN='DRIVER={ODBC Driver 18 for SQL Server};\
    SERVER=127.0.0.1,1433;DATABASE=leasetest;UID=sa;PWD=...;TrustServerCertificate=yes'
    export LEASE_TEST_MSSQL_REPLICA_DSN='...ApplicationIntent=ReadOnly...'   # optional
    pytest tests/integration/test_sqlserver_live.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar.base.errors import BackendError
from sidecar.config import load
from sidecar.lease import sqlserver
from sidecar.lease.rowlease import ReplicaCheck, RowLease
from sidecar.lease.sql.dialect import Statement, TsqlDialect
from sidecar.lease.sql.pyodbc_driver import PyodbcDriver
from sidecar.lease.sql.store import SqlRowStore
from testkit.support import SidecarProcess, wait_until
from tests.integration.row_contract import LONG, RowStoreContract, fresh, store_factory

DSN = os.environ.get("LEASE_TEST_MSSQL_DSN", "")
# Without a real secondary the primary confirms itself: that still runs the
# READUNCOMMITTED read and the byte-equal RowVersion comparison.
REPLICA_DSN = os.environ.get("LEASE_TEST_MSSQL_REPLICA_DSN") or DSN
ODBC_DRIVER = os.environ.get("LEASE_ODBC_DRIVER")

pytestmark = pytest.mark.skipif(
    not DSN,
    reason="no SQL Server: set LEASE_TEST_MSSQL_DSN to an ODBC connection string of a scratch "
           "database (optionally LEASE_TEST_MSSQL_REPLICA_DSN and LEASE_ODBC_DRIVER) and run "
           "pytest tests/integration/test_sqlserver_live.py")


def driver(dsn: str = DSN) -> PyodbcDriver:
    return PyodbcDriver(dsn, odbc_driver=ODBC_DRIVER, login_timeout=10, query_timeout=10,
                        label="mssql-test")


@pytest.fixture
async def make_store():
    async with store_factory(lambda replica, dsn: SqlRowStore(
            TsqlDialect(), driver(dsn or DSN), replica=replica)) as make:
        yield make


class TestSqlServerContract(RowStoreContract):
    """The shared row-lease contract over pyodbc on SQL Server."""


def settings(identity: str = "a", **extra: str):
    return load({"backend": "sqlserver", "dsn": DSN, "identity": identity, **extra}, env={})


async def test_provisioning_is_idempotent_and_matches_the_design() -> None:
    await sqlserver.ENTRY.apply_schema(settings())
    await sqlserver.ENTRY.apply_schema(settings())
    odbc = driver()
    try:
        columns = await odbc.fetch(Statement(
            "SELECT COLUMN_NAME, DATA_TYPE, IS_NULLABLE FROM INFORMATION_SCHEMA.COLUMNS "
            "WHERE TABLE_SCHEMA = 'lease' AND TABLE_NAME = 'Leases' ORDER BY ORDINAL_POSITION"),
            {})
        indexes = await odbc.fetch(Statement(
            "SELECT name FROM sys.indexes WHERE object_id = OBJECT_ID(N'[lease].[Leases]') "
            "AND name IS NOT NULL ORDER BY name"), {})
    finally:
        await odbc.close()
    assert columns == [
        ("LeaseName", "nvarchar", "NO"), ("OwnerInstanceId", "nvarchar", "NO"),
        ("AcquiredAtUtc", "datetimeoffset", "NO"), ("RenewedAtUtc", "datetimeoffset", "NO"),
        ("ExpiresAtUtc", "datetimeoffset", "NO"), ("Metadata", "nvarchar", "YES"),
        ("RowVersion", "timestamp", "NO")]
    assert [name for (name,) in indexes] == ["IX_Leases_ExpiresAtUtc", "PK_Leases"]


async def test_replica_confirmation_by_rowversion(make_store) -> None:
    primary, replica = make_store(), make_store(replica=True, dsn=REPLICA_DSN)
    name = fresh()
    lease = RowLease(primary, "n", name, "a", duration=LONG, safety_margin=1.0,
                     replica=ReplicaCheck(replica, timeout=10.0))
    grant = await lease.try_acquire()
    assert grant.held
    assert (await replica.read(name)).version == grant.fencing_token


async def test_wrong_password_is_login_failed_without_the_password() -> None:
    wrong = re.sub(r"(?i)(PWD|Password)=(\{[^}]*\}|[^;]*)", r"\1=not-the-password", DSN)
    odbc = driver(wrong)
    try:
        with pytest.raises(BackendError) as caught:
            await odbc.fetch(Statement("SELECT 1"), {})
    finally:
        await odbc.close()
    assert "login failed" in str(caught.value) and "not-the-password" not in str(caught.value)


def test_three_processes_one_leader_and_sigterm_hands_over(tmp_path: Path) -> None:
    args = ["--backend", "sqlserver", "--dsn", DSN, "--name", f"live-{fresh()[-8:]}",
            "--lease-duration", "4s", "--renew-interval", "0.5s", "--renew-deadline", "2s"]
    if ODBC_DRIVER:
        args += ["--odbc-driver", ODBC_DRIVER]
    applied = subprocess.run([sys.executable, "-m", "sidecar", "schema", *args[:4], "--apply"],
                             capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0, applied.stderr
    procs = [SidecarProcess(tmp_path, f"m{i}", args).start() for i in range(3)]
    try:
        for proc in procs:
            proc.wait_http()

        def leaders() -> list[SidecarProcess]:
            return [p for p in procs if p.proc.poll() is None and p.leader() == 200]

        leader = wait_until(leaders, timeout=15)[0]
        time.sleep(1.0)
        assert leaders() == [leader]
        leader.signal(signal.SIGTERM)
        # No NOTIFY on SQL Server: standbys notice on their next retry (renew interval).
        successor = wait_until(lambda: [p for p in leaders() if p is not leader], timeout=5)
        assert len(successor) == 1 and leader.proc.wait(10) == 0
    finally:
        for proc in procs:
            proc.stop()
