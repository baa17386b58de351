"""The CI chaos run: about two minutes per backend of seeded faults on five real sidecars.

Real processes, real signals, a real SQLite file and (when the test beds are there) a real
PostgreSQL restarted with ``pg_ctl -m immediate`` and a real kube-apiserver killed with
SIGKILL and started again on the same port and etcd; network faults go through the
harness's own TCP proxy on 127.0.0.1. Asserts what ``python -m bench.chaos`` judges:
no two sidecars' claims overlap, every leaderless gap is explained by a fault and within
that fault's bound, fencing tokens only grow — and that the run really injected faults
and really took over (a harness that injected nothing would pass vacuously).

``CHAOS_SECONDS`` shortens or lengthens the run (default 110 s of injection).
"""

from __future__ import annotations

import os

import pytest

from testkit.chaos.backends import ChaosTiming, make_env
from testkit.chaos.harness import Config, Harness, Result
from testkit.chaos.report import markdown, summarize

# The advisory lock's documented overlap is the termination notice's latency, which a
# starved machine stretches past ADVISORY_NOTICE_BOUND: run after the background builds.
pytestmark = [pytest.mark.slow, pytest.mark.quiet]

SECONDS = float(os.environ.get("CHAOS_SECONDS", "110"))


async def _run(backend: str, seed: int, tmp_path, server=None,
               control_plane=None) -> Result:
    timing = ChaosTiming.for_backend(backend)
    env = make_env(backend, timing, server, control_plane)
    config = Config(backend=backend, seed=seed, duration=SECONDS, faults=env.faults,
                    timing=timing, workdir=tmp_path)
    result = await Harness(config, env).run()
    print(markdown(summarize(result, f"tests/chaos (seed {seed}, {SECONDS:g} s)")))
    return result


def _assert_sound(result: Result) -> None:
    verdict = result.verdict
    assert verdict.violations == [], "\n".join(verdict.violations[:20])
    # Overlaps only where the backend documents a window for that fault, and within it.
    by_index = {fault.index: fault for fault in result.faults}
    for overlap in verdict.overlaps:
        fault = by_index.get(overlap.fault)
        assert fault is not None and overlap.length <= fault.overlap_bound, overlap
    # It did something: faults went in, at least one of them hit a leader and a standby
    # took over (not the same sidecar keeping the lease throughout).
    assert len(result.faults) >= SECONDS / 10
    assert sum(len(row.takeovers) for row in verdict.rows.values()) >= 1
    leaders = {span.identity for span in result.recorder.spans}
    assert len(leaders) >= 2


async def test_chaos_sqlite(tmp_path) -> None:
    _assert_sound(await _run("sqlite", seed=11, tmp_path=tmp_path))


@pytest.mark.postgres
@pytest.mark.parametrize("backend", ["postgres", "postgres-row"])
async def test_chaos_postgres(backend: str, pg, tmp_path) -> None:
    """Restarts the session's shared test-bed server (immediate mode); it is up again
    when the test ends."""
    _assert_sound(await _run(backend, seed=12, tmp_path=tmp_path, server=pg))


@pytest.mark.kube
async def test_chaos_kubernetes(control_plane, tmp_path) -> None:
    """Restarts the session's shared kube-apiserver (SIGKILL, same port and etcd); it is
    up again when the test ends. Runs in its own namespace."""
    _assert_sound(await _run("kubernetes", seed=13, tmp_path=tmp_path,
                             control_plane=control_plane))
