"""The ``kubernetes`` backend versus the kubernetes client's own leader election, side by
side against one real kube-apiserver; prints a table and writes results/kubernetes.json.

    flock /tmp/lease-bench.lock python -m bench.bench_kubernetes [--trials 20]

Three contenders per side, 3 s leases, 1 s renew/retry period (the anchor's minimum), all
as the ServiceAccount of deploy/rbac.yaml. Per trial the holder is signalled and replaced
by a fresh process (same pod, as after a container restart):

- **sidecar**: ``lease-sidecar run --backend kubernetes`` with the pod label on;
- **anchor**: ``kubernetes.leaderelection`` with a ``LeaseLock`` (the Python client's
  port of client-go's election; it has no release-on-cancel, so on SIGTERM a standby
  waits a full lease, exactly as after SIGKILL — that is expected, not a fault).

Figures (every process runs on this host, so all share one wall clock):

- takeover (SIGKILL) / handover (SIGTERM): signal → the new holder's ``acquireTime`` in
  the Lease (written by the new holder just before its winning update, on both sides);
- published claim: signal → the new holder's first ``GET /leader`` 200 (polled);
- label lag: that ``acquireTime`` → an admin watch sees the new holder's pod with
  ``lease-role=leader`` (includes the one claim horizon a new term waits before it
  publishes, and the watch's delivery to this process);
- stale label demotion (SIGKILL): that ``acquireTime`` → the killed pod shows ``standby``;
- unpublish (SIGTERM): signal → the old holder's pod shows ``standby`` (it must come
  before the release, by resourceVersion order; violations are counted and must be 0).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import record
from bench.failover import summary
from testkit.kube_support import (
    Event,
    Recorder,
    create_pods,
    install_rbac,
    sidecar,
)
from testkit.support import REPO, SidecarProcess, get_json, wait_until
from testkit.testbed.kube import ControlPlane

# The anchor refuses a retry period under 1 s; both sides use 1 s for a fair comparison.
LEASE, RENEW_DEADLINE, RETRY = 3, 2.0, 1.0
SIDECAR_LEASE = "bench"  # Lease object lease-sidecar.bench
ANCHOR_LEASE = "anchor-bench"


# -- the anchor: kubernetes.leaderelection in a child process ----------------------------
def anchor_child(namespace: str, identity: str) -> None:
    from kubernetes import config
    from kubernetes.leaderelection import electionconfig, leaderelection
    from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

    config.load_kube_config()
    lock = LeaseLock(ANCHOR_LEASE, namespace, identity)
    election = electionconfig.Config(
        lock, lease_duration=LEASE, renew_deadline=RENEW_DEADLINE, retry_period=RETRY,
        onstarted_leading=threading.Event().wait,  # lead until killed
        onstopped_leading=lambda: os._exit(1))
    leaderelection.LeaderElection(election).run()


class Anchor:
    def __init__(self, namespace: str, identity: str, kubeconfig: Path, workdir: Path) -> None:
        self.identity = identity
        self._cmd = [sys.executable, "-m", "bench.bench_kubernetes", "--anchor-child",
                     namespace, identity]
        self._env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        self._log = workdir / f"{identity}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Anchor:
        with open(self._log, "ab") as log:
            self.proc = subprocess.Popen(self._cmd, env=self._env, cwd=REPO, stdout=log,
                                         stderr=log)
        return self

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


# -- trials -------------------------------------------------------------------------------
def lease_holder(recorder: Recorder, name: str) -> str | None:
    events = [e for e in recorder.snapshot() if e.kind == "lease" and e.name == name]
    return max(events, key=lambda e: e.version).holder if events else None


def new_holder(recorder: Recorder, name: str, after: float, old: str, timeout: float) -> Event:
    return recorder.first(after, timeout, lambda e: e.kind == "lease" and e.name == name
                          and e.holder not in ("", old))


def sidecar_trials(sig: signal.Signals, trials: int, cp: ControlPlane, ns: str,
                   kubeconfig: Path, recorder: Recorder, workdir: Path) -> dict[str, list]:
    pods = [f"sc-{sig.name.lower()}-{i}" for i in range(3)]
    create_pods(cp, ns, *pods)
    args = ["--renew-interval", f"{RETRY}s", "--pod-label", "on"]
    procs = [sidecar(workdir, pod, ns, kubeconfig, *args, lease=SIDECAR_LEASE).start()
             for pod in pods]
    out: dict[str, list] = {"lease": [], "claim": [], "label": [], "demote": [],
                            "unpublish": [], "order_violations": [0]}
    obj = f"lease-sidecar.{SIDECAR_LEASE}"
    try:
        for proc in procs:
            proc.wait_http()
        for _ in range(trials):
            leader = wait_until(lambda: single_sidecar_leader(procs), timeout=30)
            others = [p for p in procs if p is not leader]
            wait_until(lambda rest=others, who=leader.identity: all(
                get_json(p.url + "/leader")[1].get("holder") == who for p in rest), timeout=30)
            # A random phase against the 1 s renew cycle: a fixed restart-to-kill delay
            # would hit the same point of the cycle every trial and skew the takeover.
            time.sleep(0.3 + random.uniform(0, RETRY))
            t0, wall0 = time.monotonic(), time.time()
            leader.signal(sig)
            successor = wait_until(lambda rest=others: single_sidecar_leader(rest),
                                   timeout=30, interval=0.001)
            out["claim"].append(time.monotonic() - t0)
            taken = new_holder(recorder, obj, t0, leader.identity, 10)
            assert taken.acquired is not None
            out["lease"].append(taken.acquired - wall0)
            label = recorder.first(t0, 10, lambda e, who=successor.identity: e.kind == "pod"
                                   and e.name == who and e.role == "leader")
            out["label"].append(label.wall - taken.acquired)
            old_standby = recorder.first(t0, 10, lambda e, who=leader.identity:
                                         e.kind == "pod" and e.name == who
                                         and e.role == "standby")
            if sig == signal.SIGKILL:
                out["demote"].append(old_standby.wall - taken.acquired)
            else:
                out["unpublish"].append(old_standby.wall - wall0)
                released = recorder.first(t0, 10, lambda e: e.kind == "lease"
                                          and e.name == obj and e.holder == "")
                if not old_standby.version < released.version < taken.version:
                    out["order_violations"][0] += 1
            leader.stop()
            index = procs.index(leader)
            procs[index] = sidecar(workdir, leader.identity, ns, kubeconfig, *args,
                                   lease=SIDECAR_LEASE).start()
            procs[index].wait_http()
    finally:
        for proc in procs:
            proc.stop()
    return out


def single_sidecar_leader(procs: list[SidecarProcess]) -> SidecarProcess | None:
    found = [p for p in procs if p.proc and p.proc.poll() is None
             and p.leader(timeout=0.5) == 200]
    return found[0] if len(found) == 1 else None


def anchor_trials(sig: signal.Signals, trials: int, ns: str, kubeconfig: Path,
                  recorder: Recorder, workdir: Path) -> list[float]:
    names = [f"anchor-{sig.name.lower()}-{i}" for i in range(3)]
    procs = {name: Anchor(ns, name, kubeconfig, workdir).start() for name in names}
    times: list[float] = []
    try:
        # The previous series' holder is dead: wait until one of ours took over.
        holder = wait_until(lambda: (found := lease_holder(recorder, ANCHOR_LEASE)) in procs
                            and found, timeout=30)
        for trial in range(trials):
            # The fresh standby has started and polled the Lease; then a random phase.
            time.sleep(1.5 + random.uniform(0, RETRY))
            t0, wall0 = time.monotonic(), time.time()
            procs[holder].signal(sig)
            taken = new_holder(recorder, ANCHOR_LEASE, t0, holder, 30)
            assert taken.acquired is not None
            times.append(taken.acquired - wall0)
            procs[holder].stop()
            procs[holder] = Anchor(ns, holder, kubeconfig, workdir).start()
            assert taken.holder is not None
            holder = taken.holder
            print(f"  anchor {sig.name} trial {trial + 1}: {times[-1] * 1000:.0f} ms",
                  file=sys.stderr)
    finally:
        for proc in procs.values():
            proc.stop()
    return times


# -- report ---------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--anchor-child", nargs=2, metavar=("NAMESPACE", "IDENTITY"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.anchor_child:
        anchor_child(*args.anchor_child)
        return
    run = record.start(args.trials)
    with tempfile.TemporaryDirectory(prefix="bench-kube-") as tmp, ControlPlane() as cp:
        workdir = Path(tmp)
        ns = cp.create_namespace("bench")
        kubeconfig = install_rbac(cp, ns, (f"lease-sidecar.{SIDECAR_LEASE}", ANCHOR_LEASE))
        recorder = Recorder(cp.kubeconfig, ns).start()
        try:
            time.sleep(0.5)
            figures = {}
            for sig in (signal.SIGKILL, signal.SIGTERM):
                print(f"sidecar {sig.name} ...", file=sys.stderr)
                figures[f"sidecar_{sig.name}"] = sidecar_trials(
                    sig, args.trials, cp, ns, kubeconfig, recorder, workdir)
                print(f"anchor {sig.name} ...", file=sys.stderr)
                figures[f"anchor_{sig.name}"] = anchor_trials(
                    sig, args.trials, ns, kubeconfig, recorder, workdir)
        finally:
            recorder.stop()
        version = cp.version
    kill, term = figures["sidecar_SIGKILL"], figures["sidecar_SIGTERM"]
    rows = {
        "sigkill_takeover_sidecar": summary(kill["lease"]),
        "sigkill_takeover_anchor": summary(figures["anchor_SIGKILL"]),
        "sigkill_published_claim_sidecar": summary(kill["claim"]),
        "sigterm_handover_sidecar": summary(term["lease"]),
        "sigterm_handover_anchor": summary(figures["anchor_SIGTERM"]),
        "sigterm_published_claim_sidecar": summary(term["claim"]),
        "label_lag_sidecar": summary(kill["label"] + term["label"]),
        "stale_label_demotion_sidecar": summary(kill["demote"]),
        "unpublish_after_sigterm_sidecar": summary(term["unpublish"]),
    }
    result = {
        "backend": "kubernetes", "kubernetes": version,
        "lease_duration_s": LEASE, "renew_interval_s": RETRY, "claim_horizon_s": 0.25,
        **rows,
        "unpublish_before_release_violations": term["order_violations"][0],
        "targets": {
            "sigterm_handover_sidecar": verdict(rows["sigterm_handover_sidecar"], 250),
            "label_lag_sidecar": verdict(rows["label_lag_sidecar"], 1000),
            "stale_label_demotion_sidecar": verdict(rows["stale_label_demotion_sidecar"],
                                                    1000),
        },
    }
    path = record.write("kubernetes.json", run, result)
    print(f"kube-apiserver {version}, {args.trials} trials per row, lease {LEASE}s, "
          f"renew/retry {RETRY}s, {run['cores']} cores, load average "
          f"{run['loadavg_at_start']}")
    print(f"{'figure':<34}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}  target")
    for key, row in rows.items():
        print(f"{key:<34}{row['p50_ms']:>9}{row['p99_ms']:>9}{row['max_ms']:>9}  "
              f"{result['targets'].get(key, '')}")
    print(f"unpublish-before-release violations: "
          f"{result['unpublish_before_release_violations']}")
    print(f"wrote {path}")


def verdict(row: dict[str, float], p99: float) -> str:
    return f"{'meets' if row['p99_ms'] <= p99 else 'MISSES'} p99 <= {p99:g} ms"


if __name__ == "__main__":
    main()
