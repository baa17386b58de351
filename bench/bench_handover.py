"""Deliberate hand-over (``POST /handover?to=``): the named standby leads how soon, and
never beside the old leader.

    flock /tmp/lease-bench.lock python bench/bench_handover.py [--dsn URL] [--trials 10]
        [--backends sqlite,postgres,postgres-row,kubernetes]

Without ``--dsn`` it starts a throw-away PostgreSQL from the test bed. Per backend three
real ``lease-sidecar run`` processes (2 s lease, 300 ms renew interval, 100 ms claim
horizon; kubernetes: a real kube-apiserver with the CoordinatedLeaderElection gate, 3 s
lease, 500 ms renew interval, 250 ms horizon). Per trial, with both standbys in the race
(the previous leader's sit-out is waited out), the leader is asked to hand over to one
of them picked at random, and the time from the request to the named standby's first
``200`` on ``GET /leader`` is taken (:mod:`testkit.handover`). A poller on every sidecar
(~10 ms) counts overlapping claims (must be 0) and gives the leaderless gap: from the
end of the old leader's last claim to the named standby's first. Target: the named
standby leads within two claim horizons + one round trip; the round trip is measured in
the same run (:func:`round_trips`: the backend's own acquire, 20 times, its p99 is the
bound's) and each backend's count of trials within the bound is printed. On the same
apiserver the kubernetes variant runs again with a client-go elector as the named
target (:func:`clientgo_trials`). Prints a table and writes
``bench/results/handover.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import record  # noqa: E402
from bench.failover import summary  # noqa: E402
from testkit.handover import BACKENDS, CLAIM_HORIZON, Run, run_trials  # noqa: E402

if TYPE_CHECKING:
    from testkit.testbed.kube import ControlPlane

# The kubernetes sidecars' claim horizon (their default with the 3 s lease of FAST).
KUBERNETES_HORIZON = 0.25


def kubernetes_trials(workdir: Path, trials: int
                      ) -> tuple[Run, ClientGoRun, list[float]]:
    """Three sidecars in Pod objects on a real apiserver whose CoordinatedLeaderElection
    gate is on (without it the apiserver drops ``spec.preferredHolder``); then, on the
    same apiserver, a client-go elector as the named target (:func:`clientgo_trials`)."""
    from testkit.kube_support import FAST, create_pods, install_rbac, mark_ready, sidecar
    from testkit.testbed.kube import ControlPlane

    cp = ControlPlane(apiserver_extra_args=[
        "--feature-gates=CoordinatedLeaderElection=true",
        "--runtime-config=coordination.k8s.io/v1beta1=true"])
    cp.start()
    try:
        namespace = cp.create_namespace()
        kubeconfig = install_rbac(cp, namespace)
        pods = ("pod-a", "pod-b", "pod-c")
        create_pods(cp, namespace, *pods)
        mark_ready(cp, namespace, *pods)  # a hand-over's target must be Ready
        procs = [sidecar(workdir, pod, namespace, kubeconfig) for pod in pods]
        duration = float(FAST[FAST.index("--lease-duration") + 1].rstrip("s"))
        run = run_trials("kubernetes", "", workdir, trials, cli_every=0, procs=procs,
                         lease="jobs", lease_duration=duration)
        trips = round_trips({"backend": "kubernetes", "identity": "round-trip"},
                            environ={"KUBECONFIG": str(cp.kubeconfig),
                                     "POD_NAMESPACE": namespace})
        go_dir = workdir / "clientgo"
        go_dir.mkdir()
        return run, clientgo_trials(cp, go_dir, trials, duration), trips
    finally:
        cp.stop()


def round_trips(flags: dict[str, str], samples: int = 20,
                environ: dict[str, str] | None = None) -> list[float]:
    """The "one round trip" of the bound, measured in the same run: the backend's own
    acquire of a free lease (what the named standby sends), through the sidecar's
    backend code on a warm connection, ``samples`` times on fresh names (each released
    after)."""
    import asyncio
    import os

    from sidecar.base.clock import SystemClock
    from sidecar.config import load
    from sidecar.lease import create_backend

    async def measure() -> list[float]:
        backend = create_backend(load(flags, env=environ or {}), SystemClock())
        seconds = []
        try:
            # Untimed first: connecting (and the apiserver client's import) is not a
            # round trip; the sidecars in the trials are long connected.
            warm = backend.lease("round-trip-warm-up")
            await warm.try_acquire()
            await warm.release()
            for i in range(samples):
                lease = backend.lease(f"round-trip-{i}")
                begun = time.perf_counter()
                grant = await lease.try_acquire()
                seconds.append(time.perf_counter() - begun)
                assert grant.held, f"round trip {i}: the free lease was not granted"
                await lease.release()
        finally:
            await backend.close()
        return seconds

    saved = dict(os.environ)
    os.environ.update(environ or {})  # the kubernetes client reads KUBECONFIG from here
    try:
        return asyncio.run(measure())
    finally:
        os.environ.clear()
        os.environ.update(saved)


def within_bound(run: Run, horizon: float, trip: dict[str, float]) -> int:
    """Trials whose named standby led within 2 claim horizons + one round trip (the
    round trip's p99 in this run)."""
    bound = 2 * horizon + trip["p99_ms"] / 1000
    return sum(1 for t in run.trials if t.seconds <= bound)


@dataclass
class ClientGoRun:
    # Per trial: request sent -> the client-go elector's OnStartedLeading.
    seconds: list[float] = field(default_factory=list)
    # Per trial: the sidecar's last claim running out -> OnStartedLeading.
    gaps: list[float] = field(default_factory=list)
    overlaps: int = 0
    claims: int = 0


def clientgo_trials(cp: ControlPlane, workdir: Path, trials: int,
                    lease_duration: float) -> ClientGoRun:
    """Two sidecars and one client-go elector (``leaderelection`` with ``LeaseLock``,
    100 ms retry period: it polls, it does not watch) on one Lease. Per trial a sidecar
    leads, the other sidecar and client-go are both in the race, and the leader hands
    over to client-go; the time from the request to client-go's ``OnStartedLeading`` is
    taken. Then client-go is stopped (it releases on cancel), a sidecar takes over, and a
    fresh client-go elector joins. Overlaps: a sidecar claim (polled every ~10 ms)
    running past client-go's start, or one seen before its stop."""
    from testkit.clientgo_support import GoElector
    from testkit.kube_support import create_pods, install_rbac, sidecar
    from testkit.support import ClaimRecorder, one_leader, post_json, wait_until
    from testkit.testbed import gobuild

    binary = gobuild.ensure_binary("clientgo-elector")
    namespace = cp.create_namespace()
    kubeconfig = install_rbac(cp, namespace, ("lease-sidecar.interop",))
    create_pods(cp, namespace, "pod-a", "pod-b")
    procs = [sidecar(workdir, pod, namespace, kubeconfig, "--pod-label", "off",
                     lease="interop") for pod in ("pod-a", "pod-b")]
    run = ClientGoRun()
    terms: list[tuple[float, float]] = []  # client-go's [started, stopped]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_http()
        with ClaimRecorder(procs) as recorder:
            for _ in range(trials):
                holder = wait_until(lambda: one_leader(procs, timeout=0.5), timeout=30)
                go = GoElector(binary, workdir, "go-1", namespace, kubeconfig).start()
                try:
                    # client-go is a standby, and the other sidecar campaigns again.
                    time.sleep(lease_duration + 0.5)
                    sent = time.time()
                    status = post_json(f"{holder.url}/handover/interop?to=go-1")[0]
                    assert status == 202, f"POST /handover answered {status}"
                    wait_until(go.leading, timeout=30, interval=0.002)
                    started = go.first("started")
                    assert started is not None
                    run.seconds.append(started["at"] - sent)
                    time.sleep(0.3)
                finally:
                    go.stop()
                claim = go.claim()
                assert claim is not None
                terms.append(claim)
                last = max((until for _, seen, until in recorder.claims
                            if seen < claim[0]), default=None)
                if last is not None:
                    run.gaps.append(max(0.0, claim[0] - last))
        run.claims = len(recorder.claims)
        run.overlaps = sum(1 for _, seen, until in recorder.claims
                           for start, stop in terms if seen < stop and until > start)
    finally:
        for proc in procs:
            proc.stop()
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    opts = parser.parse_args()
    backends = opts.backends.split(",")
    server = None
    dsn = opts.dsn
    if dsn is None and any(b.startswith("postgres") for b in backends):
        from testkit.testbed.postgres import PgServer

        server = PgServer().init()
        dsn = server.dsn
    meta = record.start(opts.trials)
    results: dict[str, object] = {
        "claim_horizon_ms": {"kubernetes": KUBERNETES_HORIZON * 1000,
                             "others": CLAIM_HORIZON * 1000},
        "target": "named standby leads within 2 claim horizons + 1 round trip; 0 overlaps"}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-handover-") as workdir:
            for backend in backends:
                here = Path(workdir) / backend
                here.mkdir()
                if backend == "kubernetes":
                    run, clientgo, trips = kubernetes_trials(here, opts.trials)
                    results["kubernetes-clientgo-target"] = {
                        **summary(clientgo.seconds),
                        "leaderless_gap": summary(clientgo.gaps) if clientgo.gaps else None,
                        "overlapping_claims": clientgo.overlaps,
                        "claims_seen": clientgo.claims,
                        "named_standby_led": len(clientgo.seconds)}
                    print(f"{'clientgo-target':13} request->named leads p50 "
                          f"{summary(clientgo.seconds)['p50_ms']:6.1f} p99 "
                          f"{summary(clientgo.seconds)['p99_ms']:6.1f} ms; "
                          f"overlaps {clientgo.overlaps}", flush=True)
                else:
                    where = str(here / "leases.db") if backend == "sqlite" else dsn
                    assert where is not None
                    run = run_trials(backend, where, here, opts.trials, cli_every=0)
                    trips = round_trips({"backend": backend, "dsn": where,
                                         "identity": "round-trip", "ensure_schema": "true"
                                         if backend == "postgres-row" else "false"})
                horizon = KUBERNETES_HORIZON if backend == "kubernetes" else CLAIM_HORIZON
                trip = summary(trips)
                inside = within_bound(run, horizon, trip)
                times = [t.seconds for t in run.trials]
                gaps = [t.gap for t in run.trials if t.gap is not None]
                results[backend] = {
                    **summary(times),
                    "leaderless_gap": summary(gaps) if gaps else None,
                    "overlapping_claims": run.overlaps,
                    "claims_seen": run.claims,
                    "named_standby_led": len(run.trials),
                    "round_trip": trip,
                    "within_bound": inside,
                    "timeline": [t.timeline for t in run.trials]}
                gap = summary(gaps) if gaps else {"p50_ms": float("nan"),
                                                  "p99_ms": float("nan")}
                print(f"{backend:13} request->named leads p50 {summary(times)['p50_ms']:6.1f} "
                      f"p99 {summary(times)['p99_ms']:6.1f} ms; leaderless gap p50 "
                      f"{gap['p50_ms']:6.1f} p99 {gap['p99_ms']:6.1f} ms; "
                      f"overlaps {run.overlaps}; round trip p50 {trip['p50_ms']:5.1f} p99 "
                      f"{trip['p99_ms']:5.1f} ms; within 2 horizons + 1 round trip "
                      f"{inside}/{len(run.trials)}", flush=True)
    finally:
        if server is not None:
            server.destroy()
    print(json.dumps(results, indent=2))
    record.write("handover.json", meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
