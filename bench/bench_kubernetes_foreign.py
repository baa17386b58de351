"""The ``kubernetes`` backend under writes that are not a sidecar's: hand edits, deletion,
``preferredHolder``, and a newcomer's first wait; prints a table and writes
results/kubernetes-foreign.json.

    flock /tmp/lease-bench.lock python -m bench.bench_kubernetes_foreign [--trials 10]

One kube-apiserver with the ``CoordinatedLeaderElection`` gate (so it stores
``spec.preferredHolder``), three sidecars (3 s lease, 500 ms renew, 1 s margin, 250 ms
horizon) as the ServiceAccount of deploy/rbac.yaml, every ``/leader`` polled every
~10-20 ms (``testkit.kube_edits``). Figures, on one wall clock:

- per hand edit (holder cleared, holder → standby, duration 1 s, Lease deleted with a
  newcomer started at once): overlapping claims (must be 0), token regressions (must be
  0), the holder's step-down time (the write → its last claim), and the next leader's
  first claim after the write;
- preferredHolder hand-off: the patch → the preferred standby's first claim;
- newcomer wait (first-install cost): one sidecar started with no Lease object → its
  first claim, against one started on a released Lease.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench import record
from testkit.kube_edits import EDITS, Trial, patch, run_trial
from testkit.kube_support import create_pods, install_rbac, leaders, sidecar
from testkit.support import ClaimRecorder, SidecarProcess, wait_until
from testkit.testbed.kube import COORDINATED_LEADER_ELECTION, ControlPlane

PODS = ("pod-a", "pod-b", "pod-c")


def ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(ordered), "p50_ms": round(statistics.median(ordered) * 1000, 1),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 1),
            "max_ms": round(ordered[-1] * 1000, 1)}


class Trio:
    """Three sidecars in one namespace, started and stopped together."""

    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        self.cp = cp
        self.namespace = cp.create_namespace("bench")
        self.kubeconfig = install_rbac(cp, self.namespace)
        create_pods(cp, self.namespace, *PODS, "pod-new")
        self.workdir = workdir / self.namespace
        self.workdir.mkdir()
        self.procs = [sidecar(self.workdir, pod, self.namespace, self.kubeconfig)
                      for pod in PODS]

    def __enter__(self) -> Trio:
        for proc in self.procs:
            proc.start()
        for proc in self.procs:
            proc.wait_http()
        wait_until(lambda: leaders(self.procs), timeout=20)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.stop()


def edits(cp: ControlPlane, workdir: Path, trials: int) -> dict[str, list[Trial]]:
    found: dict[str, list[Trial]] = {}
    with Trio(cp, workdir) as trio:
        for edit in EDITS:
            found[edit] = []
            for index in range(trials):
                newcomer: SidecarProcess | None = None
                if edit == "deleted":
                    newcomer = sidecar(trio.workdir, f"pod-new{index}", trio.namespace,
                                       trio.kubeconfig, "--pod-label", "off")
                try:
                    found[edit].append(run_trial(
                        cp, trio.namespace, trio.procs, edit,
                        after_edit=newcomer.start if newcomer else None))
                finally:
                    if newcomer is not None:
                        newcomer.stop()
                print(f"  {edit} {index + 1}/{trials}: {found[edit][-1]}", flush=True)
    return found


def preferred_handoffs(cp: ControlPlane, workdir: Path, trials: int) -> tuple[list[float], int]:
    took, overlaps = [], 0
    with Trio(cp, workdir) as trio:
        for _ in range(trials):
            holder = wait_until(lambda: (f := leaders(trio.procs)) and len(f) == 1 and f[0],
                                timeout=20)
            target = next(p for p in trio.procs if p is not holder)
            with ClaimRecorder(trio.procs) as recorder:
                time.sleep(0.3)
                sent = time.time()
                # The apiserver takes preferredHolder only with a strategy.
                patch(cp, trio.namespace, {"strategy": "OldestEmulationVersion",
                                           "preferredHolder": target.identity})
                wait_until(lambda t=target.identity, s=sent: any(
                    c[0] == t and c[1] > s for c in recorder.claims), timeout=10)
                time.sleep(0.3)
            first = min(c[1] for c in recorder.claims
                        if c[0] == target.identity and c[1] > sent)
            took.append(first - sent)
            overlaps += len(recorder.overlaps())
            print(f"  preferredHolder -> {target.identity}: {first - sent:.3f}s", flush=True)
    return took, overlaps


def newcomer_waits(cp: ControlPlane, workdir: Path, trials: int) -> dict[str, list[float]]:
    """A lone sidecar's start → first claim: on no Lease (created, then one lease duration),
    and on a released one (one claim horizon)."""
    waits: dict[str, list[float]] = {"no_lease_object": [], "released_lease": []}
    namespace = cp.create_namespace("bench")
    kubeconfig = install_rbac(cp, namespace)
    create_pods(cp, namespace, "lone")
    for index in range(trials):
        for case in ("no_lease_object", "released_lease"):
            if case == "no_lease_object":
                cp.kubectl("-n", namespace, "delete", "lease", "lease-sidecar.jobs",
                           "--ignore-not-found")
            proc = sidecar(workdir, f"lone-{index}-{case}", namespace, kubeconfig,
                           "--pod-label", "off")
            started = time.monotonic()
            proc.start()
            try:
                wait_until(lambda p=proc: p.leader(timeout=0.5) == 200, timeout=20,
                           interval=0.01)
                waits[case].append(time.monotonic() - started)
            finally:
                proc.stop()  # releases: the next "released_lease" start finds it so
    return waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    run = record.start(args.trials)
    with tempfile.TemporaryDirectory(prefix="bench-kube-foreign-") as tmp, \
            ControlPlane(apiserver_extra_args=COORDINATED_LEADER_ELECTION) as cp:
        workdir = Path(tmp)
        version = cp.kubectl("version", "-o", "json").stdout
        server = json.loads(version)["serverVersion"]["gitVersion"]
        found = edits(cp, workdir, args.trials)
        handoffs, handoff_overlaps = preferred_handoffs(cp, workdir, args.trials)
        waits = newcomer_waits(cp, workdir, max(3, args.trials // 3))
    rows = {}
    for edit, trials in found.items():
        rows[edit] = {
            "trials": len(trials),
            "overlapping_claims": sum(t.overlaps for t in trials),
            "token_regressions": sum(t.token_regressions for t in trials),
            "tokens_grew": all(t.token_after is None or t.next_leader == t.holder
                               or t.token_after > max(t.tokens_before) for t in trials),
            "holder_kept_leading": sum(t.stepped_down_s is None for t in trials),
            "step_down": ms([t.stepped_down_s for t in trials if t.stepped_down_s is not None]),
            "next_leader_first_claim": ms([t.next_leader_s for t in trials
                                           if t.next_leader_s is not None
                                           and t.next_leader != t.holder]),
        }
    result = {
        "backend": "kubernetes", "kubernetes": server,
        "lease_duration_s": 3, "renew_interval_s": 0.5, "claim_horizon_s": 0.25,
        "edits": rows,
        "preferred_holder_handoff": {**ms(handoffs), "overlapping_claims": handoff_overlaps},
        "newcomer_first_claim": {case: ms(values) for case, values in waits.items()},
    }
    path = record.write("kubernetes-foreign.json", run, result)
    print(f"kube-apiserver {server}, {args.trials} trials, lease 3s, renew 500ms, "
          f"{run['cores']} cores, load {run['loadavg_at_start']}")
    print(f"{'edit':<20}{'overlaps':>9}{'tok.regr':>9}{'kept':>6}"
          f"{'step-down p50/p99 ms':>22}{'next claim p50/p99 ms':>23}")
    for edit, row in rows.items():
        step, nxt = row["step_down"], row["next_leader_first_claim"]
        print(f"{edit:<20}{row['overlapping_claims']:>9}{row['token_regressions']:>9}"
              f"{row['holder_kept_leading']:>6}"
              f"{step.get('p50_ms', '-')!s:>12}/{step.get('p99_ms', '-')!s:<9}"
              f"{nxt.get('p50_ms', '-')!s:>13}/{nxt.get('p99_ms', '-')!s:<9}")
    hand = result["preferred_holder_handoff"]
    print(f"preferredHolder hand-off: p50 {hand.get('p50_ms')} ms, p99 {hand.get('p99_ms')} "
          f"ms, overlapping claims {handoff_overlaps}")
    for case, row in result["newcomer_first_claim"].items():
        print(f"newcomer first claim, {case}: p50 {row.get('p50_ms')} ms, "
              f"max {row.get('max_ms')} ms")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
