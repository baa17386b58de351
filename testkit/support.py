"""Helpers for tests and benchmarks that run real sidecar processes."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from testkit.procs import free_port

__all__ = ["REPO", "Answer", "ClaimRecorder", "SidecarProcess", "claim_overlaps", "free_port",
           "get_json", "long_poll", "one_leader", "post_json", "serving", "unix_time",
           "wait_until"]

Claim = tuple[str, float, float]  # (identity, from, until): wall-clock seconds

REPO = Path(__file__).resolve().parent.parent


def unix_time(stamp: str) -> float:
    """An ISO 8601 time (the sidecar's log ``ts``, its answers' ``valid_until``/``since``, a
    Kubernetes timestamp or MicroTime; "Z" or an offset) as a Unix time."""
    return dt.datetime.fromisoformat(stamp).timestamp()


def unix_time_or_none(stamp: str | None) -> float | None:
    """:func:`unix_time` of a time that may be missing or empty (a Lease's
    ``acquireTime``, an answer's ``valid_until`` while nobody leads): None then."""
    return unix_time(stamp) if stamp else None


def get_json(url: str, timeout: float = 2.0,
             headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    """GET ``url``; (status, parsed JSON or text, headers). Status 0 when unreachable."""
    return _request(urllib.request.Request(url, headers=headers or {}), timeout)


def post_json(url: str, timeout: float = 5.0,
              headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    """POST an empty body to ``url``; answers as :func:`get_json`."""
    return _request(urllib.request.Request(url, data=b"", method="POST", headers=headers or {}),
                    timeout)


def _request(request: urllib.request.Request,
             timeout: float) -> tuple[int, Any, dict[str, str]]:
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, _parse(response.read()), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, _parse(err.read()), dict(err.headers)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, None, {}


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


@dataclass
class SidecarProcess:
    """One ``lease-sidecar`` process with its own port and state dir."""

    workdir: Path
    identity: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    command: str = "run"
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def state_dir(self) -> Path:
        return self.workdir / f"state-{self.identity}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.identity}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SidecarProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        cmd = [sys.executable, "-m", "sidecar", self.command,
               "--identity", self.identity,
               "--http-addr", f"127.0.0.1:{self.port}",
               "--state-dir", str(self.state_dir), *self.args]
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=self.log,
                                     cwd=REPO)
        return self

    def wait_http(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"{self.identity} exited early:\n{self.logs()}")
            if get_json(self.url + "/healthz", timeout=0.5)[0] in (200, 503):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.identity} did not serve HTTP:\n{self.logs()}")

    def leader(self, timeout: float = 3.0) -> int:
        """Status of GET /leader: 200, 503, or 0 if the process does not answer."""
        return get_json(self.url + "/leader", timeout=timeout)[0]

    def release(self, timeout: float = 5.0) -> int:
        """Status of POST /release: 202 when accepted, 0 if the process does not answer."""
        return post_json(self.url + "/release", timeout=timeout)[0]

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def freeze(self, at_most: float) -> None:
        """SIGSTOP now, SIGCONT after ``at_most`` seconds (sooner: ``signal(SIGCONT)``).
        Within the fault model a process is frozen for up to two lease durations; and on
        ``sqlite`` a process frozen in the middle of a commit keeps the file's lock, so
        nobody else can commit, and lead, until it resumes (docs/sqlite.md)."""
        self.signal(signal.SIGSTOP)
        resume = threading.Timer(at_most, self._resume)
        resume.daemon = True
        resume.start()

    def _resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Answer:
    """One answer to ``GET /leader?wait=`` (a long poll)."""

    status: int
    body: Any
    tag: str  # its ETag
    sent: float  # monotonic
    returned: float  # monotonic
    returned_wall: float

    @property
    def waited(self) -> float:
        return self.returned - self.sent


def long_poll(url: str, tag: str | None, wait: float) -> Answer:
    """``GET {url}/leader?wait=``, sending ``tag`` as If-None-Match: it returns when the
    answer differs from ``tag`` or after ``wait`` seconds."""
    headers = {"If-None-Match": tag} if tag else {}
    sent = time.monotonic()
    status, body, answer_headers = get_json(f"{url}/leader?wait={wait:g}", timeout=wait + 10,
                                            headers=headers)
    return Answer(status, body, answer_headers.get("ETag", ""), sent, time.monotonic(),
                  time.time())


def claim_overlaps(claims: list[Claim]) -> list[tuple[Claim, Claim]]:
    """Pairs of claims by different identities whose [from, until) intervals intersect."""
    found = []
    ordered = sorted(claims, key=lambda c: c[1])
    for i, first in enumerate(ordered):
        for second in ordered[i + 1:]:
            if second[1] >= first[2]:
                break
            if second[0] != first[0]:
                found.append((first, second))
    return found


def one_leader(procs: list[SidecarProcess], timeout: float = 3.0) -> SidecarProcess | None:
    """The one running process answering 200 on /leader, or None (none, or several)."""
    found = [p for p in procs
             if p.proc and p.proc.poll() is None and p.leader(timeout=timeout) == 200]
    return found[0] if len(found) == 1 else None


@contextmanager
def serving(procs: list[SidecarProcess]) -> Iterator[list[SidecarProcess]]:
    """Start ``procs`` and wait until each serves HTTP; stopped on leaving."""
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_http()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def wait_until(predicate, timeout: float, interval: float = 0.02):
    """Poll ``predicate`` until it returns something truthy; return it or raise."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)


class ClaimRecorder:
    """Polls every sidecar every ~10 ms; keeps each 200 as a claim [seen, valid_until]."""

    def __init__(self, procs: list[SidecarProcess]) -> None:
        self.procs = procs
        self.claims: list[Claim] = []
        # (moment asked, identity, fencing token) of every claim, for the token order
        self.tokens: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._poll, args=(p,), daemon=True)
                         for p in procs]

    def __enter__(self) -> ClaimRecorder:
        for thread in self._threads:
            thread.start()
        return self

    def seen_a_claim(self, timeout: float = 5.0) -> ClaimRecorder:
        """Wait until a claim is recorded: a check after a step-down then compares with
        the old holder's claims, not with a recorder that has not polled yet."""
        deadline = time.monotonic() + timeout
        while not self.claims:
            if time.monotonic() > deadline:
                raise AssertionError(f"no claim recorded within {timeout}s")
            time.sleep(0.005)
        return self

    def add(self, proc: SidecarProcess) -> None:
        """Poll one more process (a newcomer) from now on."""
        thread = threading.Thread(target=self._poll, args=(proc,), daemon=True)
        self._threads.append(thread)
        thread.start()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)

    def _poll(self, proc: SidecarProcess) -> None:
        while not self._stop.is_set():
            sent = time.time()
            status, body, _ = get_json(proc.url + "/leader", timeout=0.5)
            if status == 200:
                until = unix_time(body["valid_until"])
                self.claims.append((proc.identity, sent, until))
                self.tokens.append((sent, proc.identity, body["fencing_token"]))
            time.sleep(0.01)

    def overlaps(self) -> list[tuple[Claim, Claim]]:
        return claim_overlaps(self.claims)

    def token_regressions(self) -> list[tuple[tuple[float, str, int], tuple[float, str, int]]]:
        """Consecutive claims (by moment asked) whose token went down, or stayed the same
        across a change of holder: each pair breaks "the token only grows"."""
        ordered = sorted(self.tokens)
        return [(a, b) for a, b in itertools.pairwise(ordered)
                if b[2] < a[2] or (b[1] != a[1] and b[2] == a[2])]


def released_rows(conn: sqlite3.Connection) -> list[bool]:
    """Per lease row: released by its holder (expired, with the release record)."""
    return [bool(r) for (r,) in conn.execute(
        "SELECT metadata = 'released:' || version AND expires_at <= "
        "(julianday('now') - 2440587.5) * 86400.0 FROM leases")]


class ReadyEndpoint:
    """A real HTTP server on loopback answering GET /ready with ``status``."""

    def __init__(self, status: int) -> None:
        self.status = status
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(endpoint.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ready"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
