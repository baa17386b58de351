"""Real `lease-sidecar` processes on one SQLite file, with real signals."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.support import (
    ClaimRecorder,
    SidecarProcess,
    get_json,
    one_leader,
    released_rows,
    serving,
    wait_until,
)

FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]
LEASE_DURATION = 2.0


@pytest.fixture
def trio(tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    with serving([SidecarProcess(tmp_path, f"node-{i}",
                                 args=["--dsn", str(tmp_path / "leases.db"), *FAST])
                  for i in range(3)]) as procs:
        yield procs


def test_exactly_one_of_three_leads(trio):
    leader = wait_until(lambda: one_leader(trio), timeout=10)
    statuses = sorted(p.leader() for p in trio)
    assert statuses == [200, 503, 503]
    body = json.loads((leader.state_dir / "leader").read_text())
    assert body["identity"] == leader.identity and body["leader"] is True
    for other in trio:
        if other is not leader:
            assert not (other.state_dir / "leader").exists()
            assert get_json(other.url + "/leader")[1]["holder"] == leader.identity


def test_sigkill_leader_is_replaced_within_lease_duration(trio):
    leader = wait_until(lambda: one_leader(trio), timeout=10)
    leader.signal(signal.SIGKILL)
    killed = time.monotonic()
    rest = [p for p in trio if p is not leader]
    wait_until(lambda: one_leader(rest), timeout=LEASE_DURATION + 1.0)
    assert time.monotonic() - killed <= LEASE_DURATION + 1.0


def test_sigterm_leader_hands_over_at_once(trio):
    leader = wait_until(lambda: one_leader(trio), timeout=10)
    token = get_json(leader.url + "/leader")[1]["fencing_token"]
    leader.signal(signal.SIGTERM)
    stopped = time.monotonic()
    rest = [p for p in trio if p is not leader]
    successor = wait_until(lambda: one_leader(rest), timeout=1.0)
    assert time.monotonic() - stopped <= 1.0
    assert leader.proc.wait(5) == 0
    assert not (leader.state_dir / "leader").exists()
    assert get_json(successor.url + "/leader")[1]["fencing_token"] > token


def test_sigstop_leader_never_publishes_stale_leader(trio):
    leader = wait_until(lambda: one_leader(trio), timeout=10)
    rest = [p for p in trio if p is not leader]
    with ClaimRecorder(trio) as recorder:
        time.sleep(0.3)
        # Resumed after two lease durations at the latest (the fault model's longest
        # freeze): a freeze in the middle of a commit holds the SQLite file until then.
        leader.freeze(2 * LEASE_DURATION)
        wait_until(lambda: one_leader(rest), timeout=2 * LEASE_DURATION + 2)
        time.sleep(0.5)
        leader.signal(signal.SIGCONT)
        first_answer = get_json(leader.url + "/leader", timeout=3)[0]
        time.sleep(1.0)
    assert first_answer == 503
    assert recorder.overlaps() == []
    assert {c[0] for c in recorder.claims} >= {leader.identity}
    assert len({c[0] for c in recorder.claims}) >= 2


def test_exec_kills_its_child_when_the_lease_is_lost(tmp_path: Path):
    db = tmp_path / "leases.db"
    marker = tmp_path / "child-ran"
    child_script = (f"import signal,sys,time,pathlib; pathlib.Path({str(marker)!r}).touch();"
                    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); time.sleep(60)")
    runner = SidecarProcess(tmp_path, "exec-1", command="exec",
                            args=["--dsn", str(db), *FAST, "--grace", "1s", "--",
                                  sys.executable, "-c", child_script]).start()
    try:
        wait_until(marker.exists, timeout=10)
        # Steal the lease: rewrite the row's owner, as if another holder took it over.
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE leases SET owner = 'thief'")
        code = runner.proc.wait(timeout=LEASE_DURATION + 5)
        assert code == 143  # the child's own exit code after our SIGTERM
        assert "stopping command" in runner.logs()
    finally:
        runner.stop()


def test_exec_releases_when_the_command_exits_and_mirrors_its_code(tmp_path: Path):
    db = tmp_path / "leases.db"
    runner = SidecarProcess(tmp_path, "exec-2", command="exec",
                            args=["--dsn", str(db), *FAST, "--",
                                  sys.executable, "-c", "raise SystemExit(7)"]).start()
    assert runner.proc.wait(timeout=15) == 7
    runner.stop()
    with sqlite3.connect(db) as conn:
        assert released_rows(conn) == [True]  # released, with the release record


@pytest.mark.parametrize(("args", "named"), [
    (["--lease-duration", "soon"], "LEASE_DURATION / --lease-duration"),
    (["--backend", "oracle"], "LEASE_BACKEND / --backend"),
    (["--renew-interval", "30s"], "LEASE_RENEW_INTERVAL / --renew-interval"),
    (["--backend", "postgres"], "LEASE_DSN / --dsn"),
])
def test_bad_settings_exit_2_naming_the_setting(args, named, tmp_path):
    result = subprocess.run([sys.executable, "-m", "sidecar", "run", *args,
                             "--state-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0]


def test_bad_env_setting_exits_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "sidecar", "run"],
                            env={"LEASE_CLAIM_HORIZON": "forever", "PATH": "/usr/bin"},
                            capture_output=True, text=True, timeout=20)
    assert result.returncode == 2
    assert "LEASE_CLAIM_HORIZON / --claim-horizon" in result.stderr


def test_unreachable_backend_keeps_running_and_recovers(tmp_path: Path):
    # Another process's exclusive lock makes the database unusable until it lets go (a
    # DSN that can never work, like a path under a regular file, is refused up front).
    db = tmp_path / "leases.db"
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    proc = SidecarProcess(tmp_path, "lonely", args=["--dsn", str(db), *FAST]).start()
    try:
        proc.wait_http()
        time.sleep(2.0)  # several retries
        assert proc.proc.poll() is None
        assert proc.leader() == 503
        assert get_json(proc.url + "/readyz")[0] == 503
        assert get_json(proc.url + "/healthz")[0] == 200
        blocker.execute("ROLLBACK")
        blocker.close()
        wait_until(lambda: proc.leader() == 200, timeout=LEASE_DURATION * 3)
        assert get_json(proc.url + "/readyz")[0] == 200
        lines = [json.loads(line) for line in proc.logs().splitlines() if line.startswith("{")]
        unreachable = [line for line in lines if line["msg"] == "backend unreachable"]
        assert len(unreachable) == 1  # one line per state change, not one per retry
        assert any(line["msg"] == "backend reachable again" for line in lines)
    finally:
        blocker.close()
        proc.stop()


def test_release_endpoint_hands_over(trio):
    leader = wait_until(lambda: one_leader(trio), timeout=10)
    assert leader.release() == 202
    rest = [p for p in trio if p is not leader]
    wait_until(lambda: one_leader(rest), timeout=2.0)
    assert leader.leader() == 503


def test_api_role_never_contends(tmp_path: Path):
    proc = SidecarProcess(tmp_path, "api-1",
                          args=["--dsn", str(tmp_path / "l.db"), "--role", "api"]).start()
    try:
        proc.wait_http()
        status, body, _ = get_json(proc.url + "/leader")
        assert status == 503 and body["role"] == "api"
        assert "acquired lease" not in proc.logs()
        assert not (tmp_path / "l.db").exists()  # never touched the backend
    finally:
        proc.stop()


def test_several_names_each_with_their_own_file(tmp_path: Path):
    proc = SidecarProcess(tmp_path, "multi",
                          args=["--dsn", str(tmp_path / "l.db"), "--name", "sweep,mail",
                                *FAST]).start()
    try:
        proc.wait_http()
        wait_until(lambda: get_json(proc.url + "/leader/mail")[0] == 200, timeout=10)
        assert get_json(proc.url + "/leader")[1]["lease"] == "sweep"
        for name in ("leader", "sweep", "mail"):
            wait_until((proc.state_dir / name).exists, timeout=2)
    finally:
        assert proc.stop() == 0
    assert not any((proc.state_dir / n).exists() for n in ("leader", "sweep", "mail"))


def test_runs_with_no_settings_at_all(tmp_path: Path):
    """`lease-sidecar run` on the embedded default: port 8099, /run/lease, sqlite."""
    if get_json("http://127.0.0.1:8099/healthz", timeout=0.5)[0]:
        pytest.skip("something already listens on 127.0.0.1:8099")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "sidecar", "run"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        status = wait_until(lambda: get_json("http://127.0.0.1:8099/leader")[0] == 200,
                            timeout=20)
        assert status
        body = get_json("http://127.0.0.1:8099/status")[1]
        state_dir = Path(body["settings"]["state_dir"])
        assert body["settings"]["backend"] == "sqlite"
        started = [json.loads(line) for line in proc.stdout.readline().decode().splitlines()]
        published = Path(started[0]["state_dir"]) / "leader"
        wait_until(published.exists, timeout=1)
        assert json.loads(published.read_text())["leader"] is True
        assert state_dir == Path("/run/lease") or published.parent != state_dir
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    assert not published.exists()
