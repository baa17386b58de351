"""The HTTP bounds and the ``POST /release`` rules of a real ``lease-sidecar`` process.

Real processes on one SQLite file, real sockets on loopback, the shipped limits
(``sidecar.publish.http``). Each load is bounded in count (at most ``MAX_CONNECTIONS`` + 1
sockets) and time.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.publish.http import HEADER_TIMEOUT, MAX_CONNECTIONS, MAX_WAITERS
from testkit.support import SidecarProcess, get_json, one_leader, post_json, serving, wait_until

# A renew every 20 s: a leader's state does not change on its own for that long (renews
# no longer end a blocking query — tests/integration/test_longpoll.py — but a quiet
# leader keeps these figures free of renew work).
QUIET = ["--lease-duration", "60s", "--renew-interval", "20s", "--renew-deadline", "30s"]
FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def read_head(sock: socket.socket, timeout: float) -> bytes:
    """Bytes up to the end of the response head, or b"" if none arrived in time."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        pass
    return data


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path, "bounded",
                          args=["--dsn", str(tmp_path / "l.db"), "--log-level", "debug",
                                *QUIET]).start()
    try:
        proc.wait_http()
        wait_until(lambda: proc.leader() == 200, timeout=10)
        yield proc
    finally:
        proc.stop()


def test_waiter_cap_answers_at_once_with_the_true_claim(leader: SidecarProcess) -> None:
    _, _, headers = get_json(leader.url + "/leader")
    tag = headers["ETag"]
    request = (f"GET /leader?wait=120 HTTP/1.1\r\nHost: 127.0.0.1:{leader.port}\r\n"
               f"If-None-Match: {tag}\r\n\r\n").encode()
    parked = []
    try:
        for _ in range(MAX_WAITERS):
            sock = connect(leader.port)
            sock.sendall(request)
            parked.append(sock)
        wait_until(lambda: f"lease_sidecar_http_waiters {MAX_WAITERS}.0" in str(
            get_json(leader.url + "/metrics")[1]), timeout=10)
        # One more: answered at once, with the leader's true claim, marked as not parked.
        started = time.monotonic()
        status, body, extra = get_json(leader.url + "/leader?wait=120", timeout=5,
                                       headers={"If-None-Match": tag})
        assert time.monotonic() - started < 2
        assert status == 200 and body["leader"] is True and body["fencing_token"]
        assert extra["Lease-Wait"] == "full" and extra["Retry-After"] == "1"
        # The parked ones are still parked (nothing to read yet).
        assert read_head(parked[0], 0.2) == b""
        # A release changes the state: every parked waiter is answered, none as leader.
        assert post_json(leader.url + "/release")[0] == 202
        heads = [read_head(sock, 10) for sock in parked]
        assert all(head.startswith(b"HTTP/1.1 503 ") for head in heads), {
            head[:20] for head in heads}
    finally:
        for sock in parked:
            sock.close()


# On a busy machine the server may take longer than the header timeout to accept all the
# held connections (CI failed three times on a fixed window: the first held ones were
# closed for idling before the last was accepted, so the extra one was never refused).
# So each probe first re-opens any held connection the server has closed; the cap is
# reached however slowly the server accepts. Quiet: fewer re-opens.
@pytest.mark.quiet
def test_connection_cap_answers_503_retry_after(leader: SidecarProcess) -> None:
    held = []
    try:
        # Opened well within the header timeout, so none is closed for idling.
        for _ in range(MAX_CONNECTIONS):
            held.append(connect(leader.port))
        heads: list[bytes] = []
        reopened = 0

        def refused() -> bool:
            nonlocal reopened
            # A held connection the server closed (idle past the header timeout) reads
            # as readable at EOF: open a fresh one in its place.
            closed, _, _ = select.select(held, [], [], 0)
            for sock in closed:
                held.remove(sock)
                sock.close()
                held.append(connect(leader.port))
                reopened += 1
            extra = connect(leader.port)
            extra.sendall(b"GET /leader HTTP/1.1\r\nHost: x\r\n\r\n")
            heads.append(read_head(extra, 3))
            extra.close()
            return heads[-1].startswith(b"HTTP/1.1 503 ")

        # Once the server has accepted all it holds, one more is refused.
        wait_until(refused, timeout=6 * HEADER_TIMEOUT, interval=0.1)
        assert b"Retry-After: 1" in heads[-1] and b"Connection: close" in heads[-1]
        # Any earlier probe came before the server had accepted them all: it was served.
        assert all(h.startswith(b"HTTP/1.1 200 ") for h in heads[:-1]), (heads, reopened)
    finally:
        for sock in held:
            sock.close()
    # Served again once they are gone. A probe may come before the server has seen all
    # the closes and be refused too, and counted: that is the cap working, so the count
    # is checked against what the probes saw, not against 1 alone.
    seen = {"refused": 0, "unanswered": 0}

    def served() -> bool:
        status, body, _ = get_json(leader.url + "/healthz")
        if status == 503 and body == {"error": "too many connections"}:
            seen["refused"] += 1
        elif status == 0:  # a refusal the client did not get to read
            seen["unanswered"] += 1
        return status == 200

    wait_until(served, timeout=5)
    metrics = get_json(leader.url + "/metrics")[1]
    refused = next(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith('lease_sidecar_http_refused_total{bound="connections"}'))
    assert 1 + seen["refused"] <= refused <= 1 + seen["refused"] + seen["unanswered"], (
        refused, seen)


def test_slowloris_is_closed_within_the_header_timeout(leader: SidecarProcess) -> None:
    socks = []
    for _ in range(20):
        sock = connect(leader.port)
        sock.sendall(f"GET /leader HTTP/1.1\r\nHost: 127.0.0.1:{leader.port}\r\n".encode())
        socks.append(sock)
    started = time.monotonic()
    closed: dict[int, float] = {}
    try:
        # One more header line per connection every 0.5 s; never the blank line.
        deadline = started + HEADER_TIMEOUT + 5
        n = 0
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for i, sock in enumerate(socks):
                if i in closed:
                    continue
                try:
                    sock.sendall(f"X-Slow-{n}: a\r\n".encode())
                    sock.settimeout(0.02)
                    if sock.recv(1024) == b"":
                        closed[i] = time.monotonic() - started
                except TimeoutError:
                    pass
                except OSError:
                    closed[i] = time.monotonic() - started
            n += 1
            time.sleep(0.5)
    finally:
        for sock in socks:
            sock.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} still open"
    assert max(closed.values()) <= HEADER_TIMEOUT + 1.5, closed
    assert get_json(leader.url + "/healthz")[0] == 200


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GET /leader HTTP/1.1\r\nHost: x\r\n\r\nGET /x HTTP/1.1\r\nBad Header\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200)) + b"\r\n",
], ids=["bad-header", "pipelined", "long-line", "many-headers"])
def test_malformed_request_logs_no_traceback(leader: SidecarProcess, raw: bytes) -> None:
    sock = connect(leader.port)
    sock.sendall(raw)
    answer = b""
    sock.settimeout(3)
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    sock.close()
    assert b" 400 " in answer and b"Traceback" not in answer
    wait_until(lambda: "sidecar.http" in leader.logs(), timeout=3)
    lines = [json.loads(line) for line in leader.logs().splitlines()
             if '"sidecar.http"' in line]
    assert lines and all(line["level"] == "debug" and "exception" not in line
                         for line in lines), lines
    assert "Traceback" not in leader.logs()


def test_release_from_a_web_page_is_refused(leader: SidecarProcess) -> None:
    port = leader.port
    for headers in ({"Origin": "http://evil.example"},
                    {"Host": f"evil.example:{port}"},  # DNS rebinding to 127.0.0.1
                    {"Host": f"localhost:{port + 1}"}):
        status, body, _ = post_json(leader.url + "/release", headers=headers)
        assert status == 403 and "error" in body, headers
    assert leader.leader() == 200
    assert "released on request" not in leader.logs()
    assert post_json(leader.url + "/release", headers={"Host": f"localhost:{port}"})[0] == 202
    wait_until(lambda: leader.leader() == 503, timeout=25)


def test_release_on_a_standby_is_409_and_forgotten(tmp_path: Path) -> None:
    """Before: the standby remembered the request and stepped down right after its next
    acquisition, so nobody led for a whole lease duration."""
    procs = [SidecarProcess(tmp_path, f"node-{i}",
                            args=["--dsn", str(tmp_path / "l.db"), *FAST])
             for i in range(2)]
    with serving(procs):
        first = wait_until(lambda: one_leader(procs), timeout=10)
        standby = next(p for p in procs if p is not first)
        status, body, _ = post_json(standby.url + "/release")
        assert status == 409 and body["released"] is False
        first.signal(signal.SIGTERM)
        wait_until(lambda: standby.leader() == 200, timeout=5)
        # Several renew intervals (300 ms) later it still leads: nothing was remembered.
        for _ in range(15):
            time.sleep(0.1)
            assert standby.leader() == 200
        assert "released on request" not in standby.logs()
