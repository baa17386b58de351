"""Faults on the SQLite file itself, with real sidecar processes on one real file.

Deleting the database (or putting another file in its place) while sidecars run used to
give two leaders and a fencing token that went back to 1; two sidecars with the same
identity both led with the same token. A recorder samples every sidecar's
``GET /leader`` every ~10 ms and keeps each answer as a claim up to its ``valid_until``.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.support import ClaimRecorder, SidecarProcess, get_json, one_leader, wait_until

FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]
LEASE_DURATION = 2.0


@pytest.fixture
def pair(tmp_path: Path):
    db = tmp_path / "db" / "leases.sqlite3"
    procs = [SidecarProcess(tmp_path, f"node-{i}", args=["--dsn", str(db), *FAST]).start()
             for i in range(2)]
    for proc in procs:
        proc.wait_http()
    yield db, procs
    for proc in procs:
        proc.stop()


def token_of(proc: SidecarProcess) -> int:
    status, body, _ = get_json(proc.url + "/leader")
    assert status == 200
    return int(body["fencing_token"])


def log_lines(proc: SidecarProcess) -> list[dict]:
    return [json.loads(line) for line in proc.logs().splitlines() if line.startswith("{")]


def delete(db: Path, spare: Path) -> None:
    db.unlink()


def replace_with_a_fresh_file(db: Path, spare: Path) -> None:
    sqlite3.connect(spare).close()  # an empty database...
    spare.replace(db)  # ...renamed over the path (as an editor or a restore would)


def replace_with_an_old_copy(db: Path, spare: Path) -> None:
    spare.replace(db)  # the copy taken before the run: an older counter, stale rows


@pytest.mark.parametrize("fault", [delete, replace_with_a_fresh_file, replace_with_an_old_copy],
                         ids=["deleted", "replaced-by-a-fresh-file", "replaced-by-an-old-copy"])
def test_a_vanished_database_never_gives_two_leaders_nor_a_smaller_token(pair, fault):
    db, procs = pair
    leader = wait_until(lambda: one_leader(procs), timeout=10)
    spare = db.parent / "spare.sqlite3"
    with sqlite3.connect(db) as src, sqlite3.connect(spare) as dst:
        src.backup(dst)  # an "old copy" of the database as it is now
    # Two handovers first, so the token is above the counter the copy holds.
    for _ in range(2):
        assert leader.release() == 202
        leader = next(p for p in procs if p is not leader)
        wait_until(lambda leader=leader: leader.leader() == 200, timeout=LEASE_DURATION * 2 + 2)
    before = token_of(leader)
    with ClaimRecorder(procs) as recorder:
        time.sleep(0.3)
        fault(db, spare)
        faulted = time.monotonic()
        # The holder steps down at its next renew; nobody leads for one lease
        # duration (the hold-off), then exactly one does.
        wait_until(lambda: all(p.leader() == 503 for p in procs), timeout=2)
        successor = wait_until(lambda: one_leader(procs), timeout=LEASE_DURATION * 3 + 2)
        recovered = time.monotonic() - faulted
        time.sleep(0.5)
    assert recorder.overlaps() == []
    assert recovered >= LEASE_DURATION - 0.3  # the hold-off
    after = token_of(successor)
    assert after > before
    warned = [line for p in procs for line in log_lines(p)
              if line["msg"].startswith("sqlite database file was deleted or replaced")]
    assert warned  # the holder (at least) says why it stepped down
    assert db.exists() and Path(str(db) + "-fence").exists()


def test_tokens_keep_growing_when_everything_is_deleted_between_runs(tmp_path):
    """Database and fence gone with nothing running: the wall clock still seeds above."""
    db = tmp_path / "leases.sqlite3"
    tokens = []
    for run in range(2):
        proc = SidecarProcess(tmp_path, f"run-{run}", args=["--dsn", str(db), *FAST]).start()
        try:
            proc.wait_http()
            wait_until(lambda proc=proc: proc.leader() == 200, timeout=10)
            tokens.append(token_of(proc))
        finally:
            assert proc.stop() == 0
        for leftover in tmp_path.glob("leases.sqlite3*"):
            leftover.unlink()
    assert tokens[1] > tokens[0]


def test_two_sidecars_with_one_identity_never_both_lead(tmp_path):
    db = tmp_path / "leases.sqlite3"
    first = SidecarProcess(tmp_path, "twin", args=["--dsn", str(db), *FAST]).start()
    # Same identity; its own port, log and state dir (they are named after the identity).
    (tmp_path / "second").mkdir()
    second = SidecarProcess(tmp_path / "second", "twin", args=["--dsn", str(db), *FAST])
    try:
        first.wait_http()
        wait_until(lambda: first.leader() == 200, timeout=10)
        second.start()
        second.wait_http()
        with ClaimRecorder([first, second]) as recorder:
            time.sleep(2 * LEASE_DURATION)
        assert recorder.overlaps() == []
        assert second.leader() == 503 and first.leader() == 200
        warnings = [line for line in log_lines(second)
                    if line["msg"].startswith("another live holder has our identity")]
        assert len(warnings) == 1 and warnings[0]["level"] == "warning"
        metrics = get_json(second.url + "/metrics")[1]
        count = [line for line in metrics.splitlines()
                 if line.startswith('lease_sidecar_duplicate_identity_total{lease="default"}')]
        assert count and float(count[0].split()[-1]) >= 1
        # When the first one goes, the twin takes over (after the row expires).
        first.stop()
        wait_until(lambda: second.leader() == 200, timeout=LEASE_DURATION * 2 + 2)
    finally:
        first.stop()
        second.stop()


@pytest.mark.parametrize("dsn", [":memory:", "file::memory:?cache=shared", "sqlite:///:memory:",
                                 "postgresql://db/x"])
def test_memory_and_non_file_dsns_are_refused(tmp_path, dsn):
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--dsn", dsn, "--state-dir", str(tmp_path),
         "--http-addr", "127.0.0.1:0"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "LEASE_DSN / --dsn" in lines[0]


def test_the_backend_refuses_them_too():
    """Defence in depth: the backend does not rely on the settings check."""
    from sidecar.config import ConfigError
    from sidecar.lease.sqlite import sqlite_path

    for dsn in ("", ":memory:", "file:x.db?mode=memory", "sqlite:///:memory:", "mysql://h/d"):
        with pytest.raises(ConfigError, match="not a file path"):
            sqlite_path(dsn)
