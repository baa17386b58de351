"""The HTTP contract, served by the real aiohttp app on a loopback port."""

import asyncio
from unittest import mock

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from sidecar.metrics import registry_for
from sidecar.publish.http import build_app, is_loopback
from sidecar.state import LeaseState
from tests.unit.fakes import FakeClock


def make_app(clock: FakeClock, released: list[str | None] | None = None):  # type: ignore[no-untyped-def]
    states = [LeaseState(lease=n, identity="me", role="all", claim_horizon=0.25, clock=clock)
              for n in ("first", "second")]

    def release(name: str | None) -> bool:
        if released is not None:
            released.append(name)
        return name in (None, "first", "second")

    app = build_app(states, registry_for(states), status=lambda: {"ok": True},
                    alive=lambda: True, ready=lambda: states[0].facts.backend_ok,
                    release=release)
    return app, states


async def client_for(app: web.Application) -> TestClient:
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client


def lead(state: LeaseState, clock: FakeClock) -> None:
    state.update(holding=True, claim_from=clock.now, valid_until=clock.now + 10,
                 fencing_token=42, backend_ok=True)


async def test_leader_and_standby_answers():
    clock = FakeClock()
    app, states = make_app(clock)
    client = await client_for(app)
    try:
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
    finally:
        await client.close()


async def test_blocking_query_returns_on_change():
    clock = FakeClock()
    app, states = make_app(clock)
    client = await client_for(app)
    try:
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
    finally:
        await client.close()


async def test_other_endpoints_and_errors():
    clock = FakeClock()
    released: list[str | None] = []
    app, states = make_app(clock, released)
    client = await client_for(app)
    try:
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
    finally:
        await client.close()


def test_loopback_check():
    assert is_loopback("127.0.0.1")
    assert is_loopback("127.5.6.7")
    assert is_loopback("::1")
    assert not is_loopback("10.0.0.5")
    assert not is_loopback("192.168.1.2")
    assert not is_loopback("::ffff:10.0.0.5")
    assert not is_loopback(None)
    assert not is_loopback("garbage")


async def test_release_refused_from_a_non_loopback_peer():
    """No non-loopback address may be used here, so the peer address is faked."""
    clock = FakeClock()
    released: list[str | None] = []
    app, _ = make_app(clock, released)
    handler = next(r.handler for r in app.router.routes()
                   if r.method == "POST" and r.resource.canonical == "/release")
    transport = mock.Mock()
    transport.get_extra_info.side_effect = (
        lambda key, default=None: ("10.1.2.3", 40000) if key == "peername" else default)
    request = make_mocked_request("POST", "/release", app=app, transport=transport)
    response = await handler(request)
    assert response.status == 403
    assert released == []


async def test_an_unexpected_error_is_a_bare_500():
    states = [LeaseState(lease="a", identity="me", role="all", claim_horizon=0.25,
                         clock=FakeClock())]

    def broken_status() -> dict:
        raise RuntimeError("secret internals")

    app = build_app(states, registry_for(states), status=broken_status, alive=lambda: True,
                    ready=lambda: True, release=lambda name: True)
    client = await client_for(app)
    try:
        response = await client.get("/status")
        assert response.status == 500
        text = await response.text()
        assert "Traceback" not in text and "secret internals" not in text
    finally:
        await client.close()
