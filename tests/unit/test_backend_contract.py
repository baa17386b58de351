"""The backend contract of sidecar/lease/__init__.py, run on two backends built by the
recipe of docs/adding-a-backend.md: the in-memory one (tests/unit/memory_backend.py) and
SQLite on a real file. Then three real electors share each and never lead together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar.base.clock import SystemClock
from sidecar.elector import Elector
from sidecar.lease import Backend, BackendEntry, backend_entry
from sidecar.settings import Settings, StoreSettings, Timing
from sidecar.state import LeaseState
from tests.unit import memory_backend

TIMING = Timing(lease_duration=1.0, renew_interval=0.05, safety_margin=0.2, claim_horizon=0.05)


@pytest.fixture(params=["memory", "sqlite"])
def make(request: pytest.FixtureRequest, tmp_path: Path
         ) -> Callable[[str], tuple[BackendEntry, Settings]]:
    memory_backend.SHARED.records.clear()

    def settings_for(identity: str) -> tuple[BackendEntry, Settings]:
        if request.param == "memory":
            entry = memory_backend.ENTRY
            store = StoreSettings(backend="memory")
        else:
            entry = backend_entry("sqlite")
            store = StoreSettings(backend="sqlite", dsn=str(tmp_path / "leases.db"))
        return entry, Settings(store=store, timing=TIMING, identity=identity, names=("jobs",))

    return settings_for


@pytest.fixture
async def backends() -> AsyncIterator[list[Backend]]:
    opened: list[Backend] = []
    yield opened
    for backend in opened:
        await backend.close()


async def test_one_holder_a_growing_token_and_a_release_that_frees(make, backends) -> None:
    clock = SystemClock()
    a_entry, a_settings = make("a")
    b_entry, b_settings = make("b")
    a = a_entry.create(a_settings, clock)
    b = b_entry.create(b_settings, clock)
    backends += [a, b]
    lease_a, lease_b = a.lease("jobs"), b.lease("jobs")
    assert lease_a.name == "jobs"
    assert lease_a.lost is None or isinstance(lease_a.lost, asyncio.Event)

    first = await lease_a.try_acquire()
    assert first.held and first.valid_for <= TIMING.validity
    refused = await lease_b.try_acquire()
    assert not refused.held and refused.holder == "a"
    assert (await lease_a.try_renew()).held
    assert (await lease_b.describe()).holder == "a"

    waiter = asyncio.create_task(lease_b.wait_for_change(5.0))
    await asyncio.sleep(0.01)  # b is waiting before a releases
    await lease_a.release()
    second = await lease_b.try_acquire()
    assert second.held and second.fencing_token > first.fencing_token
    assert not (await lease_a.try_renew()).held  # a's term is over
    await asyncio.wait_for(waiter, 5.0)


async def test_three_real_electors_never_lead_together(make, backends) -> None:
    clock = SystemClock()
    states: list[LeaseState] = []
    electors: list[Elector] = []
    for identity in ("a", "b", "c"):
        entry, settings = make(identity)
        backend = entry.create(settings, clock)
        backends.append(backend)
        state = LeaseState(lease="jobs", identity=identity, role="all",
                           claim_horizon=TIMING.claim_horizon, clock=clock)
        states.append(state)
        electors.append(Elector(backend.lease("jobs"), state, TIMING, identity))
    tasks = [asyncio.create_task(e.run()) for e in electors]
    leaders_seen: set[str] = set()
    try:
        for step in range(120):  # bounded: about 3 s
            leading = [s.identity for s in states if s.claim().leader]
            assert len(leading) <= 1, leading
            leaders_seen.update(leading)
            if step in (30, 70) and leading:
                electors[[s.identity for s in states].index(leading[0])].request_release()
            await asyncio.sleep(0.025)
    finally:
        for elector in electors:
            elector.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert len(leaders_seen) >= 2  # the lease moved on each release


def test_timing_refuses_a_horizon_that_cannot_reach_the_first_renew() -> None:
    with pytest.raises(ValueError, match="claim_horizon"):
        replace(TIMING, claim_horizon=0.9)
