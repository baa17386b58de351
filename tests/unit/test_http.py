"""The HTTP contract, served by the real server (``HttpServer``) on a loopback port.

The sidecar's own process is tested in tests/integration/test_http_limits.py; here the
limits are lowered (``Limits``, ``header_timeout``) so each bound is reached quickly.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from sidecar.publish.http import (
    App,
    HttpServer,
    Limits,
    ReleaseOutcome,
    Request,
    Response,
    build_app,
    host_allowed,
    is_loopback,
    release_hosts,
)
from sidecar.state import LeaseState
from tests.unit.fakes import FakeClock


def make_app(clock: FakeClock, released: list[str | None] | None = None,
             limits: Limits | None = None, holding: bool = True):
    states = [LeaseState(lease=n, identity="me", role="all", claim_horizon=0.25, clock=clock)
              for n in ("first", "second")]

    def release(name: str | None) -> ReleaseOutcome:
        if name not in (None, "first", "second"):
            return "no-such-lease"
        if not holding:
            return "not-holding"
        if released is not None:
            released.append(name)
        return "released"

    app = build_app(states, status=lambda: {"ok": True},
                    alive=lambda: True, ready=lambda: states[0].facts.backend_ok,
                    release=release, limits=limits)
    return app, states


class Client:
    """The real HttpServer on 127.0.0.1:<free port> and an aiohttp client session."""

    def __init__(self, app: App, header_timeout: float = 5.0) -> None:
        self.server = HttpServer(app, "127.0.0.1", 0, header_timeout=header_timeout)
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> Client:
        await self.server.start()
        self.port = self.server.bound_port
        self.session = aiohttp.ClientSession(f"http://127.0.0.1:{self.port}")
        return self

    def get(self, path: str, **kwargs: Any) -> Any:
        assert self.session is not None
        return self.session.get(path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Any:
        assert self.session is not None
        return self.session.post(path, **kwargs)

    async def raw(self, data: bytes, timeout: float = 2.0) -> bytes:
        """Send ``data`` on a new connection; everything the server answers until it closes."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(data)
        try:
            return await asyncio.wait_for(reader.read(), timeout)
        finally:
            writer.close()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        await self.server.stop()


@asynccontextmanager
async def client_for(app: App,
                     header_timeout: float = 5.0) -> AsyncIterator[Client]:
    """``app`` served by a started :class:`Client`'s server; both closed after."""
    client = await Client(app, header_timeout).start()
    try:
        yield client
    finally:
        await client.close()


def lead(state: LeaseState, clock: FakeClock) -> None:
    state.update(holding=True, claim_from=clock.now, valid_until=clock.now + 10,
                 fencing_token=42, backend_ok=True)


async def test_leader_and_standby_answers():
    clock = FakeClock()
    app, states = make_app(clock)
    async with client_for(app) as client:
        response = await client.get("/leader")
        assert response.status == 503
        body = await response.json()
        assert body["leader"] is False and body["lease"] == "first"
        lead(states[0], clock)
        response = await client.get("/leader")
        assert response.status == 200
        body = await response.json()
        assert body["fencing_token"] == 42 and body["valid_until"].endswith("Z")
        assert response.headers["ETag"]
        # /leader/{name} addresses the others; /leader is the first
        assert (await client.get("/leader/second")).status == 503
        assert (await client.get("/leader/first")).status == 200
        assert (await client.get("/leader/nope")).status == 404
        clock.advance(10)  # validity over, nobody told the state: still 503
        assert (await client.get("/leader")).status == 503


async def test_blocking_query_returns_on_change():
    clock = FakeClock()
    app, states = make_app(clock)
    async with client_for(app) as client:
        first = await client.get("/leader")
        tag = first.headers["ETag"]
        loop = asyncio.get_running_loop()
        started = loop.time()
        pending = asyncio.ensure_future(
            client.get("/leader?wait=5", headers={"If-None-Match": tag}))
        await asyncio.sleep(0.1)
        assert not pending.done()
        lead(states[0], clock)
        response = await asyncio.wait_for(pending, 2)
        assert response.status == 200
        assert response.headers["ETag"] != tag
        assert loop.time() - started < 2
        # a stale tag answers at once
        quick = await asyncio.wait_for(
            client.get("/leader?wait=5", headers={"If-None-Match": tag}), 1)
        assert quick.status == 200
        # no change within the wait: answers after it with the same tag
        started = loop.time()
        same = await client.get("/leader?wait=0.2",
                                headers={"If-None-Match": response.headers["ETag"]})
        assert loop.time() - started >= 0.19
        assert same.headers["ETag"] == response.headers["ETag"]
        assert (await client.get("/leader?wait=abc")).status == 400
        assert (await client.get("/leader?wait=100000")).status == 400


async def test_renews_do_not_end_a_blocking_query():
    """The ETag follows leadership only: a parked query on an idle leader returns at its
    wait, with the same tag and a fresh valid_until, though the state changed meanwhile."""
    clock = FakeClock()
    app, states = make_app(clock)
    lead(states[0], clock)
    async with client_for(app) as client:
        first = await client.get("/leader")
        tag, before = first.headers["ETag"], (await first.json())["valid_until_ms"]
        assert tag.startswith('W/"first-')
        loop = asyncio.get_running_loop()

        async def renew() -> None:
            for _ in range(6):
                await asyncio.sleep(0.05)
                clock.advance(0.05)
                states[0].update(valid_until=clock.now + 10)

        for echoed in (tag, tag.removeprefix("W/")):  # weak comparison: either form parks
            renewing = asyncio.ensure_future(renew())
            started = loop.time()
            response = await client.get("/leader?wait=0.4", headers={"If-None-Match": echoed})
            waited = loop.time() - started
            await renewing
            assert waited >= 0.39, echoed
            assert response.status == 200 and response.headers["ETag"] == tag
            assert (await response.json())["valid_until_ms"] > before
        # A step-down wakes it at once.
        loop.call_later(0.1, lambda: states[0].update(released=True))
        started = loop.time()
        response = await client.get("/leader?wait=5", headers={"If-None-Match": tag})
        assert response.status == 503 and loop.time() - started < 1
        assert response.headers["ETag"] != tag


async def test_a_contender_that_can_never_lead_fails_healthz_and_readyz_not_livez():
    """/healthz is the chart's readiness: it must not call a sidecar without credentials
    healthy; /livez (liveness, startup) stays 200, since a restart brings none."""
    clock = FakeClock()
    states = [LeaseState(lease="first", identity="me", role="all", claim_horizon=0.25,
                         clock=clock)]
    reason: list[str | None] = ["cannot lead: kubernetes: no usable credentials"]
    app = build_app(states, status=lambda: {}, alive=lambda: True,
                    ready=lambda: True, release=lambda name: "not-holding",
                    cannot_lead=lambda: reason[0])
    async with client_for(app) as client:
        livez = await client.get("/livez")
        assert (livez.status, await livez.json()) == (200, {"ok": True})
        for path in ("/healthz", "/readyz"):
            response = await client.get(path)
            assert response.status == 503
            assert await response.json() == {"ok": False, "reason": reason[0]}
        reason[0] = None
        for path in ("/livez", "/healthz", "/readyz"):
            assert (await client.get(path)).status == 200


async def test_other_endpoints_and_errors():
    clock = FakeClock()
    released: list[str | None] = []
    app, states = make_app(clock, released)
    async with client_for(app) as client:
        assert (await client.get("/healthz")).status == 200
        assert (await client.get("/readyz")).status == 503
        lead(states[0], clock)
        assert (await client.get("/readyz")).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert 'lease_sidecar_leader{lease="first"} 1.0' in metrics
        assert 'lease_sidecar_leader{lease="second"} 0.0' in metrics
        assert (await client.get("/status")).status == 200
        missing = await client.get("/no/such/path")
        assert missing.status == 404
        assert "Traceback" not in await missing.text()
        assert (await client.post("/leader")).status == 405
        assert (await client.get("/release")).status == 405
        response = await client.post("/release")
        assert response.status == 202
        assert released == [None]
        assert (await client.post("/release/second")).status == 202
        assert (await client.post("/release/nope")).status == 404
        # Bound-related metrics are served too.
        metrics = await (await client.get("/metrics")).text()
        assert "lease_sidecar_http_waiters 0.0" in metrics
        assert 'lease_sidecar_http_refused_total{bound="connections"} 0.0' in metrics


def test_loopback_check():
    assert is_loopback("127.0.0.1")
    assert is_loopback("127.5.6.7")
    assert is_loopback("::1")
    assert not is_loopback("10.0.0.5")
    assert not is_loopback("192.168.1.2")
    assert not is_loopback("::ffff:10.0.0.5")
    assert not is_loopback(None)
    assert not is_loopback("garbage")


async def post_from_a_non_loopback_peer(app: App, path: str) -> Response:
    """Hand the app a ``POST path`` whose peer is 10.1.2.3: only loopback addresses exist
    here, so the request is made by hand (the server fills ``remote`` from the socket)."""
    host = f"127.0.0.1:{next(iter(app.limits.release_hosts), ('', 0))[1]}"
    return await app.handle(Request("POST", path, headers={"host": host}, remote="10.1.2.3"))


async def test_release_refused_from_a_non_loopback_peer():
    """No non-loopback address may be used here, so the peer address is faked."""
    clock = FakeClock()
    released: list[str | None] = []
    app, _ = make_app(clock, released)
    response = await post_from_a_non_loopback_peer(app, "/release")
    assert response.status == 403
    assert released == []


async def test_an_unexpected_error_is_a_bare_500():
    states = [LeaseState(lease="a", identity="me", role="all", claim_horizon=0.25,
                         clock=FakeClock())]

    def broken_status() -> dict:
        raise RuntimeError("secret internals")

    app = build_app(states, status=broken_status, alive=lambda: True,
                    ready=lambda: True, release=lambda name: True)
    async with client_for(app) as client:
        response = await client.get("/status")
        assert response.status == 500
        text = await response.text()
        assert "Traceback" not in text and "secret internals" not in text


# -- POST /release: who may ask, and only a holder can step down --------------------------

@pytest.mark.parametrize(("host", "allowed"), [
    ("127.0.0.1:8099", True), ("localhost:8099", True), ("LOCALHOST:8099", True),
    ("[::1]:8099", True), ("127.0.0.2:8099", True),
    ("127.0.0.1:8100", False), ("localhost", False), ("evil.example:8099", False),
    ("localhost.:8099", False), ("user@localhost:8099", False), ("localhost:8099/x", False),
    ("10.1.2.3:8099", False), ("[::1", False), ("localhost:99999", False), ("", False),
    (None, False),
])
def test_release_host_rule(host: str | None, allowed: bool) -> None:
    assert host_allowed(host, release_hosts("0.0.0.0", 8099)) is allowed


def test_release_host_rule_names_a_specific_bound_address() -> None:
    hosts = release_hosts("10.1.2.3", 8099)
    assert host_allowed("10.1.2.3:8099", hosts)
    assert host_allowed("localhost:8099", hosts)
    assert not host_allowed("10.1.2.4:8099", hosts)


async def test_release_refused_with_origin_or_foreign_host() -> None:
    """A web page (Origin) or a rebinding DNS name (Host) cannot make us step down."""
    released: list[str | None] = []
    app, _ = make_app(FakeClock(), released)
    async with client_for(app) as client:
        for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"},
                        {"Host": f"evil.example:{client.port}"},
                        {"Host": f"127.0.0.1:{client.port + 1}"}):
            response = await client.post("/release", headers=headers)
            assert response.status == 403, headers
            assert "error" in await response.json()
        # HTTP/1.0 without any Host header.
        answer = await client.raw(b"POST /release HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.0 403") or answer.startswith(b"HTTP/1.1 403")
        assert released == []
        for host in (f"localhost:{client.port}", f"127.0.0.1:{client.port}",
                     f"[::1]:{client.port}"):
            assert (await client.post("/release", headers={"Host": host})).status == 202
        assert released == [None, None, None]


async def test_release_on_a_standby_is_409() -> None:
    app, _ = make_app(FakeClock(), holding=False)
    async with client_for(app) as client:
        response = await client.post("/release")
        assert response.status == 409
        assert (await response.json())["released"] is False
        assert (await client.post("/release/nope")).status == 404


# -- bounds ---------------------------------------------------------------------------------

async def _parked(client: Client, tag: str) -> asyncio.Task[Any]:
    async def one() -> tuple[int, dict[str, str]]:
        async with client.get("/leader?wait=30", headers={"If-None-Match": tag}) as r:
            await r.read()
            return r.status, dict(r.headers)
    return asyncio.ensure_future(one())


async def test_waiter_cap_answers_at_once_with_the_true_state() -> None:
    clock = FakeClock()
    limits = Limits(max_waiters=2)
    app, states = make_app(clock, limits=limits)
    lead(states[0], clock)
    async with client_for(app) as client:
        tag = (await client.get("/leader")).headers["ETag"]
        parked = [await _parked(client, tag) for _ in range(2)]
        for _ in range(100):
            if limits.waiters == 2:
                break
            await asyncio.sleep(0.01)
        assert limits.waiters == 2
        started = time.monotonic()
        full = await client.get("/leader?wait=30", headers={"If-None-Match": tag})
        assert time.monotonic() - started < 1
        # The leader is told it leads (a true claim), not a made-up 503.
        assert full.status == 200 and (await full.json())["leader"] is True
        assert full.headers["Lease-Wait"] == "full" and full.headers["Retry-After"] == "1"
        # As a standby: the answer at once is the true "not leader".
        states[0].update(holding=False)
        done = await asyncio.wait_for(asyncio.gather(*parked), 2)
        assert [status for status, _ in done] == [503, 503]
        assert limits.waiters == 0
        tag = (await client.get("/leader")).headers["ETag"]
        parked = [await _parked(client, tag) for _ in range(2)]
        await asyncio.sleep(0.2)
        full = await client.get("/leader?wait=30", headers={"If-None-Match": tag})
        assert full.status == 503 and (await full.json())["leader"] is False
        assert full.headers["Lease-Wait"] == "full"
        assert limits.waits_refused == 2
        states[0].update(holder="someone-else")  # a change of the answer wakes them
        await asyncio.wait_for(asyncio.gather(*parked), 2)
        metrics = await (await client.get("/metrics")).text()
        assert 'lease_sidecar_http_refused_total{bound="waiters"} 2.0' in metrics


async def test_a_client_that_leaves_frees_its_waiter_slot_at_once() -> None:
    clock = FakeClock()
    limits = Limits(max_waiters=1)
    app, _ = make_app(clock, limits=limits)
    async with client_for(app) as client:
        tag = (await client.get("/leader")).headers["ETag"]
        _, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(f"GET /leader?wait=300 HTTP/1.1\r\nHost: x\r\nIf-None-Match: {tag}\r\n\r\n"
                     .encode())
        for _ in range(100):
            if limits.waiters == 1:
                break
            await asyncio.sleep(0.01)
        assert limits.waiters == 1
        writer.close()
        for _ in range(100):
            if limits.waiters == 0:
                break
            await asyncio.sleep(0.01)
        assert limits.waiters == 0


async def test_connection_cap_answers_503_with_retry_after() -> None:
    limits = Limits(max_connections=3)
    app, _ = make_app(FakeClock(), limits=limits)
    held = []
    async with client_for(app) as client:
        for _ in range(3):
            held.append(await asyncio.open_connection("127.0.0.1", client.port))
        await asyncio.sleep(0.1)
        for _ in range(2):
            answer = await client.raw(b"GET /leader HTTP/1.1\r\nHost: x\r\n\r\n")
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ")
            assert b"Retry-After: 1" in head and b"Connection: close" in head
            assert body == b'{"error": "too many connections"}'
        assert limits.refused_connections == 2
        for _, writer in held:
            writer.close()
        await asyncio.sleep(0.2)
        assert (await client.raw(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close"
                                 b"\r\n\r\n")).startswith(b"HTTP/1.1 200")


async def test_a_half_sent_request_is_closed_after_the_header_timeout() -> None:
    app, _ = make_app(FakeClock())
    async with client_for(app, header_timeout=0.5) as client:
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        started = time.monotonic()
        writer.write(b"GET /leader HTTP/1.1\r\nHost: x\r\n")
        closed = None
        for i in range(30):  # one more header line every 100 ms: never a full head
            try:
                if await asyncio.wait_for(reader.read(100), 0.1) == b"":
                    closed = time.monotonic() - started
                    break
            except TimeoutError:
                writer.write(f"X-{i}: y\r\n".encode())
        writer.close()
        assert closed is not None and 0.4 < closed < 1.2


@pytest.mark.parametrize("raw", [
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"GET /leader HTTP/1.1\r\nHost: x\r\n\r\nGET /x HTTP/1.1\r\nBad Header\r\n\r\n",
    b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nX: " + b"b" * 5000 + b"\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(40)) + b"\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",
], ids=["bad-header", "pipelined-bad", "long-line", "long-field", "many-headers", "tls"])
async def test_malformed_requests_are_a_400_and_one_debug_line(
        raw: bytes, caplog: pytest.LogCaptureFixture) -> None:
    app, _ = make_app(FakeClock())
    async with client_for(app) as client:
        with caplog.at_level(logging.DEBUG, logger="sidecar.http"):
            answer = await client.raw(raw)
        assert re.search(rb"HTTP/1\.[01] 400 ", answer), answer[:200]
        assert b"Traceback" not in answer
        records = [r for r in caplog.records if r.name == "sidecar.http"]
        assert records, "the malformed request should be logged at debug"
        assert all(r.levelno == logging.DEBUG and r.exc_info is None for r in records)
        assert all("\n" not in r.getMessage() for r in records)


# -- POST /heartbeat: the work watchdog's input -------------------------------------------

def beat_app(clock: FakeClock):
    from sidecar import watchdog

    states = [LeaseState(lease=n, identity="me", role="all", claim_horizon=0.25, clock=clock)
              for n in ("first", "second")]
    by_name = {s.lease: s for s in states}

    def heartbeat(name: str | None):
        state = by_name.get(name or "first")
        return watchdog.beat(state) if state else ("no-such-lease", {})

    app = build_app(states, status=lambda: {}, alive=lambda: True,
                    ready=lambda: True, release=lambda name: "not-holding",
                    heartbeat=heartbeat)
    return app, states


async def test_heartbeat_is_taken_from_a_leader_only() -> None:
    clock = FakeClock()
    app, states = beat_app(clock)
    async with client_for(app) as client:
        response = await client.post("/heartbeat")
        assert response.status == 409
        assert (await response.json())["ok"] is False
        assert states[0].work.last_beat is None
        lead(states[0], clock)
        response = await client.post("/heartbeat")
        assert response.status == 200
        body = await response.json()
        assert body["ok"] is True and body["lease"] == "first"
        assert body["at"].endswith("Z") and body["stall_after"] is None
        assert states[0].work.last_beat == clock.now
        assert (await client.post("/heartbeat/second")).status == 409
        assert (await client.post("/heartbeat/nope")).status == 404
        assert (await client.get("/heartbeat")).status == 405
        metrics = await (await client.get("/metrics")).text()
        found = re.search(r'^lease_sidecar_last_work_heartbeat_timestamp_seconds'
                          r'\{lease="first"\} (\S+)$', metrics, re.M)
        assert found and float(found.group(1)) == clock.wall()


async def test_heartbeat_follows_the_release_rules() -> None:
    """A web page must not keep a stalled leader leading: Origin and foreign Host are
    refused, as for POST /release."""
    clock = FakeClock()
    app, states = beat_app(clock)
    lead(states[0], clock)
    async with client_for(app) as client:
        for headers in ({"Origin": "http://evil.example"},
                        {"Host": f"evil.example:{client.port}"}):
            response = await client.post("/heartbeat", headers=headers)
            assert response.status == 403, headers
            assert "heartbeat" in (await response.json())["error"]
        assert states[0].work.last_beat is None
        assert (await client.post("/heartbeat",
                                  headers={"Host": f"localhost:{client.port}"})).status == 200


async def test_heartbeat_refused_from_a_non_loopback_peer() -> None:
    """No non-loopback address may be used here, so the peer address is faked."""
    clock = FakeClock()
    app, states = beat_app(clock)
    lead(states[0], clock)
    response = await post_from_a_non_loopback_peer(app, "/heartbeat")
    assert response.status == 403
    assert states[0].work.last_beat is None
