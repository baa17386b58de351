"""What each Lease name costs one sidecar on the ``kubernetes`` backend: one sidecar
holding 1, 8 and 64 names on a real kube-apiserver; writes results/kube-names.json.

    flock /tmp/lease-bench.lock python -m bench.bench_kube_names [--names 1,8,64]

The chart's timing (15 s lease, the derived 4.67 s renew interval, 250 ms horizon), the
ServiceAccount of deploy/rbac.yaml, no pod label. Per name count, once every name is held
(and after a settle), over ``--seconds``:

- the sidecar's RSS (VmRSS) at the end, and its CPU time over the window (% of a core);
- its TCP connections to the apiserver (one watch per name, plus the calls' own);
- the apiserver's requests on Leases per minute, by verb (its ``apiserver_request_total``,
  which counts a request when it ends: a watch that stays open is not in it; the gauge
  ``apiserver_longrunning_requests`` gives the watches open, less those open before the
  sidecar started: the one long admin watch below and the apiserver's own; the
  apiserver's own requests, measured over one window before any sidecar runs, are
  subtracted);
- every Lease's renews as an admin watch sees them: the gap between two renews of one
  Lease, p50 / p99 / max (the claim ends after 14 s without one);
- start → every name held.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import record
from bench.failover import pct
from testkit.kube_support import create_pods, install_rbac
from testkit.support import SidecarProcess, get_json, wait_until
from testkit.testbed.kube import ControlPlane

SETTLE = 20.0  # seconds after every name is held: the first claims' waits, the first renews
SAMPLE = re.compile(r'^(?P<name>[a-z_]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def lease_metrics(cp: ControlPlane) -> tuple[dict[str, float], float]:
    """The apiserver's request counts on Leases by verb, and the Lease watches open."""
    with urllib.request.urlopen(f"{cp.server}/metrics", context=cp.admin_ssl_context(),
                                timeout=10) as answer:
        text = answer.read().decode()
    counts: dict[str, float] = {}
    watching = 0.0
    for line in text.splitlines():
        found = SAMPLE.match(line)
        if not found or 'resource="leases"' not in found["labels"]:
            continue
        verb = re.search(r'verb="([A-Z]+)"', found["labels"])
        if verb and found["name"] == "apiserver_request_total":
            counts[verb[1]] = counts.get(verb[1], 0.0) + float(found["value"])
        elif verb and verb[1] == "WATCH" and found["name"] == "apiserver_longrunning_requests":
            watching += float(found["value"])
    return counts, watching


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, in clock ticks


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmRSS")


def connections(pid: int, port: int) -> int:
    """Established TCP connections of ``pid`` to the apiserver's ``port``."""
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = fd.readlink().as_posix() if fd.is_symlink() else ""
        if target.startswith("socket:["):
            sockets.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cells = line.split()
            remote_port = int(cells[2].rsplit(":", 1)[1], 16)
            if cells[3] == "01" and remote_port == port and cells[9] in sockets:
                count += 1
    return count


class Renews:
    """Every Lease write in a namespace, as an admin watch sees it: (arrival, name). One
    long watch request (so it adds nothing to the request counts of the window)."""

    def __init__(self, cp: ControlPlane, namespace: str) -> None:
        from kubernetes import client, config, watch

        api = client.CoordinationV1Api(config.new_client_from_config(
            config_file=str(cp.kubeconfig)))
        self.seen: list[tuple[float, str]] = []
        self._watch = watch.Watch()

        def follow() -> None:
            try:
                for event in self._watch.stream(api.list_namespaced_lease, namespace,
                                                timeout_seconds=3600, _request_timeout=3700):
                    self.seen.append((time.monotonic(), event["object"].metadata.name))
            except Exception:  # cut off when the row ends: nothing more to keep
                pass

        threading.Thread(target=follow, daemon=True).start()

    def stop(self) -> None:
        self._watch.stop()

    def gaps(self, since: float) -> list[float]:
        """Seconds between two writes of one Lease, for writes after ``since``."""
        last: dict[str, float] = {}
        gaps = []
        for at, name in list(self.seen):
            if at >= since and name in last:
                gaps.append(at - last[name])
            last[name] = at
        return gaps


def per_minute(before: dict[str, float], after: dict[str, float],
               seconds: float) -> dict[str, float]:
    return {verb: (after.get(verb, 0.0) - before.get(verb, 0.0)) * 60 / seconds
            for verb in sorted(set(after) | set(before))}


def baseline(cp: ControlPlane, seconds: float) -> dict[str, float]:
    """The apiserver's own requests on Leases a minute (its identity Lease in
    kube-system), with no sidecar running: subtracted from every row."""
    (before, _), t0 = lease_metrics(cp), time.monotonic()
    time.sleep(seconds)
    (after, _), elapsed = lease_metrics(cp), time.monotonic() - t0
    return per_minute(before, after, elapsed)


def measure(cp: ControlPlane, count: int, seconds: float, workdir: Path,
            own: dict[str, float]) -> dict[str, Any]:
    namespace = cp.create_namespace(f"names{count}")
    names = [f"n{i:02d}" for i in range(count)]
    kubeconfig = install_rbac(cp, namespace, tuple(f"lease-sidecar.{n}" for n in names))
    create_pods(cp, namespace, "pod-a")
    renews = Renews(cp, namespace)
    time.sleep(1.0)
    _, watching_before = lease_metrics(cp)  # ours, and the apiserver's own (kube-system)
    proc = SidecarProcess(workdir, f"pod-a-{count}", args=[
        "--backend", "kubernetes", "--name", ",".join(names), "--pod-label", "off"],
        env={"POD_NAME": "pod-a", "POD_NAMESPACE": namespace, "KUBECONFIG": str(kubeconfig)})
    try:
        started = time.monotonic()
        proc.start()
        proc.wait_http()
        wait_until(lambda: all(lease["holding"] for lease in get_json(
            proc.url + "/status", timeout=5)[1]["leases"]), timeout=120, interval=0.2)
        held = time.monotonic() - started
        time.sleep(SETTLE)
        assert proc.proc is not None
        pid, port = proc.proc.pid, int(cp.server.rsplit(":", 1)[1])
        (before, _), cpu_before, t0 = lease_metrics(cp), cpu_seconds(pid), time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        (after, watching), cpu_after = lease_metrics(cp), cpu_seconds(pid)
        rss, open_connections = rss_mib(pid), connections(pid, port)
        status = get_json(proc.url + "/status", timeout=5)[1]["leases"]
        gaps = renews.gaps(t0)
    finally:
        proc.stop()
        renews.stop()
    rates = {verb: round(max(0.0, rate - own.get(verb, 0.0)), 1)
             for verb, rate in per_minute(before, after, elapsed).items()}
    return {
        "names": count, "held_after_s": round(held, 1),
        "all_held_at_end": all(lease["holding"] for lease in status),
        "lost": sum(1 for lease in status for t in lease["transitions"]
                    if t["event"] != "acquired"),
        "rss_mib": rss, "cpu_percent": round((cpu_after - cpu_before) / elapsed * 100, 2),
        "connections": open_connections, "requests_per_min": rates,
        "watches_open": watching - watching_before,
        "renew_gap_s": {"n": len(gaps), "p50": round(statistics.median(gaps), 2),
                        "p99": round(pct(gaps, 99), 2), "max": round(max(gaps), 2)},
        "window_s": round(elapsed, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", default="1,8,64")
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    counts = [int(x) for x in args.names.split(",")]
    run = record.start(1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-names-") as tmp, ControlPlane() as cp:
        own = baseline(cp, args.seconds)
        print(f"the apiserver's own: {own}", file=sys.stderr)
        for count in counts:
            print(f"{count} names ...", file=sys.stderr)
            rows.append(measure(cp, count, args.seconds, Path(tmp), own))
            print(json.dumps(rows[-1]), file=sys.stderr)
        version = cp.version
    first, last = rows[0], rows[-1]
    extra = last["names"] - first["names"]
    per_name = {
        "rss_kib": round((last["rss_mib"] - first["rss_mib"]) * 1024 / extra) if extra
        else None,
        "cpu_percent": round((last["cpu_percent"] - first["cpu_percent"]) / extra, 3)
        if extra else None,
    }
    path = record.write("kube-names.json", run, {
        "kubernetes": version, "lease_duration_s": 15.0, "window_s": args.seconds,
        "apiserver_own_per_min": {verb: round(rate, 1) for verb, rate in own.items()},
        "rows": rows, "per_extra_name": per_name})
    for row in rows:
        print(json.dumps(row))
    print(f"per extra name: {per_name}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
