"""PostgreSQL failover and restarts with real servers and three real sidecar processes.

A real primary with a real asynchronous streaming standby (``pg_basebackup -R``); the
standby's WAL receiver is stopped (lag), the lease changes hands during the lag
(``POST /release``), then the primary is killed (``-m immediate``) and the standby
promoted (``pg_ctl promote``). Sidecars reach the servers through a multi-host DSN
(``target_session_attrs=read-write``) or through TCP proxies that silence the old
primary's open connections for good. The chaos recorder polls every sidecar's
``GET /leader`` and leader file and judges overlapping published claims; the tokens of
the terms must be distinct and each larger than every earlier one.

The ten-failover runs per backend and style are ``python -m bench.bench_pg_failover``.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from sidecar.lease.pg_timeline import timeline_of
from testkit.chaos.backends import ChaosTiming, make_env
from testkit.chaos.failover import gaps, token_problems
from testkit.chaos.harness import Config, Harness
from testkit.chaos.recorder import Recorder, Target
from testkit.support import SidecarProcess
from testkit.testbed.postgres import PgServer
from tests.integration.advisory_support import DEADLINE, FAST

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.mark.parametrize("style", ["multi-host", "proxy"])
@pytest.mark.parametrize("backend", ["postgres", "postgres-row"])
async def test_failover_during_lag_never_gives_two_leaders_or_an_old_token(
        backend: str, style: str, tmp_path) -> None:
    timing = ChaosTiming.for_backend(backend)
    env = make_env(backend, timing, style=style)
    config = Config(backend=backend, seed=18, duration=300.0, faults=("failover",),
                    sidecars=3, max_faults=2, timing=timing, workdir=tmp_path)
    result = await Harness(config, env).run()
    spans = result.recorder.spans
    assert result.verdict.overlaps == [], result.verdict.overlaps
    assert result.verdict.violations == [], result.verdict.violations
    assert token_problems(spans) == []
    # It really failed over twice, each time after terms the standby never received,
    # and leaders held on every timeline.
    assert [f.params["timeline"] for f in result.faults] == [2, 3]
    assert all(f.params["handed_over"] >= 1 for f in result.faults)
    assert {timeline_of(int(s.token)) for s in spans if s.token} == {1, 2, 3}
    assert len(gaps(result)) == 2
    assert tracebacks("".join(m.process.logs() for m in result.members)) == []


async def test_server_restarts_cost_one_token_each_and_no_term(
        tmp_path) -> None:
    """Advisory lock, fast and immediate restarts: the first holder after a restart waits
    out ``renew_deadline - uptime`` heartbeating, so its term survives: one new token per
    restart at most, and no term ends because its validity ran out."""
    server = await asyncio.to_thread(lambda: PgServer().init())
    procs = []
    try:
        procs = [SidecarProcess(tmp_path, f"restart-{i}", args=["--name", "jobs", *FAST],
                                env={"LEASE_BACKEND": "postgres",
                                     "LEASE_DSN": server.dsn}).start() for i in range(3)]
        for proc in procs:
            await asyncio.to_thread(proc.wait_http)
        recorder = Recorder([Target(p.identity, p.url, p.state_dir / "leader")
                             for p in procs], claim_horizon=0.25)
        await recorder.start()
        try:
            await until_leader(recorder)
            new_tokens = []
            for mode in ("fast", "immediate", "fast", "immediate"):
                before = {s.token for s in recorder.spans}
                await asyncio.to_thread(server.stop, mode)
                await asyncio.to_thread(server.start)
                await until_leader(recorder)
                await asyncio.sleep(DEADLINE + 1.5)  # a wasted term would show by now
                new_tokens.append({s.token for s in recorder.spans} - before)
        finally:
            await recorder.stop()
        assert all(len(tokens) <= 1 for tokens in new_tokens), new_tokens
        assert token_problems(recorder.spans) == []
        logs = "".join(p.logs() for p in procs)
        assert "validity ran out" not in logs
        assert tracebacks(logs) == []
    finally:
        for proc in procs:
            proc.stop()
        await asyncio.to_thread(server.destroy)


def tracebacks(logs: str) -> list[str]:
    """Log lines that carry a traceback: failing over is normal failure handling, which
    logs one line per cause, from any logger (asyncpg's included)."""
    return [line[:300] for line in logs.splitlines() if "Traceback" in line]


async def until_leader(recorder: Recorder, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while recorder.leader_now() is None:
        assert time.monotonic() < deadline, "no leader"
        await asyncio.sleep(0.02)
