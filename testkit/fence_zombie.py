"""The zombie leader: a leader paused between its claim check and its writes, resumed after
a newer leader has written, firing writes with its old token. Shared by
tests/integration/test_fence_zombie.py (a few hundred writes) and bench/bench_fence.py
(10,000, on each backend, with and without the guard, figures for docs/fencing.md).

Two real sidecars (A, then B) hold one lease ``jobs`` on a real backend; each has an app
process (``python -m testkit.fence_zombie app``) that writes to a real PostgreSQL
application database, one transaction per write (the guard ``lease_fence`` first when
``guard``, then an insert naming the writer, its token and its phase):

1. A leads; its app writes continuously, checking its claim before each write.
2. A's app is armed: after its next successful check it records the token and stops
   itself (SIGSTOP) — the pause between check and write; then A's sidecar is stopped.
   Both stay stopped for twice the lease duration.
3. B takes over; its app writes with the new token.
4. A's sidecar and app are resumed (SIGCONT); the app fires ``zombie_writes`` writes with
   the token it checked, without checking again.
5. B's app keeps writing throughout and is stopped last.

From the application database: the zombie writes that committed (every one of them comes
after B's first committed write, so each is stale), and every committed write whose token
is lower than one committed before it (by id: the bigserial is drawn after the guard,
under its row lock). From the apps: each write's outcome, refusals by SQLSTATE.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit.support import REPO, SidecarProcess, wait_until

NAME = "jobs"
TABLE = """CREATE TABLE IF NOT EXISTS writes (
    id bigserial PRIMARY KEY, writer text NOT NULL, token bigint NOT NULL,
    phase text NOT NULL)"""


# -- the application process -----------------------------------------------------------------
def app_main(argv: list[str]) -> int:
    import psycopg

    from sidecar.client import Leadership, StaleToken, fence_psycopg

    parser = argparse.ArgumentParser()
    for flag in ("--url", "--dsn", "--writer", "--out", "--arm", "--checked"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--guard", type=int, default=1)
    parser.add_argument("--zombie-writes", type=int, default=0)
    args = parser.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    leadership = Leadership(NAME, url=args.url)
    counts: Counter[str] = Counter()
    tokens: set[int] = set()

    def write(conn: psycopg.Connection, token: int, phase: str) -> None:
        try:
            with conn.transaction():
                if args.guard:
                    fence_psycopg(conn, token, NAME)
                conn.execute("INSERT INTO writes (writer, token, phase) VALUES (%s, %s, %s)",
                             (args.writer, token, phase))
            counts[f"{phase}:committed"] += 1
        except StaleToken as exc:
            counts[f"{phase}:refused:{getattr(exc.__cause__, 'sqlstate', '?')}"] += 1
        except psycopg.Error as exc:
            counts[f"{phase}:failed:{exc.sqlstate}"] += 1

    # prepare_threshold=None: no server-side prepared statements (transaction pooling).
    with psycopg.connect(args.dsn, prepare_threshold=None) as conn:
        while not stop:
            claim = leadership.claim()
            if not claim.holds():
                counts["not-leader"] += 1
                time.sleep(0.02)
                continue
            assert claim.fencing_token is not None
            tokens.add(claim.fencing_token)
            if Path(args.arm).exists():
                Path(args.checked).write_text(str(claim.fencing_token))
                os.kill(os.getpid(), signal.SIGSTOP)  # paused after the check...
                started = time.monotonic()
                for _ in range(args.zombie_writes):  # ...resumed: writes, no new check
                    write(conn, claim.fencing_token, "zombie")
                counts["zombie-seconds-x1000"] = round((time.monotonic() - started) * 1000)
                break
            write(conn, claim.fencing_token, "normal")
    Path(args.out).write_text(json.dumps({"counts": counts, "tokens": sorted(tokens)}))
    return 0


# -- the orchestration ------------------------------------------------------------------------
@dataclass
class App:
    writer: str
    url: str
    dsn: str
    workdir: Path
    guard: bool
    zombie_writes: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def path(self, what: str) -> Path:
        return self.workdir / f"app-{self.writer}.{what}"

    def start(self) -> App:
        cmd = [sys.executable, "-m", "testkit.fence_zombie", "app", "--url", self.url,
               "--dsn", self.dsn, "--writer", self.writer, "--out", str(self.path("json")),
               "--arm", str(self.path("arm")), "--checked", str(self.path("checked")),
               "--guard", str(int(self.guard)), "--zombie-writes", str(self.zombie_writes)]
        self.log = open(self.path("log"), "ab")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=self.log)
        return self

    def finish(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"app {self.writer} did not finish in {timeout:g} s") from None
        finally:
            self.log.close()
        if self.proc.returncode != 0:
            raise AssertionError(f"app {self.writer} exited {self.proc.returncode}: "
                                 + self.path("log").read_text()[-2000:])
        return json.loads(self.path("json").read_text())

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


@dataclass
class Setup:
    """One backend: how to make a contender, and the database the apps write to."""

    backend: str
    app_dsn: str  # the application's database (the guard lives here)
    make_sidecar: Callable[[Path, str], SidecarProcess]
    lease_duration: float
    pooled: bool = False
    details: dict[str, Any] = field(default_factory=dict)


def prepare_app_database(dsn: str, guard: bool) -> None:
    """The writes table, emptied; the guard applied (and its record of tokens emptied)."""
    import psycopg

    if guard:
        result = subprocess.run([sys.executable, "-m", "sidecar", "fence-schema", "--apply",
                                 "--dsn", dsn], capture_output=True, text=True, timeout=60,
                                cwd=REPO)
        if result.returncode != 0:
            raise AssertionError(f"fence-schema --apply failed: {result.stderr}")
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        conn.execute(TABLE)
        conn.execute("TRUNCATE writes")
        if guard:
            conn.execute('DELETE FROM "lease".lease_fence WHERE name = %s', (NAME,))


def query(dsn: str, sql: str, *params: object) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        return conn.execute(sql, params).fetchall()


@contextlib.contextmanager
def running(procs: list[SidecarProcess]) -> Iterator[None]:
    try:
        yield
    finally:
        for proc in procs:
            proc.stop()


def zombie_run(setup: Setup, workdir: Path, guard: bool, zombie_writes: int) -> dict[str, Any]:
    """One run of the scenario above; its figures."""
    workdir.mkdir(parents=True, exist_ok=True)
    prepare_app_database(setup.app_dsn, guard)
    stopped_for = 2 * setup.lease_duration
    a, b = setup.make_sidecar(workdir, "pod-a"), setup.make_sidecar(workdir, "pod-b")
    apps: list[App] = []
    with running([a, b]):
        a.start()
        a.wait_http()
        wait_until(lambda: a.leader() == 200, 30)
        b.start()
        b.wait_http()
        app_a = App("A", f"{a.url}/leader/{NAME}", setup.app_dsn, workdir, guard,
                    zombie_writes)
        app_b = App("B", f"{b.url}/leader/{NAME}", setup.app_dsn, workdir, guard)
        apps += [app_a.start(), app_b.start()]
        try:
            def written(writer: str, above: int = -1) -> int:
                return query(setup.app_dsn, "SELECT count(*) FROM writes WHERE writer = %s "
                             "AND token > %s", writer, above)[0][0]

            wait_until(lambda: written("A") >= 50, 30)
            app_a.path("arm").write_text("")
            wait_until(lambda: app_a.path("checked").exists(), 10)
            assert a.proc is not None
            a.proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            old_token = int(app_a.path("checked").read_text())
            # B takes over and writes while A is stopped (bounded: it must, well within
            # the pause, or the run says so).
            wait_until(lambda: written("B", old_token) >= 20, stopped_for + 30)
            takeover = time.monotonic() - stopped
            time.sleep(max(0.0, stopped + stopped_for - time.monotonic()))
            a.proc.send_signal(signal.SIGCONT)
            assert app_a.proc is not None
            app_a.proc.send_signal(signal.SIGCONT)
            report_a = app_a.finish(timeout=300)
            time.sleep(0.5)  # B goes on writing after the zombie's burst
            assert app_b.proc is not None
            app_b.proc.send_signal(signal.SIGTERM)
            report_b = app_b.finish(timeout=30)
        finally:
            for app in apps:
                app.kill()
    rows = query(setup.app_dsn, "SELECT writer, token, phase FROM writes ORDER BY id")
    highest, out_of_order = 0, 0
    for _, token, _ in rows:
        out_of_order += token < highest
        highest = max(highest, token)
    new_tokens = [t for t in report_b["tokens"] if t > old_token]
    counts_a, counts_b = Counter(report_a["counts"]), Counter(report_b["counts"])
    refusals = {key.split(":", 2)[2]: n for key, n in counts_a.items()
                if key.startswith("zombie:refused:")}
    failed_a = {key: n for key, n in counts_a.items() if key.startswith("zombie:failed:")}
    return {
        "backend": setup.backend, "pooled": setup.pooled, "guard": guard,
        "lease_duration_s": setup.lease_duration, "stopped_for_s": stopped_for,
        "takeover_s": round(takeover, 2), "old_token": old_token,
        "new_tokens": new_tokens,
        "leader_writes_before_pause": counts_a["normal:committed"],
        "zombie_writes": zombie_writes,
        "zombie_committed": sum(1 for w, _, p in rows if w == "A" and p == "zombie"),
        "zombie_refused": refusals, "zombie_failed_otherwise": failed_a,
        "zombie_seconds": counts_a["zombie-seconds-x1000"] / 1000,
        "new_leader_writes": sum(n for k, n in counts_b.items() if k.startswith("normal:")),
        "new_leader_committed": counts_b["normal:committed"],
        "new_leader_refused_or_failed": sum(
            n for k, n in counts_b.items()
            if k.startswith(("normal:refused", "normal:failed"))),
        "committed_out_of_token_order": out_of_order,
        **setup.details,
    }


if __name__ == "__main__":
    if sys.argv[1:2] != ["app"]:
        raise SystemExit("usage: python -m testkit.fence_zombie app ...")
    sys.exit(app_main(sys.argv[2:]))
