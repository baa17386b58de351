"""Rolling updates in real pods: how often leadership changes hands per rollout, with and
without ``LEASE_SHUTDOWN_HANDOVER=youngest-ready``, and how soon the chart's leader
Service follows a hand-over. Prints a table and writes results/rollout.json.

    nice -n 10 flock /tmp/lease-bench.lock python -m bench.bench_rollout [--trials 10]

Needs root (see testkit/testbed/cluster.py). One cluster, the chart with its injector
(``kubernetes`` backend, chart timings: 15 s lease, 2 s renew interval, 250 ms claim
horizon), a 3-replica opted-in Deployment per mode (``off``: a plain release on SIGTERM,
the "before"; ``youngest-ready``), ``--trials`` ``kubectl rollout restart`` per update
strategy and mode. Every figure is on this host's one clock:

- **hand-overs per rollout**: changes of the pod claiming leadership, from every pod's
  ``/leader`` polled through its pod IP every 20 ms and its leader file read every 10 ms
  (testkit/chaos/recorder.py), from the restart until the old pods are gone and one pod
  leads. The target (issue 21): exactly one in ≥ 9 of 10 rollouts with youngest-ready.
- **gap per hand-over**: the old leader's last claim's end → the new leader's first claim.
- **overlaps**: moments two pods claimed at once (target 0); also two pods labelled
  ``leader`` at once in the pod watch.
- **leader Service settle** (both namespaces render the Service): the new leader's first
  claim → its pod label ``leader`` → the Service's EndpointSlices list exactly its pod IP
  as ready (an EndpointSlice watch) → a client pod asking ``/leader`` through the
  ClusterIP every 20 ms (a new connection each time; kube-proxy's rules) first reaches
  the new leader. Also counted: later requests that another pod answered (target 0) or
  none did, and each ready endpoint's own ``/leader`` once settled, asked from the host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from bench import record
from bench.failover import summary
from testkit import pods_support as ps
from testkit import rollout_support as rs
from testkit.testbed.cluster import Cluster, unavailable_reason

RELEASE = "ls"
MODES = ("off", "youngest-ready")


def run_mode(cluster: Cluster, image: str, mode: str, trials: int,
             strategies: list[str]) -> dict[str, Any]:
    ns = cluster.create_namespace(f"rollout-{mode}"[:20])
    service_values, service = rs.leader_service_values(RELEASE)
    ps.install_release(cluster, ns, image, release=RELEASE, extra=(
        "lease.name=bench", f"lease.shutdownHandover={mode}", *service_values))
    ps.deploy_app(cluster, ns, image, "bench")
    ps.wait_one_leader(cluster, ns)
    out: dict[str, Any] = {}
    watch = rs.SliceWatch(cluster, ns, service)
    client = rs.ServiceClient(cluster, ns, service, image)
    try:
        with ps.PodObserver(cluster, ns) as obs:
            for strategy in strategies:
                rs.set_strategy(cluster, ns, "web", strategy)
                rows = []
                for i in range(trials):
                    row = rs.rollout(cluster, ns, obs)
                    row["through_service"] = rs.settled_through_service(
                        cluster, client, row)
                    row["settle"] = rs.settle_times(obs, watch, row["moves"])
                    # Through the Service's endpoints once settled: who answers?
                    ready = watch.ready_now()
                    answers = [rs.leader_answers(a) for a in ready]
                    row["endpoints_not_leader"] = sum(
                        status != 200 or body.get("identity") != row["final_leader"]
                        for status, body in answers)
                    row["endpoints"] = len(ready)
                    rows.append(row)
                    print(f"{mode} {strategy} {i + 1}/{trials}: hand-overs {row['handovers']} "
                          f"gaps {[round(g * 1000) for g in row['gaps']]} ms, overlaps "
                          f"{row['overlaps']}, settle "
                          f"{[round(s['claim_to_endpoints'] * 1000) for s in row['settle']]} ms"
                          ", client "
                          f"{[as_ms(t['claim_to_client']) for t in row['through_service']]} ms"
                          f", loadavg {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
                out[strategy] = rows
            http_periods = [p for s in obs.recorder.http_stats.values() for p in s.periods]
            out["_http_poll_period_ms_p50"] = round(
                sorted(http_periods)[len(http_periods) // 2] * 1000, 1) if http_periods else None
            out["_anomalies"] = list(obs.recorder.anomalies)[:20]
    finally:
        client.stop()
        watch.stop()
        cluster.helm("uninstall", RELEASE, "-n", ns, check=False)
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    return out


def as_ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def _present(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [t[key] for r in rows for t in r.get("through_service", []) if t[key] is not None]


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    counts = [r["handovers"] for r in rows]
    gaps = [g for r in rows for g in r["gaps"]]
    settle = [s for r in rows for s in r.get("settle", [])]
    client = _present(rows, "claim_to_client")
    return {
        "rollouts": len(rows),
        "exactly_one_handover": sum(c == 1 for c in counts),
        "handovers_per_rollout": counts,
        "handovers_to_an_old_pod": sum(r["to_old_pod"] for r in rows),
        "gap": summary(gaps) if gaps else None,
        "overlaps": sum(r["overlaps"] for r in rows),
        "fencing_violations": sum(r["fencing_violations"] for r in rows),
        "two_leader_labels": sum(r["two_leader_labels"] for r in rows),
        "rollout_duration": summary([r["duration"] for r in rows]),
        "service_claim_to_label": summary([s["claim_to_label"] for s in settle])
        if settle else None,
        "service_claim_to_endpoints": summary([s["claim_to_endpoints"] for s in settle])
        if settle else None,
        "service_label_to_endpoints": summary([s["label_to_endpoints"] for s in settle])
        if settle else None,
        "service_endpoints_not_leader_after_settle": sum(r["endpoints_not_leader"]
                                                         for r in rows),
        "service_claim_to_client": summary(client) if client else None,
        "service_handovers_measured_by_client": len(client),
        "service_client_other_pod_after": sum(_present(rows, "other_pod")),
        "service_client_no_answer_after": sum(_present(rows, "no_answer")),
        "service_client_leader_not_200_after": sum(_present(rows, "leader_not_200")),
    }


def run(trials: int, strategies: list[str], modes: list[str]) -> dict[str, Any]:
    cluster = Cluster()
    cluster.start()
    try:
        image = ps.load_sidecar_image(cluster)
        raw = {mode: run_mode(cluster, image, mode, trials, strategies) for mode in modes}
    finally:
        cluster.stop()
    result: dict[str, Any] = {
        "image": image,
        "timing": "chart defaults: 15 s lease, 2 s renew interval, 250 ms claim horizon",
        "results": {mode: {s: figures(raw[mode][s]) for s in strategies} for mode in modes},
        "http_poll_period_ms_p50": {m: raw[m]["_http_poll_period_ms_p50"] for m in modes},
        "anomalies": {m: raw[m]["_anomalies"] for m in modes},
        "raw": {m: {s: raw[m][s] for s in strategies} for m in modes},
    }
    return result


def table(r: dict[str, Any]) -> str:
    def ms(s: dict[str, float] | None) -> str:
        return f"{s['p50_ms']:.0f} / {s['p99_ms']:.0f} ms" if s else "-"

    lines = ["| shutdown hand-over | strategy | exactly one hand-over | hand-overs per "
             "rollout | to an old pod | gap p50 / p99 | overlaps |",
             "|---|---|---|---|---|---|---|"]
    for mode, by_strategy in r["results"].items():
        for strategy, f in by_strategy.items():
            lines.append(f"| `{mode}` | {strategy} | {f['exactly_one_handover']} of "
                         f"{f['rollouts']} | {f['handovers_per_rollout']} | "
                         f"{f['handovers_to_an_old_pod']} | {ms(f['gap'])} | "
                         f"{f['overlaps']} |")
    lines += ["", "| leader Service (mode, strategy) | first claim → label | first claim → "
              "endpoints only the leader | first claim → a client pod reaches it through "
              "the ClusterIP | later requests: another pod answered / none did |",
              "|---|---|---|---|---|"]
    for mode, by_strategy in r["results"].items():
        for strategy, f in by_strategy.items():
            lines.append(f"| `{mode}`, {strategy} | {ms(f['service_claim_to_label'])} | "
                         f"{ms(f['service_claim_to_endpoints'])} | "
                         f"{ms(f['service_claim_to_client'])} | "
                         f"{f['service_client_other_pod_after']} / "
                         f"{f['service_client_no_answer_after']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--strategies", default=",".join(rs.STRATEGIES))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", default=None, help="default: bench/results/rollout.json")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"bench_rollout: {reason}", file=sys.stderr)
        return 2
    meta = record.start(args.trials)
    result = run(args.trials, args.strategies.split(","), args.modes.split(","))
    out = record.write("rollout.json", meta, result, Path(args.out) if args.out else None)
    result = json.loads(out.read_text())
    print(table(result))
    print(f"\ncommit {result['commit']}, {result['cores']} cores, load average "
          f"{result['loadavg_at_start']} → {result['loadavg_at_end']}; results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
