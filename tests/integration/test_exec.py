"""``lease-sidecar exec`` with real processes: the whole job ends, whatever ends the lease.

The job is ``sh -c 'worker & worker'``: two worker processes (Python) under a shell, the
shape that left work running under PID 1 before. Each worker appends ``start``, ``tick``
(every 20 ms) and ``stop`` lines with its pid and a ``CLOCK_MONOTONIC`` time (one clock
for every process on the host) to a shared log, so the tests can check both that every
worker is gone (by pid and start time in ``/proc``) and that no two jobs ever overlapped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from testkit.support import SidecarProcess, released_rows, wait_until

FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]
LEASE_DURATION = 2.0

WORKER = """
import os, signal, sys, time
log, tag, mode = sys.argv[1:4]
def line(kind):
    with open(log, "a") as fh:
        fh.write(f"{kind} {tag} {os.getpid()} {time.monotonic():.6f}\\n")
stopping = []
if mode == "polite":   # finishes its batch (0.2 s) on SIGTERM, then exits
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
else:                  # "stubborn": ignores SIGTERM; only SIGKILL ends it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
line("start")
while not stopping:
    line("tick")
    time.sleep(0.02)
time.sleep(0.2)
line("stop")
"""


@dataclass(frozen=True)
class Worker:
    tag: str
    pid: int
    started: float  # monotonic
    last: float  # monotonic time of its last line
    stopped: bool  # wrote its stop line (ended on its own terms after SIGTERM)
    birth: int  # start time in /proc (clock ticks), to tell a reused pid apart

    def alive(self) -> bool:
        stat = _stat(self.pid)
        return stat is not None and stat[0] != "Z" and int(stat[19]) == self.birth


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def workers(log: Path, births: dict[int, int] | None = None) -> list[Worker]:
    """Workers seen in the log; ``births`` caches each pid's /proc start time."""
    births = {} if births is None else births
    seen: dict[int, dict] = {}
    if not log.exists():
        return []
    for line in log.read_text().splitlines():
        kind, tag, pid, at = line.split()
        entry = seen.setdefault(int(pid), {"tag": tag, "started": float(at), "stopped": False})
        entry["last"] = float(at)
        entry["stopped"] |= kind == "stop"
    found = []
    for pid, entry in seen.items():
        if pid not in births:
            stat = _stat(pid)
            births[pid] = int(stat[19]) if stat else -1
        found.append(Worker(pid=pid, birth=births[pid], **entry))
    return found


@pytest.fixture
def job(tmp_path: Path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    log = tmp_path / "workers.log"

    def command(tag: str, mode: str = "polite", tail: str = "") -> list[str]:
        one = f"{sys.executable} {script} {log} {tag}"
        return ["sh", "-c", f"{one}-1 {mode} & {one}-2 {mode}{tail}"]

    yield command, log
    # A failing test must not leave its workers running (they would, before the fix).
    for worker in workers(log):
        if worker.alive():
            os.kill(worker.pid, signal.SIGKILL)


def start_exec(tmp_path: Path, identity: str, cmd: list[str], *extra: str) -> SidecarProcess:
    return SidecarProcess(tmp_path, identity, command="exec",
                          args=["--dsn", str(tmp_path / "leases.db"), *FAST, *extra, "--",
                                *cmd]).start()


def wait_workers(log: Path, tag: str, count: int, births: dict[int, int]) -> list[Worker]:
    def found() -> list[Worker] | None:
        mine = [w for w in workers(log, births) if w.tag.startswith(tag)]
        return mine if len(mine) >= count else None

    return wait_until(found, timeout=15)


@contextlib.contextmanager
def running_job(tmp_path: Path, cmd: list[str], log: Path, births: dict[int, int],
                grace: str) -> Iterator[tuple[SidecarProcess, list[Worker]]]:
    """``exec`` running ``cmd`` (two workers tagged a-1 and a-2); yields it and the
    workers once both have started, and stops it at the end."""
    runner = start_exec(tmp_path, "exec-a", cmd, "--grace", grace)
    try:
        runner.wait_http()
        yield runner, wait_workers(log, "a", 2, births)
    finally:
        runner.stop()


def assert_job_ended(runner: SidecarProcess, started: list[Worker], log: Path,
                     births: dict[int, int]) -> None:
    """exec exits, and by then every worker is gone, each after its SIGTERM."""
    assert runner.proc is not None
    runner.proc.wait(timeout=10)
    assert [w for w in started if w.alive()] == []
    assert all(w.stopped for w in workers(log, births))  # SIGTERM first, not SIGKILL


def test_release_ends_every_worker_before_exec_exits(tmp_path, job):
    command, log = job
    births: dict[int, int] = {}
    with running_job(tmp_path, command("a"), log, births, grace="5s") as (runner, started):
        assert runner.release() == 202
        assert_job_ended(runner, started, log, births)
        assert "stopping command" in runner.logs()
    with sqlite3.connect(tmp_path / "leases.db") as conn:
        assert released_rows(conn) == [True]  # released, with the release record


def test_a_worker_that_left_the_process_group_is_ended_too(tmp_path, job):
    """``setsid`` takes a worker out of the job's group (and session): still a descendant
    of the guard, so it gets SIGTERM (and SIGKILL after the grace) like the rest."""
    command, log = job
    births: dict[int, int] = {}
    script = tmp_path / "worker.py"
    escapee = f"setsid {sys.executable} {script} {log} x-1 polite"
    runner = start_exec(tmp_path, "exec-a", ["sh", "-c", f"{escapee} & " + command("a")[2]],
                        "--grace", "5s")
    try:
        runner.wait_http()
        stay = wait_workers(log, "a-", 2, births)
        (away,) = wait_workers(log, "x-", 1, births)
        started = [*stay, away]
        assert _stat(away.pid)[3] != _stat(stay[0].pid)[3]  # another session indeed
        assert runner.release() == 202
        assert_job_ended(runner, started, log, births)
    finally:
        runner.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT,
                                 signal.SIGUSR1, signal.SIGQUIT])
def test_a_signal_to_exec_ends_every_worker(tmp_path, job, sig):
    command, log = job
    births: dict[int, int] = {}
    with running_job(tmp_path, command("a"), log, births, grace="5s") as (runner, started):
        runner.signal(sig)
        assert_job_ended(runner, started, log, births)


@pytest.mark.parametrize("mode", ["polite", "stubborn"])
def test_sigkill_of_exec_ends_every_worker(tmp_path, job, mode):
    """The supervisor cannot catch SIGKILL; its guard sees the control pipe close.

    Stubborn workers ignore SIGTERM and the grace is 60 s: they still get SIGKILL by
    the end of the lease validity (+ safety margin), before anyone else could lead.
    """
    command, log = job
    births: dict[int, int] = {}
    with running_job(tmp_path, command("a", mode), log, births, grace="60s") as (runner, started):
        runner.signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: not any(w.alive() for w in started), timeout=LEASE_DURATION + 3)
        assert time.monotonic() - killed <= LEASE_DURATION + 0.5
        stopped = {w.pid: w.stopped for w in workers(log, births)}
        assert all(stopped.values()) == (mode == "polite")
        assert "stopping the command: lease-sidecar exec is gone" in runner.logs()


def test_exec_exits_with_the_command_and_ends_what_it_left_running(tmp_path, job):
    command, log = job
    births: dict[int, int] = {}
    # The shell starts two background workers... and exits 3 at once.
    runner = start_exec(tmp_path, "exec-a", command("a", tail=" & exit 3"), "--grace", "5s")
    try:
        assert runner.proc.wait(timeout=15) == 3
        started = workers(log, births)
        assert [w for w in started if w.alive()] == []
    finally:
        runner.stop()
    with sqlite3.connect(tmp_path / "leases.db") as conn:
        assert released_rows(conn) == [True]  # released, with the release record


def test_a_killed_guard_is_covered_by_exec(tmp_path, job):
    """Someone SIGKILLs the guard: its orphans come to exec (a subreaper), which ends them."""
    command, log = job
    births: dict[int, int] = {}
    with running_job(tmp_path, command("a"), log, births, grace="5s") as (runner, started):
        guard = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                 if (_stat(pid) or ["", "0"])[1] == str(runner.proc.pid)]
        assert len(guard) == 1
        os.kill(guard[0], signal.SIGKILL)
        assert runner.proc.wait(timeout=10) == 128 + signal.SIGKILL
        assert [w for w in started if w.alive()] == []


@pytest.mark.parametrize("fault", ["release", "sigkill", "sigstop", "sigterm"])
def test_a_waiting_exec_never_runs_while_a_worker_of_the_first_runs(tmp_path, job, fault):
    command, log = job
    births: dict[int, int] = {}
    # Stubborn workers and a long grace make the worst case: only SIGKILL ends them.
    mode = "stubborn" if fault in ("sigkill", "sigstop") else "polite"
    first = start_exec(tmp_path, "exec-a", command("a", mode), "--grace", "30s")
    second = None
    try:
        first.wait_http()
        wait_workers(log, "a", 2, births)
        second = start_exec(tmp_path, "exec-b", command("b", mode), "--grace", "30s")
        second.wait_http()
        time.sleep(0.5)  # b contends and loses
        assert not [w for w in workers(log, births) if w.tag.startswith("b")]
        if fault == "release":
            assert first.release() == 202
        elif fault == "sigstop":
            # Resumed after two lease durations (the fault model's longest freeze): a
            # freeze in the middle of a commit holds the SQLite file until then.
            first.freeze(2 * LEASE_DURATION)
        else:
            first.signal({"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}[fault])
        wait_workers(log, "b", 2, births)
        time.sleep(0.3)
        every = workers(log, births)
        a_side = [w for w in every if w.tag.startswith("a")]
        b_side = [w for w in every if w.tag.startswith("b")]
        assert not any(w.alive() for w in a_side)
        # Each a-worker's last line comes before any b-worker's first line.
        assert max(w.last for w in a_side) < min(w.started for w in b_side)
    finally:
        if second is not None:
            second.stop()
        first.signal(signal.SIGCONT)
        first.stop()


@pytest.mark.parametrize(("make", "code", "message"), [
    (lambda d: "no-such-command-here", 127, "no-such-command-here: command not found"),
    (lambda d: str(d / "missing"), 127, "No such file or directory"),
    (lambda d: str(d / "plain.txt"), 126, "Permission denied"),
    (lambda d: str(d), 126, "Is a directory"),
])
def test_unusable_command_is_one_line_and_the_shell_code(tmp_path, make, code, message):
    (tmp_path / "plain.txt").write_text("not a program\n")
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "exec", "--dsn", str(tmp_path / "l.db"),
         "--state-dir", str(tmp_path / "state"), "--http-addr", "127.0.0.1:0", "--",
         make(tmp_path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == code
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "l.db").exists()  # refused before contending for the lease


def test_guard_reports_a_command_that_vanished_after_the_check(tmp_path):
    """The file can go between exec's check and the start: the guard says it, one line."""
    from sidecar.cli import exec_supervise as supervise

    read_end, write_end = os.pipe()
    try:
        result = subprocess.run(
            [sys.executable, "-I", "-S", str(supervise.GUARD_SCRIPT), str(read_end), "1.0",
             "0.1", repr(time.monotonic() + 30), "--", str(tmp_path / "gone")],
            pass_fds=(read_end,), capture_output=True, text=True, timeout=30)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert result.returncode == 127
    assert result.stderr.strip().splitlines() == [
        f"lease-sidecar: exec: {tmp_path / 'gone'}: No such file or directory"]


def test_the_command_is_told_its_lease(tmp_path):
    """As ``consul lock`` sets CONSUL_LOCK_HELD: name, fencing token, the first claim's
    expiry, and where to read the live claim (file and URL) while it runs."""
    out = tmp_path / "env.txt"
    script = tmp_path / "show.py"
    script.write_text(
        "import json, os, sys, urllib.request\n"
        "env = {k: v for k, v in os.environ.items() if k.startswith('LEASE_')}\n"
        "with open(os.environ['LEASE_LEADER_FILE']) as fh:\n"
        "    env['file'] = json.load(fh)\n"
        "with urllib.request.urlopen(os.environ['LEASE_LEADER_URL'], timeout=5) as r:\n"
        "    env['url'] = json.load(r)\n"
        f"open({str(out)!r}, 'w').write(json.dumps(env))\n")
    proc = start_exec(tmp_path, "exec-env", [sys.executable, str(script)], "--name", "jobs")
    try:
        assert proc.proc is not None and proc.proc.wait(30) == 0, proc.logs()
    finally:
        proc.stop()
    seen = json.loads(out.read_text())
    assert seen["LEASE_HELD"] == "1" and seen["LEASE_NAME"] == "jobs"
    token = int(seen["LEASE_FENCING_TOKEN"])
    assert token == seen["file"]["fencing_token"] == seen["url"]["fencing_token"]
    assert seen["url"]["leader"] is True and seen["url"]["lease"] == "jobs"
    # The expiry at start, in both forms; the file holds a live claim too. The file is
    # rewritten every two thirds of a claim horizon (100 ms here), so the claim the child
    # reads there may be one rewrite older than the one it was handed at start.
    assert seen["LEASE_VALID_UNTIL_MS"].isdigit()
    assert seen["LEASE_VALID_UNTIL"].endswith("Z")
    assert seen["file"]["valid_until_ms"] >= int(seen["LEASE_VALID_UNTIL_MS"]) - 100
