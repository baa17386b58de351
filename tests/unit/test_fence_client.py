"""sidecar/client.py without a sidecar or a database: the claim rule, the leader file, how
a refusal is recognised, and that it needs nothing beyond the standard library.

The client against a real sidecar and real databases (psycopg, asyncpg, pyodbc through
psqlODBC, PgBouncer) is tests/integration/test_fence_client.py. SQL Server's refusal can
only be checked as text here (no SQL Server runs): its ODBC message is built below in the
form the ODBC drivers give it, ``[SQLSTATE] [driver][SQL Server]message (number)``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar import fence
from sidecar.client import Claim, ClaimExpired, Leadership, NotLeader, StaleToken, _stale
from testkit.support import REPO


def body(leader: bool = True, token: int = 42, until_ms: int | None = None) -> dict:
    until = until_ms if until_ms is not None else time.time_ns() // 1_000_000 + 250
    return {"leader": leader, "lease": "jobs", "identity": "a", "holder": "a" if leader else "b",
            "fencing_token": token, "valid_until_ms": until}


def test_a_claim_holds_only_for_a_leader_before_its_valid_until() -> None:
    claim = Claim.from_json(body(until_ms=1_000))
    assert claim.holds(999) and not claim.holds(1_000)
    assert claim.check(999) is claim
    with pytest.raises(ClaimExpired, match="expired 5 ms ago"):
        claim.check(1_005)
    standby = Claim.from_json(body(leader=False, until_ms=10**15))
    assert not standby.holds(0)
    with pytest.raises(NotLeader, match=r"not the leader \(held by b\)"):
        standby.check(0)


def test_the_leader_file_is_read_and_its_absence_is_not_leading(tmp_path: Path) -> None:
    path = tmp_path / "jobs"
    leadership = Leadership("jobs", file=path)
    assert leadership.claim() == Claim(leader=False, lease="jobs")
    with pytest.raises(NotLeader), leadership.unit():
        pytest.fail("ran without a claim")
    path.write_text(json.dumps(body(token=7)))
    with leadership.unit() as claim:
        assert claim.fencing_token == 7
    path.write_text(json.dumps(body(token=7, until_ms=1)))  # a file left by a dead sidecar
    with pytest.raises(ClaimExpired):
        leadership.claim().check()


def test_only_while_leading_runs_the_function_only_under_a_claim(tmp_path: Path) -> None:
    path = tmp_path / "jobs"
    calls = []
    leadership = Leadership("jobs", file=path)

    @leadership.only_while_leading
    def sweep(n: int) -> int:
        calls.append(n)
        return n * 2

    with pytest.raises(NotLeader):
        sweep(1)
    path.write_text(json.dumps(body()))
    assert sweep(2) == 4 and calls == [2]


def test_wait_on_a_file_returns_once_the_claim_appears(tmp_path: Path) -> None:
    path = tmp_path / "jobs"
    leadership = Leadership("jobs", file=path)
    started = time.monotonic()
    assert not leadership.wait(0.2).leader
    assert time.monotonic() - started >= 0.2
    path.write_text(json.dumps(body(until_ms=time.time_ns() // 1_000_000 + 5_000)))
    assert leadership.wait(5).holds()


def test_from_env_prefers_the_file_exec_and_the_chart_give() -> None:
    env = {"LEASE_LEADER_FILE": "/x/leader", "LEASE_LEADER_URL": "http://127.0.0.1:1/leader",
           "LEASE_NAME": "jobs"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        chosen = Leadership.from_env()
        assert (chosen.file, chosen.url, chosen.lease) == (Path("/x/leader"), None, "jobs")
        mp.delenv("LEASE_LEADER_FILE")
        chosen = Leadership.from_env()
        assert (chosen.file, chosen.url) == (None, "http://127.0.0.1:1/leader")


class PostgresError(Exception):
    """What psycopg and asyncpg raise: the SQLSTATE as ``sqlstate``."""

    def __init__(self, message: str, sqlstate: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def test_the_guards_refusal_is_recognised_from_each_driver() -> None:
    message = f"{fence.STALE_MESSAGE} 5 for lease 'jobs': the highest seen is 9"
    found = _stale(PostgresError(message, fence.STALE_SQLSTATE), "jobs", 5)
    assert isinstance(found, StaleToken) and (found.token, found.highest) == (5, 9)
    # psqlODBC: the server's SQLSTATE is the ODBC one.
    odbc_pg = Exception(fence.STALE_SQLSTATE, f"ERROR: {message};\nError while executing")
    assert _stale(odbc_pg, "jobs", 5) is not None
    # SQL Server: a THROW is SQLSTATE 42000; the number and the message say which.
    odbc_ms = Exception("42000", f"[42000] [Microsoft][ODBC Driver 18 for SQL Server][SQL "
                        f"Server]{message} ({fence.SQLSERVER_STALE_ERROR}) (SQLExecDirectW)")
    stale = _stale(odbc_ms, "jobs", 5)
    assert stale is not None and stale.highest == 9
    # Anything else is not a refusal.
    assert _stale(PostgresError("deadlock detected", "40P01"), "jobs", 5) is None
    assert _stale(Exception("42000", "[42000] Incorrect syntax (102)"), "jobs", 5) is None


def test_the_client_imports_with_the_standard_library_alone() -> None:
    # -S: no site-packages at all, so aiohttp, asyncpg, psycopg or pyodbc cannot load.
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import sidecar.client; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('aiohttp', 'asyncpg', 'psycopg', 'pyodbc', 'yaml', 'h11')))")
    result = subprocess.run([sys.executable, "-S", "-c", probe, str(REPO)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
