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
from testkit.chaos.backends import Timing, make_env
from testkit.chaos.failover import gaps, token_problems
from testkit.chaos.harness import Config, Harness
from testkit.chaos.recorder import Recorder

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.mark.parametrize("style", ["multi-host", "proxy"])
@pytest.mark.parametrize("backend", ["postgres", "postgres-row"])
async def test_failover_during_lag_never_gives_two_leaders_or_an_old_token(
        backend: str, style: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    timing = Timing.for_backend(backend)
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
    assert own_tracebacks("".join(m.process.logs() for m in result.members)) == []


def own_tracebacks(logs: str) -> list[str]:
    """Log lines of the sidecar's own loggers that carry a traceback (library loggers'
    tracebacks are the logging tests' business)."""
    return [line for line in logs.splitlines()
            if "Traceback" in line and '"logger": "sidecar' in line]


async def until_leader(recorder: Recorder, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while recorder.leader_now() is None:
        assert time.monotonic() < deadline, "no leader"
        await asyncio.sleep(0.02)
