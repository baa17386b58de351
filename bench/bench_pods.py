"""Real pods on the one-node cluster: the chart's injector, a 3-replica opted-in
Deployment, and what an operator would time. Prints a table and writes
results/pods-<backend>.json.

    flock /tmp/lease-bench.lock python -m bench.bench_pods [--trials 10] [--backend kubernetes]

Needs root (see testkit/testbed/cluster.py). Every figure is taken on this host's one wall
clock: the pod watch, the observer polling every pod's ``/leader`` through its pod IP
every 20 ms and reading every leader file every 10 ms (testkit/chaos/recorder.py), and the
sidecars' own log timestamps.

- **pod start → sidecar ready**: the pod's first watch event → the first event showing
  its sidecar container ready (its readiness probe passed); and → the pod Ready. Every pod
  the trials create counts (replacements and rolled-out pods).
- **leader deletion → first claim**: ``kubectl delete pod <leader>`` issued → another
  pod's first observed claim (``200`` or a leader file). The deleted pod's app stops
  first (SIGTERM), then its sidecar unpublishes and releases, then the successor waits
  one claim horizon (250 ms) before it claims.
- **rolling restart**: ``kubectl rollout restart`` → rolled out with one leader: the
  longest leaderless gap and the number of moments two pods claimed at once (target 0).
- **sidecar RSS / CPU**: the kubelet's ``/stats/summary`` for the ``lease-sidecar``
  container (RSS, working set, usageNanoCores), and the container's own cgroup
  (``cpuacct.usage`` over a quiet minute), leader and standbys apart.
- **where start-up goes**: for the pods each rolling restart made, the moments after
  the pod's first watch event when the watch first showed its IP (scheduled, sandbox and
  network up) and its sidecar container running (with the chart's postStart hook: once the
  hook has seen the sidecar answer); when the sidecar process started (its
  ``/proc`` start time, found through the container's cgroup); when it logged
  ``started`` (its HTTP server up, its elector running); and when the watch showed the
  container ready (the kubelet's next pass over the pod, its first readiness probe, and
  the status reached the apiserver).
- **idle sidecar memory per trial**: after each rolling restart, once the new pods have
  idled IDLE_AFTER_RESTART, every sidecar container's own memory cgroup
  (``memory.stat``): ``total_rss`` (anonymous memory: the Python heap, thread stacks; the
  kubelet's ``rssBytes`` is this same counter), the working set (usage minus inactive
  file pages, what the kubelet evicts on) and ``total_mapped_file``/``total_cache`` (file
  pages charged to the container; the image's files are usually charged to whoever
  read them first, so these stay small).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench import record
from bench.failover import summary
from testkit import pods_support as ps
from testkit.support import unix_time
from testkit.testbed.cluster import Cluster, unavailable_reason

# Idle usage: the last rolled-out pods settle first (start-up imports cost CPU), then
# the kubelet's stats are sampled every 10 s and the cgroup's CPU time taken over QUIET.
SETTLE = 30.0
QUIET = 60.0
# A restart trial ends when the new pods are Ready and one leads; the per-trial memory
# reading waits this long after that, so start-up is over.
IDLE_AFTER_RESTART = 10.0


def _pg_backend(cluster: Cluster, ns: str) -> tuple[Any, tuple[str, ...]]:
    from testkit.testbed.postgres import PgServer

    pg = PgServer(extra_listen=[cluster.node_ip], client_networks=[cluster.pod_cidr]).init()
    database = f"bench_{uuid.uuid4().hex[:8]}"
    pg.create_database(database)
    cluster.kubectl("-n", ns, "create", "secret", "generic", "lease-dsn",
                    f"--from-literal=dsn={pg.dsn_for(database, host=cluster.node_ip)}")
    return pg, ("lease.dsnSecret.name=lease-dsn",)


def deletion_trial(cluster: Cluster, ns: str, obs: ps.PodObserver) -> dict[str, float]:
    old = ps.wait_one_leader(cluster, ns)
    cluster.wait_for(lambda: obs.leader_now() == old, 30, "the observer to see the leader")
    t0 = time.time()
    cluster.kubectl("-n", ns, "delete", "pod", old, "--wait=false")
    claim = cluster.wait_for(lambda: obs.first_claim_after(t0, exclude=old), 60,
                             "a new leader's first claim")
    cluster.wait_for(lambda: old not in ps.roles(cluster, ns), 90, "the deleted pod gone")
    ps.wait_rolled_out(cluster, ns, "web")
    ps.wait_one_leader(cluster, ns)
    verdict = obs.verdict(t0 - 0.5, time.time())
    return {"first_claim": claim.start - t0, "gap": verdict.longest_gap,
            "overlaps": len(verdict.overlaps)}


def restart_trial(cluster: Cluster, ns: str, obs: ps.PodObserver) -> dict[str, float]:
    ps.wait_one_leader(cluster, ns)
    before = {p["metadata"]["name"] for p in ps.app_pods(cluster, ns)}
    cluster.wait_for(obs.leader_now, 30, "the observer to see a leader")
    begin = time.time()
    cluster.kubectl("-n", ns, "rollout", "restart", "deployment/web")
    ps.wait_rolled_out(cluster, ns, "web")
    cluster.wait_for(lambda: not before & set(ps.roles(cluster, ns)), 120, "old pods gone")
    ps.wait_one_leader(cluster, ns)
    cluster.wait_for(obs.leader_now, 30, "the observer to see the new leader")
    end = time.time()
    verdict = obs.verdict(begin, end)
    return {"duration": end - begin, "gap": verdict.longest_gap,
            "overlaps": len(verdict.overlaps),
            "max_overlap": max((o.length for o in verdict.overlaps), default=0.0),
            "fencing_violations": len(verdict.fencing)}


def _cgroup_file(pod: dict[str, Any], container: str, controller: str,
                 name: str) -> Path | None:
    """A file of the container's own cgroup (v1, cgroupfs driver), or None."""
    uid = pod["metadata"]["uid"]
    for status in pod["status"].get("initContainerStatuses", []):
        if status["name"] == container and status.get("containerID"):
            cid = status["containerID"].split("://", 1)[1]
            for qos in ("burstable", "besteffort", ""):
                path = Path(f"/sys/fs/cgroup/{controller}/kubepods", qos, f"pod{uid}", cid,
                            name)
                if path.exists():
                    return path
    return None


def _cpuacct(pod: dict[str, Any], container: str) -> Path | None:
    return _cgroup_file(pod, container, "cpuacct", "cpuacct.usage")


def idle_memory(cluster: Cluster, ns: str) -> list[dict[str, Any]]:
    """Every sidecar container's memory cgroup, once, in MiB (see the module doc)."""
    table = ps.roles(cluster, ns)
    rows = []
    for pod in ps.app_pods(cluster, ns):
        stat_path = _cgroup_file(pod, ps.SIDECAR, "memory", "memory.stat")
        usage_path = _cgroup_file(pod, ps.SIDECAR, "memory", "memory.usage_in_bytes")
        if stat_path is None or usage_path is None:
            continue
        try:
            stat = dict(line.split() for line in stat_path.read_text().splitlines())
            usage = int(usage_path.read_text())
        except (OSError, ValueError):
            continue  # the container went away meanwhile
        rows.append({
            "pod": pod["metadata"]["name"],
            "role": table.get(pod["metadata"]["name"]),
            "rss_mib": round(int(stat["total_rss"]) / 2**20, 1),
            "working_set_mib": round((usage - int(stat["total_inactive_file"])) / 2**20, 1),
            "mapped_file_mib": round(int(stat["total_mapped_file"]) / 2**20, 1),
            "cache_mib": round(int(stat["total_cache"]) / 2**20, 1),
        })
    return rows


def _proc_start(pid: int) -> float:
    """A process's start as epoch seconds (10 ms resolution), from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def _started_logged(cluster: Cluster, ns: str, pod: str) -> float | None:
    """When the sidecar logged ``started``, by its own clock (the node's)."""
    proc = cluster.kubectl("-n", ns, "logs", pod, "-c", ps.SIDECAR, check=False, timeout=30)
    for line in proc.stdout.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("msg") == "started" and entry.get("ts"):
            return unix_time(entry["ts"])
    return None


def startup_timeline(cluster: Cluster, ns: str, obs: ps.PodObserver,
                     since: float) -> list[dict[str, Any]]:
    """For each pod created after ``since``: seconds from its first watch event to each
    start-up step (see the module doc); None where a step was not seen."""
    rows = []
    created = {n: t for n, t in obs.created_since_start().items() if t >= since}
    for pod in ps.app_pods(cluster, ns):
        name = pod["metadata"]["name"]
        if name not in created:
            continue
        t0 = created[name]
        procs = _cgroup_file(pod, ps.SIDECAR, "memory", "cgroup.procs")
        started = None
        try:
            pids = [int(p) for p in procs.read_text().split()] if procs else []
            started = min(_proc_start(pid) for pid in pids) if pids else None
        except (OSError, ValueError):
            pass
        logged = _started_logged(cluster, ns, name)

        def since_t0(t: float | None, t0: float = t0) -> float | None:
            return None if t is None else round(t - t0, 3)

        rows.append({"pod": name, "ip": since_t0(obs.ip_seen.get(name)),
                     "container_running": since_t0(obs.sidecar_running.get(name)),
                     "process_started": since_t0(started),
                     "logged_started": since_t0(logged),
                     "ready": since_t0(obs.sidecar_ready.get(name))})
    return rows


def _mib_summary(values: list[float]) -> dict[str, float | int]:
    return {"n": len(values), "p50_mib": round(statistics.median(values), 1),
            "max_mib": round(max(values), 1)} if values else {"n": 0}


def resources(cluster: Cluster, ns: str) -> dict[str, Any]:
    """Idle usage of each sidecar container: kubelet stats and the cgroup's CPU time."""
    time.sleep(SETTLE)
    table = ps.roles(cluster, ns)
    pods = {p["metadata"]["name"]: p for p in ps.app_pods(cluster, ns)}
    paths = {name: _cpuacct(pod, ps.SIDECAR) for name, pod in pods.items()}
    start = {n: int(p.read_text()) for n, p in paths.items() if p}
    t0 = time.monotonic()
    samples: dict[str, list[dict[str, float]]] = {n: [] for n in pods}
    while time.monotonic() - t0 < QUIET:
        for pod in cluster.kubelet_get("/stats/summary")["pods"]:
            name = pod["podRef"]["name"]
            for c in pod.get("containers", []):
                if name in samples and c["name"] == ps.SIDECAR:
                    samples[name].append({
                        "rss_mb": c["memory"].get("rssBytes", 0) / 2**20,
                        "working_set_mb": c["memory"].get("workingSetBytes", 0) / 2**20,
                        "cpu_millicores": c["cpu"].get("usageNanoCores", 0) / 1e6,
                    })
        time.sleep(10)
    elapsed = time.monotonic() - t0
    out: dict[str, Any] = {}
    for role in ("leader", "standby"):
        names = [n for n in pods if table.get(n) == role]
        rows = [s for n in names for s in samples[n]]
        cgroup_cpu = [(int(paths[n].read_text()) - start[n]) / 1e9 / elapsed * 100  # type: ignore[union-attr]  # paths only for found cgroups
                      for n in names if n in start]
        out[role] = {
            "pods": len(names),
            "rss_mb": round(statistics.median(r["rss_mb"] for r in rows), 1) if rows else None,
            "working_set_mb": round(statistics.median(r["working_set_mb"] for r in rows), 1)
            if rows else None,
            "kubelet_cpu_millicores":
                round(statistics.median(r["cpu_millicores"] for r in rows), 2) if rows else None,
            "cgroup_cpu_percent": round(statistics.median(cgroup_cpu), 2) if cgroup_cpu else None,
        }
    return out


def run(trials: int, backend: str) -> dict[str, Any]:
    cluster = Cluster()
    pg = None
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr, flush=True)
    cluster.start()
    try:
        image = ps.load_sidecar_image(cluster)
        ns = cluster.create_namespace("bench")
        extra: tuple[str, ...] = ("lease.name=bench",)
        if backend in ("postgres", "postgres-row"):
            pg, more = _pg_backend(cluster, ns)
            extra += more
        if backend == "postgres-row":
            # The lease table, made the chart's way: its schema Job (a Helm hook before
            # the install), here with the same role's DSN.
            extra += ("schemaJob.enabled=true", "schemaJob.dsnSecret.name=lease-dsn")
        t = time.monotonic()
        ps.install_release(cluster, ns, image, backend=backend, extra=extra)
        installed = time.monotonic() - t
        t = time.monotonic()
        ps.deploy_app(cluster, ns, image, "bench")
        ps.wait_one_leader(cluster, ns)
        rolled_out = time.monotonic() - t
        deletions: list[dict[str, float]] = []
        restarts: list[dict[str, float]] = []
        with ps.PodObserver(cluster, ns) as obs:
            for i in range(trials):
                deletions.append(deletion_trial(cluster, ns, obs))
                print(f"deletion {i + 1}/{trials}: {deletions[-1]}", file=sys.stderr, flush=True)
            memory: list[list[dict[str, Any]]] = []
            timeline: list[dict[str, Any]] = []
            for i in range(trials):
                began = time.time()
                restarts.append(restart_trial(cluster, ns, obs))
                timeline += startup_timeline(cluster, ns, obs, began)
                time.sleep(IDLE_AFTER_RESTART)
                memory.append(idle_memory(cluster, ns))
                print(f"restart {i + 1}/{trials}: {restarts[-1]}; idle sidecar memory "
                      f"{memory[-1]}", file=sys.stderr, flush=True)
            created = obs.created_since_start()
            sidecar_ready = [obs.sidecar_ready[n] - t for n, t in created.items()
                             if n in obs.sidecar_ready]
            pod_ready = [obs.pod_ready[n] - t for n, t in created.items() if n in obs.pod_ready]
            anomalies = list(obs.recorder.anomalies)
            http_periods = [p for s in obs.recorder.http_stats.values() for p in s.periods]
        usage = resources(cluster, ns)
        return {
            "backend": backend,
            "image": image,
            "cluster_start_s": round(cluster.startup_seconds, 1),
            "helm_install_s": round(installed, 1),
            "deployment_rollout_s": round(rolled_out, 1),
            "pod_start_to_sidecar_ready": summary(sidecar_ready),
            "pod_start_to_pod_ready": summary(pod_ready),
            "deletion_to_first_claim": summary([d["first_claim"] for d in deletions]),
            "deletion_longest_gap": summary([d["gap"] for d in deletions]),
            "deletion_overlaps": sum(int(d["overlaps"]) for d in deletions),
            "restart_longest_gap": summary([r["gap"] for r in restarts]),
            "restart_overlaps": sum(int(r["overlaps"]) for r in restarts),
            "restart_fencing_violations": sum(int(r["fencing_violations"]) for r in restarts),
            "restart_duration": summary([r["duration"] for r in restarts]),
            "http_poll_period_ms_p50": round(statistics.median(http_periods) * 1000, 1),
            "anomalies": anomalies[:20],
            "sidecar_usage": usage,
            "startup_steps": {
                step: summary(seen) if (seen := [row[step] for row in timeline
                                                 if row[step] is not None]) else {"n": 0}
                for step in ("ip", "container_running", "process_started", "logged_started",
                             "ready")},
            "idle_sidecar_memory": {
                key: _mib_summary([row[key] for trial in memory for row in trial])
                for key in ("rss_mib", "working_set_mib", "mapped_file_mib", "cache_mib")},
            "raw": {"deletions": deletions, "restarts": restarts, "idle_memory": memory,
                    "startup_timeline": timeline},
        }
    finally:
        cluster.stop()
        if pg is not None:
            pg.destroy()


def table(r: dict[str, Any]) -> str:
    def row(label: str, s: dict[str, float], note: str = "") -> str:
        return f"| {label} | {s['p50_ms']:.0f} ms | {s['p99_ms']:.0f} ms | {s['n']} | {note} |"

    u = r["sidecar_usage"]
    lines = [
        "| figure | p50 | p99 | n | note |",
        "|---|---|---|---|---|",
        row("pod start → sidecar ready", r["pod_start_to_sidecar_ready"],
            "first watch event → sidecar container ready"),
        row("pod start → pod Ready", r["pod_start_to_pod_ready"], "2/2"),
        row("leader pod deletion → new leader's first claim", r["deletion_to_first_claim"],
            f"overlaps: {r['deletion_overlaps']}"),
        row("rolling restart: longest leaderless gap", r["restart_longest_gap"],
            f"overlaps: {r['restart_overlaps']} (target 0)"),
        "",
        f"idle sidecar memory, its cgroup, {IDLE_AFTER_RESTART:.0f} s after each restart "
        "(MiB): " + ", ".join(
            f"{key.removesuffix('_mib')} p50 {m.get('p50_mib')} max {m.get('max_mib')} "
            f"(n {m['n']})" for key, m in r["idle_sidecar_memory"].items()),
        "start-up steps after the pod's first watch event, p50 ms: " + ", ".join(
            f"{step} {x.get('p50_ms')}" for step, x in r["startup_steps"].items()),
        "",
        "| sidecar container, idle | RSS | working set | CPU (kubelet) | CPU (cgroup, "
        f"{QUIET:.0f} s) |",
        "|---|---|---|---|---|",
    ]
    for role in ("leader", "standby"):
        x = u[role]
        lines.append(f"| {role} ({x['pods']} pods) | {x['rss_mb']} MiB | "
                     f"{x['working_set_mb']} MiB | {x['kubelet_cpu_millicores']} millicores | "
                     f"{x['cgroup_cpu_percent']} % of a core |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--backend", default="kubernetes",
                        choices=("kubernetes", "postgres", "postgres-row"))
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"bench_pods: {reason}", file=sys.stderr)
        return 2
    meta = record.start(args.trials)
    result = run(args.trials, args.backend)
    out = record.write(f"pods-{args.backend}.json", meta, result)
    print(table(result))
    print(f"\ncluster start {result['cluster_start_s']} s, helm install --wait "
          f"{result['helm_install_s']} s, 3-replica rollout {result['deployment_rollout_s']} s; "
          f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
