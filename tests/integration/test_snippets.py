"""The app snippets of docs/integration.md, each run against a real sidecar.

Every snippet (shell, Python, Go, Node.js, Java) is a real file under docs/snippets/, the
same text as in the doc, and is run here with its own toolchain against a real
``lease-sidecar run`` process on SQLite: it must see leadership, carry the current
fencing token into its work, never work past the ``valid_until_ms`` it was given, stop
when the sidecar releases (POST /release) and again when it is SIGTERMed, and long-poll
with the ETag while standby. A small recording proxy sits between the snippet and the
sidecar to check the last point.
"""

from __future__ import annotations

import http.client
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from testkit.support import REPO, SidecarProcess, get_json, wait_until

# Each snippet follows a real sidecar on SQLite through 3 s leases; a fresh machine's
# background builds (compilers, disk writes) can stall its renews until it steps down,
# which this test would read as the snippet's fault: run after them.
pytestmark = pytest.mark.quiet

SNIPPETS = REPO / "docs" / "snippets"
DOC = REPO / "docs" / "integration.md"
GO = shutil.which("go") or "/usr/local/go/bin/go"

# language -> (file, command; the file's path is appended)
RUNNERS: dict[str, tuple[str, list[str]]] = {
    "shell": ("worker.sh", ["bash"]),
    "python": ("worker.py", [sys.executable, "-u"]),
    "go": ("worker.go", [GO, "run"]),
    "node": ("worker.mjs", ["node"]),
    "java": ("Worker.java", ["java"]),
}
HORIZON_MS = 250  # the sidecar's default claim horizon, used below
WORK = re.compile(r"^work token=(\d+) now_ms=(\d+) until_ms=(\d+)$")


def test_every_snippet_file_is_in_the_doc_verbatim():
    doc = DOC.read_text()
    blocks = dict(re.findall(r"<!-- snippet: (\S+) -->\n```\w+\n(.*?)```", doc, re.S))
    files = {p.name for p in SNIPPETS.iterdir() if p.is_file()}
    assert set(blocks) == files == {name for name, _ in RUNNERS.values()}
    for name in files:
        assert blocks[name] == (SNIPPETS / name).read_text(), f"{name} differs from the doc"
    assert "docs/integration.md" in (REPO / "README.md").read_text()


# ------------------------------------------------------------------- recording proxy


@dataclass
class Seen:
    wait: str | None
    if_none_match: str | None
    status: int
    etag: str | None


@dataclass
class Proxy:
    """Forwards GET /leader… to the sidecar and records each exchange in order.

    When the sidecar is gone it drops the connection without an answer, as the sidecar
    itself would look to the snippet.
    """

    upstream_port: int
    seen: list[Seen] = field(default_factory=list)
    # Hand this many leader answers over late, after their claim has expired, as a
    # slow network or a paused client would see them.
    delay_leader: int = 0
    delayed: int = 0

    def start(self) -> Proxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                sent = self.headers.get("If-None-Match")
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=40)
                try:
                    conn.request("GET", self.path,
                                 headers={"If-None-Match": sent} if sent else {})
                    response = conn.getresponse()
                    body = response.read()
                except OSError:
                    self.close_connection = True
                    return
                finally:
                    conn.close()
                etag = response.getheader("ETag")
                if response.status == 200 and proxy.delay_leader > 0:
                    proxy.delay_leader -= 1
                    time.sleep((HORIZON_MS + 150) / 1000)
                    proxy.delayed += 1
                proxy.seen.append(Seen((query.get("wait") or [None])[0], sent,
                                       response.status, etag))
                self.send_response(response.status)
                self.send_header("Content-Type", "application/json")
                if etag:
                    self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None: ...

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/leader"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------- the snippet process


@dataclass
class Snippet:
    command: list[str]
    env: dict[str, str]
    lines: list[tuple[float, str]] = field(default_factory=list)

    def start(self) -> Snippet:
        # Own session: `go run` leaves its compiled child running if only it is killed.
        self.proc = subprocess.Popen(self.command, env=self.env, cwd=SNIPPETS,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def work(self) -> list[tuple[int, int, int]]:
        """(token, now_ms, until_ms) of every unit of work so far."""
        return [tuple(int(g) for g in m.groups())  # type: ignore[misc]  # the regex has 3 groups
                for _, line in list(self.lines) if (m := WORK.match(line))]

    def standbys(self) -> int:
        return sum(line == "standby" for _, line in list(self.lines))

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines[-40:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def toolchain(command: list[str]) -> None:
    """The toolchains are part of this machine kind (and installed by scripts/test)."""
    assert shutil.which(command[0]) or Path(command[0]).exists(), \
        f"{command[0]} not installed: scripts/test installs it"


@pytest.mark.slow
@pytest.mark.parametrize("language", list(RUNNERS))
def test_snippet_follows_leadership_of_a_real_sidecar(language: str, tmp_path: Path):
    name, command = RUNNERS[language]
    toolchain(command)
    sidecar = SidecarProcess(tmp_path, f"app-{language}", args=[
        "--dsn", str(tmp_path / "leases.sqlite3"), "--lease-duration", "3s",
        "--renew-interval", "300ms", "--renew-deadline", "2s"]).start()
    proxy: Proxy | None = None
    snippet: Snippet | None = None
    try:
        sidecar.wait_http()
        proxy = Proxy(sidecar.port).start()
        env = {**os.environ, "LEASE_LEADER_URL": proxy.url,
               "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
        snippet = Snippet([*command, str(SNIPPETS / name)], env).start()

        # 1. It sees leadership and works with the sidecar's current fencing token.
        #    (Generous: the first `go run` or Java launch compiles on a busy machine.)
        wait_until(snippet.work, 120, interval=0.1)
        first_token = get_json(sidecar.url + "/leader")[1]["fencing_token"]
        assert {token for token, _, _ in snippet.work()} == {first_token}, snippet.output()

        # 2. Leader answers that arrive after their valid_until_ms: no work on them
        #    (checked below: no unit starts at or past its until_ms), and no standby.
        proxy.delay_leader = 3
        wait_until(lambda: proxy.delayed == 3, 10)
        units = len(snippet.work())
        wait_until(lambda: len(snippet.work()) > units, 5)
        assert snippet.standbys() == 0, snippet.output()

        # 3. POST /release: the sidecar unpublishes; the snippet stops working.
        with urllib.request.urlopen(urllib.request.Request(
                sidecar.url + "/release", method="POST"), timeout=5) as response:
            assert response.status == 202
        wait_until(lambda: sidecar.leader() == 503, 10)
        unpublished_ms = time.time() * 1000
        wait_until(lambda: snippet.standbys() == 1, 10)
        before_release = len(snippet.work())

        # 4. After sitting out one lease duration the sidecar leads again, with a new
        #    token, and the snippet picks it up.
        wait_until(lambda: any(t != first_token for t, _, _ in snippet.work()), 20,
                   interval=0.1)
        second_token = get_json(sidecar.url + "/leader")[1]["fencing_token"]
        assert second_token > first_token
        later = snippet.work()[before_release:]
        assert {t for t, _, _ in later} == {second_token}, snippet.output()

        # 5. SIGTERM: the sidecar unpublishes, releases and exits; the snippet stops.
        sidecar.signal(signal.SIGTERM)
        assert sidecar.proc is not None
        assert sidecar.proc.wait(10) == 0
        exited_ms = time.time() * 1000
        wait_until(lambda: snippet.standbys() == 2, 10)
        time.sleep(1.5)  # the snippet keeps retrying; it must not work again

        work = snippet.work()
        # It never starts a unit after the valid_until it was handed...
        assert all(now < until for _, now, until in work), snippet.output()
        # ...so no unit started after the sidecar stopped claiming (one horizon at most).
        first_term = [now for token, now, _ in work if token == first_token]
        assert max(first_term) < unpublished_ms + HORIZON_MS
        assert max(now for _, now, _ in work) < exited_ms + HORIZON_MS
        assert snippet.lines[-1][1] == "standby", snippet.output()
        assert snippet.proc.poll() is None, "the snippet must outlive its sidecar"

        # 6. Standby long-polls with the ETag it was given; leading asks at once.
        seen = list(proxy.seen)
        polls = [s for s in seen if s.wait == "30"]
        assert polls and any(s.wait == "0" for s in seen)
        with_etag = [i for i, s in enumerate(seen) if s.if_none_match]
        assert with_etag, "no request carried If-None-Match"
        for i in with_etag:
            assert i > 0 and seen[i].if_none_match == seen[i - 1].etag, seen[i - 3:i + 1]
        assert any(s.if_none_match for s in polls)
    finally:
        if snippet:
            snippet.stop()
        if proxy:
            proxy.stop()
        sidecar.stop()
