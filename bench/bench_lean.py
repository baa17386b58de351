"""The lean sidecar's figures (issue 20): what one sidecar costs, and what a group costs
the apiserver. Prints a table and writes results/lean.json.

    flock /tmp/lease-bench.lock python -m bench.bench_lean [--trials 10] [--groups 5,10,20]

Everything runs for real on this host: one kube-apiserver + etcd (the test bed), one
PostgreSQL, real ``lease-sidecar run`` processes with the pod label and Events on
(``POD_NAME``/``POD_NAMESPACE`` set, Pod objects in the apiserver, the deploy/rbac.yaml
ServiceAccount), and client-go's own elector (``testkit/interop/clientgo-elector``).

- **idle RSS** per backend: a lone sidecar that leads, after 10 s idle, its ``VmRSS``
  (the process's own accounting, outside any pod);
- **start → /healthz**: ``Popen`` to the first ``200`` on ``/healthz``, per backend, with
  the package byte-compiled first, as the image has it (``--skip requests --skip watch``
  measures only these two);
- **apiserver requests per minute**, idle group of 3: the apiserver's own
  ``apiserver_request_total`` (leases, pods, events; every verb, watches included) over a
  window, minus a baseline window with nothing running (the apiserver's own leases), for
  3 sidecars (defaults: 15 s lease) and then 3 client-go electors with client-go's
  defaults (15 s lease, 10 s renew deadline, 2 s retry period), in one run;
- **watch events per leadership change** for groups of N sidecars: the apiserver's own
  ``apiserver_watch_events_total`` (leases and pods) across SIGTERM handovers, divided
  by the handovers; linear in N means one watch per sidecar of its Lease, no pod watches.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import record
from testkit.kube_support import create_pods, install_rbac, leaders
from testkit.support import SidecarProcess, get_json, wait_until
from testkit.testbed import gobuild
from testkit.testbed.kube import ControlPlane

IDLE_SECONDS = 10.0
WINDOW = 60.0  # seconds per request-rate window (watches are re-opened within it)
WARMUP = 15.0
RESOURCES = ("leases", "pods", "events")
CLIENTGO_LEASE = "lease-sidecar.clientgo"
CLIENTGO_DEFAULTS = ["-lease-duration", "15s", "-renew-deadline", "10s", "-retry-period", "2s"]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_ms(pid: int) -> float:
    """User + system CPU the process has used so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def metrics(cp: ControlPlane) -> str:
    request = urllib.request.Request(f"{cp.server}/metrics")
    with urllib.request.urlopen(request, context=cp.admin_ssl_context(), timeout=30) as answer:
        return answer.read().decode()


def counter_sum(text: str, name: str, resources: tuple[str, ...] = RESOURCES) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            resource = re.search(r'resource="([^"]*)"', labels)
            if resource and resource.group(1) in resources:
                total += float(value)
    return total


class Bed:
    """One namespace with the Role, a kubeconfig for it and Pod objects on demand."""

    def __init__(self, cp: ControlPlane, workdir: Path) -> None:
        self.cp, self.workdir = cp, workdir
        self.ns = cp.create_namespace("lean")
        # The sidecars' Lease and the client-go electors' (both named in the Role).
        self.kubeconfig = install_rbac(cp, self.ns, ("lease-sidecar.jobs", CLIENTGO_LEASE))
        self.made: set[str] = set()

    def sidecar(self, pod: str, backend: str, dsn: str | None, *args: str) -> SidecarProcess:
        if pod not in self.made:
            create_pods(self.cp, self.ns, pod)
            self.made.add(pod)
        flags = ["--backend", backend, "--name", "jobs", "--pod-label", "on", *args]
        if dsn:
            flags += ["--dsn", dsn]
        return SidecarProcess(self.workdir, pod, args=flags, env={
            "POD_NAME": pod, "POD_NAMESPACE": self.ns, "KUBECONFIG": str(self.kubeconfig)})


def lone(bed: Bed, backend: str, dsn: str | None, trials: int) -> dict[str, Any]:
    """Idle RSS and start → /healthz of a lone sidecar, ``trials`` times; with the wall
    time, the CPU the sidecar had used by then (on a loaded machine the wall time is
    mostly waiting for a core, the CPU time is what the start itself costs)."""
    rss, start, cpu = [], [], []
    for trial in range(trials):
        proc = bed.sidecar(f"{backend}-{trial}", backend, dsn)
        try:
            began = time.monotonic()
            proc.start()
            wait_until(lambda p=proc: get_json(p.url + "/healthz", timeout=0.5)[0] == 200,
                       timeout=20, interval=0.005)
            start.append((time.monotonic() - began) * 1000)
            assert proc.proc is not None
            cpu.append(cpu_ms(proc.proc.pid))
            wait_until(lambda p=proc: p.leader() == 200, timeout=30)
            time.sleep(IDLE_SECONDS)
            rss.append(rss_mib(proc.proc.pid))
        finally:
            proc.stop()
    return {"idle_rss_mib": {"p50": round(statistics.median(rss), 1),
                             "max": round(max(rss), 1)},
            "start_to_healthz_ms": {"p50": round(statistics.median(start)),
                                    "max": round(max(start))},
            "start_cpu_ms": {"p50": round(statistics.median(cpu)), "max": round(max(cpu))},
            "trials": trials}


def request_rate(cp: ControlPlane, started: list[Any]) -> float:
    """Requests per minute to leases/pods/events over one window, after a warm-up."""
    time.sleep(WARMUP)
    before = counter_sum(metrics(cp), "apiserver_request_total")
    time.sleep(WINDOW)
    after = counter_sum(metrics(cp), "apiserver_request_total")
    return (after - before) * 60 / WINDOW


def group_requests(cp: ControlPlane, workdir: Path) -> dict[str, Any]:
    baseline = request_rate(cp, [])
    bed = Bed(cp, workdir)
    procs = [bed.sidecar(f"idle-{i}", "kubernetes", None) for i in range(3)]
    try:
        for proc in procs:
            proc.start()
        wait_until(lambda: leaders(procs), timeout=30)
        sidecars = request_rate(cp, procs) - baseline
    finally:
        for proc in procs:
            proc.stop()
    binary = gobuild.ensure_binary("clientgo-elector")
    electors = []
    try:
        for i in range(3):
            out = (workdir / f"go-{i}.jsonl").open("wb")
            electors.append(subprocess.Popen(
                [str(binary), "-kubeconfig", str(bed.kubeconfig), "-namespace", bed.ns,
                 "-lease", CLIENTGO_LEASE, "-identity", f"go-{i}",
                 *CLIENTGO_DEFAULTS], stdout=out, stderr=subprocess.DEVNULL))
        clientgo = request_rate(cp, electors) - baseline
    finally:
        for proc in electors:
            proc.terminate()
            proc.wait(10)
    return {"baseline_per_min": round(baseline, 1), "sidecars_per_min": round(sidecars, 1),
            "clientgo_per_min": round(clientgo, 1),
            "ratio": round(sidecars / clientgo, 2) if clientgo > 0 else None,
            "window_s": WINDOW}


def watch_fanout(cp: ControlPlane, workdir: Path, size: int, changes: int = 3
                 ) -> dict[str, Any]:
    bed = Bed(cp, workdir)
    procs = [bed.sidecar(f"w{size}-{i}", "kubernetes", None) for i in range(size)]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_http(timeout=60)
        wait_until(lambda: leaders(procs), timeout=60)
        time.sleep(5)
        before = counter_sum(metrics(cp), "apiserver_watch_events_total", ("leases", "pods"))
        for _ in range(changes):
            old = leaders(procs)[0]
            old.signal(signal.SIGTERM)
            rest = [p for p in procs if p is not old and p.proc and p.proc.poll() is None]
            wait_until(lambda r=rest: leaders(r), timeout=30)
            old.proc.wait(10)  # type: ignore[union-attr]  # a started process
            time.sleep(3)  # the label writes and their deliveries
            procs = rest
        after = counter_sum(metrics(cp), "apiserver_watch_events_total", ("leases", "pods"))
    finally:
        for proc in procs:
            proc.stop()
    return {"sidecars": size, "changes": changes,
            "watch_events_per_change": round((after - before) / changes, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--groups", default="5,10,20")
    parser.add_argument("--skip", action="append", default=[],
                        help="lone | requests | watch (repeatable)")
    opts = parser.parse_args()
    run = record.start(opts.trials)
    results: dict[str, Any] = {}
    cp = ControlPlane()
    cp.start()
    server = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-lean-") as tmp:
            workdir = Path(tmp)
            if "lone" not in opts.skip:
                from testkit.testbed.postgres import PgServer

                server = PgServer().init()
                bed = Bed(cp, workdir)
                # pip byte-compiles what the image installs; a checkout run with
                # PYTHONDONTWRITEBYTECODE would compile sidecar/ from source on every
                # start instead, a fifth of the start-up's CPU that no pod pays.
                compileall.compile_dir(record.REPO / "sidecar", quiet=1)
                results["lone"] = {}
                for backend, dsn in (("sqlite", str(workdir / "lease.db")),
                                     ("postgres", server.dsn),
                                     ("postgres-row", server.dsn), ("kubernetes", None)):
                    if backend == "postgres-row":
                        subprocess.run([sys.executable, "-m", "sidecar", "schema", "--apply",
                                        "--backend", backend, "--dsn", dsn], check=True,
                                       capture_output=True)
                    results["lone"][backend] = lone(bed, backend, dsn, opts.trials)
                    print(backend, json.dumps(results["lone"][backend]), flush=True)
            if "requests" not in opts.skip:
                results["idle_group_of_3"] = group_requests(cp, workdir)
                print(json.dumps(results["idle_group_of_3"]), flush=True)
            if "watch" not in opts.skip:
                results["watch_fanout"] = [watch_fanout(cp, workdir, int(n))
                                           for n in opts.groups.split(",")]
                print(json.dumps(results["watch_fanout"]), flush=True)
    finally:
        if server is not None:
            server.destroy()
        cp.stop()
    results["targets"] = {"idle_rss_mib": "<= 48 every backend (outside pods)",
                          "start_to_healthz_ms": "<= 300", "requests_ratio": "<= 0.3",
                          "watch_events": "linear in the group size"}
    print(json.dumps(results, indent=2))
    # Sections this run skipped keep their earlier figures, named as such: the file's
    # commit and date are this run's.
    path = record.results_dir() / "lean.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    kept = sorted(set(previous) - set(results) - set(record.KEYS) - {"earlier_run"})
    if kept:
        # Kept sections that an earlier file already kept keep that run's commit and date.
        earlier = previous.get("earlier_run") or {}
        source = earlier if set(kept) <= set(earlier.get("sections", ())) else previous
        results["earlier_run"] = {"commit": source.get("commit"),
                                  "date": source.get("date"), "sections": kept}
    record.write("lean.json", run, {**{k: previous[k] for k in kept}, **results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
