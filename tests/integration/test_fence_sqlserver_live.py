"""The fencing guard's procedure on a live SQL Server — only when one is given.

No SQL Server runs here: CI checks the T-SQL with a parser (tests/unit/test_fence_sql.py)
and runs the same client path (pyodbc) against PostgreSQL's guard through psqlODBC
(tests/integration/test_fence_client.py). With a scratch database this runs the procedure
itself; it creates ``[lease].[LeaseFence]`` and ``[lease].[lease_fence]`` there::

    export LEASE_TEST_MSSQL_DSN='DRIVER={ODBC Driver 18 for SQL Server};\
    SERVER=127.0.0.1,1433;DATABASE=leasetest;UID=sa;PWD=...;TrustServerCertificate=yes'
    pytest tests/integration/test_fence_sqlserver_live.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from sidecar import fence
from sidecar.client import StaleToken, fence_pyodbc

DSN = os.environ.get("LEASE_TEST_MSSQL_DSN", "")

pytestmark = pytest.mark.skipif(
    not DSN, reason="no SQL Server: set LEASE_TEST_MSSQL_DSN to an ODBC connection string of "
                    "a scratch database and run pytest tests/integration/"
                    "test_fence_sqlserver_live.py")


@pytest.fixture(scope="module")
def applied() -> None:
    for _ in range(2):  # idempotent
        result = subprocess.run([sys.executable, "-m", "sidecar", "fence-schema", "--apply",
                                 "--dsn", DSN], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr


def connect():  # type: ignore[no-untyped-def]  # a test helper
    import pyodbc

    return pyodbc.connect(DSN, autocommit=False, timeout=10)


def test_equal_passes_higher_is_recorded_lower_is_refused(applied: None) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    conn = connect()
    try:
        for token in (5, 5, 2**53 - 1):
            fence_pyodbc(conn.cursor(), token, name)
            conn.commit()
        cursor = conn.cursor()
        cursor.execute("CREATE TABLE #w (t BIGINT)")
        conn.commit()
        cursor.execute("INSERT INTO #w VALUES (1)")
        with pytest.raises(StaleToken) as caught:
            fence_pyodbc(cursor, 6, name)
        assert caught.value.highest == 2**53 - 1
        # XACT_ABORT: the refusal rolled back the whole transaction, the insert too.
        assert conn.cursor().execute("SELECT @@TRANCOUNT").fetchone()[0] == 0
        assert conn.cursor().execute("SELECT count(*) FROM #w").fetchone()[0] == 0
    finally:
        conn.close()


def test_outside_a_transaction_the_procedure_refuses_to_guard(applied: None) -> None:
    import pyodbc

    conn = pyodbc.connect(DSN, autocommit=True, timeout=10)
    try:
        with pytest.raises(pyodbc.Error, match=str(fence.SQLSERVER_BAD_CALL_ERROR)):
            conn.cursor().execute(fence.call("sqlserver", "lease", "?"), "x", 1)
    finally:
        conn.close()
