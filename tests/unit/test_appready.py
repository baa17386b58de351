"""LEASE_APP_READY_URL against a real HTTP server on loopback: who may campaign, when a
leader hands over, and the time led while not ready."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from sidecar.appready import AppReadiness
from sidecar.state import LeaseState
from tests.unit.fakes import FakeClock
from tests.unit.loopback import serve_on_loopback


async def serve(status: list[int]) -> tuple[web.AppRunner, str]:
    async def ready(request: web.Request) -> web.Response:
        return web.Response(status=status[0])

    app = web.Application()
    app.router.add_get("/ready", ready)
    runner, url = await serve_on_loopback(app)
    return runner, f"{url}/ready"


async def test_campaign_only_while_ready_and_hand_over_after_the_period():
    status = [503]
    runner, url = await serve(status)
    clock = FakeClock()
    state = LeaseState(lease="jobs", identity="web-0", role="all", claim_horizon=0.1,
                       clock=clock)
    asked: list[str] = []
    watcher = AppReadiness(url, unready_after=5.0, period=0.01, states=[state],
                           hand_over=lambda name: asked.append(name) or True)
    try:
        async with aiohttp.ClientSession() as session:
            watcher._observe(await watcher._probe(session))
            assert watcher.why_not() == f"not campaigning: the application is not ready: " \
                                        f"{url} answered 503"
            status[0] = 204
            watcher._observe(await watcher._probe(session))
            assert watcher.why_not() is None
            # Leading, then the application goes unready: nothing before the period...
            state.update(holding=True)
            status[0] = 500
            clock.advance(1.0)
            watcher._observe(await watcher._probe(session))
            clock.advance(4.0)
            watcher._observe(await watcher._probe(session))
            assert asked == []
            # ... a hand-over once it has passed.
            clock.advance(1.5)
            watcher._observe(await watcher._probe(session))
            assert asked == ["jobs"]
            assert state.unready_leading_seconds == 5.5
    finally:
        await runner.cleanup()


async def test_an_unreachable_url_is_not_ready():
    runner, url = await serve([200])
    await runner.cleanup()  # nothing listens there now
    state = LeaseState(lease="jobs", identity="web-0", role="all", claim_horizon=0.1)
    watcher = AppReadiness(url, 1.0, 0.01, [state], hand_over=lambda name: True)
    task = asyncio.create_task(watcher.run())
    await asyncio.sleep(0.2)
    task.cancel()
    assert watcher.why_not() is not None and "unreachable" in watcher.why_not()


def test_an_unready_leader_is_looked_at_when_its_period_ends_not_a_renew_interval_later():
    clock = FakeClock()
    state = LeaseState(lease="jobs", identity="web-0", role="all", claim_horizon=0.1,
                       clock=clock)
    asked: list[str] = []
    watcher = AppReadiness("pod web-0", unready_after=3.0, period=2.0, states=[state],
                           hand_over=lambda name: asked.append(name) or True)
    watcher._observe(None)
    assert watcher.next_look() == 2.0  # ready: every period
    state.update(holding=True)
    watcher._observe("container app is not Ready")
    clock.advance(2.0)
    assert watcher.next_look() == 1.0  # the period would end past LEASE_APP_UNREADY_AFTER
    clock.advance(watcher.next_look())
    watcher._observe("container app is not Ready")
    assert asked == ["jobs"]
    assert watcher.next_look() == 2.0  # asked: back to every period


async def test_a_leader_whose_app_turns_unready_between_looks_hands_over_on_time():
    """The look scheduled while the app was ready is a period away; the pod event that
    says "not Ready" re-arms it, so the hand-over comes at LEASE_APP_UNREADY_AFTER, not up
    to a period later (seen in real pods: 4.8 s for a 2 s setting and a 2 s period)."""
    state = LeaseState(lease="jobs", identity="web-0", role="all", claim_horizon=0.1)
    asked: list[float] = []
    loop = asyncio.get_running_loop()
    watcher = AppReadiness("pod web-0", unready_after=0.2, period=5.0, states=[state],
                           hand_over=lambda name: asked.append(loop.time()) or True)
    watcher._observe(None)
    state.update(holding=True)
    ticker = asyncio.create_task(watcher._tick())
    try:
        await asyncio.sleep(0.05)  # the ticker sleeps toward a look a period away
        turned = loop.time()
        watcher._problem = "container app is not Ready"
        watcher._observe(watcher._problem)  # what the pod watch does on the event
        await asyncio.sleep(1.0)
    finally:
        ticker.cancel()
    assert asked, "the leader never handed over"
    assert 0.2 <= asked[0] - turned < 0.6, asked[0] - turned


class DownWatch:
    """A pod watch that is down (what sidecar.kubewatch.Follower reports)."""

    def __init__(self, down_for: float) -> None:
        self.up, self.error, self._down_for = False, "get pods t/web-0: refused", down_for

    def down_for(self) -> float:
        return self._down_for


def test_while_the_pod_cannot_be_watched_its_last_readiness_counts_for_the_grace():
    state = LeaseState(lease="jobs", identity="web-0", role="all", claim_horizon=0.1)
    watcher = AppReadiness("pod web-0:", unready_after=1.0, period=1.0, states=[state],
                           hand_over=lambda name: True, outage_grace=60.0)
    watcher._problem = None  # the pod said: Ready
    watcher._follower = DownWatch(59.0)  # type: ignore[assignment]  # a stand-in
    assert watcher.pod_view() is None
    watcher._follower = DownWatch(60.0)  # type: ignore[assignment]  # a stand-in
    assert watcher.pod_view() == ("cannot watch the own pod for 1m "
                                  "(get pods t/web-0: refused)")
    watcher._problem = "container app is not Ready"  # and a not-Ready pod stays not Ready
    watcher._follower = DownWatch(1.0)  # type: ignore[assignment]  # a stand-in
    assert watcher.pod_view() == "container app is not Ready"
