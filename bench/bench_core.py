"""Core benchmarks on the embedded SQLite backend; prints figures and writes JSON.

    python -m bench.bench_core [--trials 20] [--lease-duration 3s] [--wrk-seconds 10]

1. SIGTERM handover: SIGTERM to the leader → a standby holds the lease (its "acquired"
   log line) and → a standby answers 200 (its first published claim).
2. SIGKILL takeover: SIGKILL to the leader → a standby answers 200.
3. ``GET /leader`` under wrk, next to a bare aiohttp JSON handler measured in the same
   run (the anchor).
4. Idle RSS and CPU of a running leader and a running standby, default timing
   (``--idle-backends sqlite,postgres,postgres-row,kubernetes``: each on a real store).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench import record
from bench.failover import failover_trials, summary
from sidecar.base.clock import parse_duration
from testkit.support import SidecarProcess, free_port, get_json, wait_until


def fast_args(lease: float, horizon: float) -> list[str]:
    renew = max(0.2, lease / 10)
    return ["--lease-duration", f"{lease}s", "--renew-interval", f"{renew}s",
            "--renew-deadline", f"{lease * 0.75}s", "--safety-margin", f"{lease * 0.1}s",
            "--claim-horizon", f"{horizon}s"]


def failover(trials: int, lease: float, horizon: float, sig: signal.Signals,
             workdir: Path) -> dict[str, object]:
    db = workdir / f"failover-{sig.name}.db"
    args = ["--dsn", str(db), *fast_args(lease, horizon)]
    times = failover_trials(sig, trials, args, workdir, timeout=lease * 3)
    result: dict[str, object] = {"claim": summary(times["claim"])}
    if times["lease"]:
        result["lease"] = summary(times["lease"])
    return result


BARE_APP = """
import json, sys
from aiohttp import web
body = json.dumps({"leader": True, "lease": "default", "identity": "bench:1",
    "holder": "bench:1", "fencing_token": 1, "since": "2026-01-01T00:00:00.000Z",
    "valid_until": "2026-01-01T00:00:00.250Z", "role": "all"}).encode()
async def leader(request):
    return web.Response(body=body, content_type="application/json")
app = web.Application()
app.router.add_get("/leader", leader)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def wrk(url: str, seconds: int) -> dict[str, float]:
    out = subprocess.run(["wrk", "-t1", "-c32", f"-d{seconds}s", "--latency", url],
                         capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p99 = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[p99.group(2)]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {"requests_per_s": round(rps), "p99_ms": round(float(p99.group(1)) * scale, 2),
            "non_2xx": int(non2xx.group(1)) if non2xx else 0}


def http_load(seconds: int, workdir: Path) -> dict[str, object]:
    if not shutil.which("wrk"):
        return {"skipped": "wrk not installed (apt-get install wrk)"}
    port = free_port()
    bare = subprocess.Popen([sys.executable, "-c", BARE_APP, str(port)])
    proc = SidecarProcess(workdir, "http-bench",
                          args=["--dsn", str(workdir / "http.db")]).start()
    try:
        proc.wait_http()
        wait_until(lambda: proc.leader() == 200, timeout=20)
        wait_until(lambda: get_json(f"http://127.0.0.1:{port}/leader")[0] == 200, timeout=10)
        # Alternate the two so a noisy minute hurts both alike.
        rounds = {"bare_aiohttp": [], "sidecar": []}
        for _ in range(2):
            rounds["bare_aiohttp"].append(wrk(f"http://127.0.0.1:{port}/leader", seconds))
            rounds["sidecar"].append(wrk(proc.url + "/leader", seconds))
    finally:
        bare.terminate()
        bare.wait()
        proc.stop()
    best = {k: max(v, key=lambda r: r["requests_per_s"]) for k, v in rounds.items()}
    best["ratio"] = round(best["sidecar"]["requests_per_s"]
                          / best["bare_aiohttp"]["requests_per_s"], 3)
    return best


IDLE_BACKENDS = ("sqlite", "postgres", "postgres-row", "kubernetes")


def idle_usage(seconds: float, workdir: Path, backend: str = "sqlite") -> dict[str, object]:
    """Idle CPU and RSS of a leader and a standby with the default timing (15 s lease)."""
    # The chart mounts /run/lease as a memory-backed emptyDir; measure on tmpfs too
    # (/dev/shm) where there is one, since a disk write costs ~7x more here.
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        workdir = Path(tempfile.mkdtemp(prefix="lease-idle-", dir=shm))
    try:
        with idle_store(backend, workdir) as (args, env):
            result = _idle_pair(seconds, workdir, args, env)
        result["seconds"] = seconds
        result["state_dir_filesystem"] = "tmpfs" if str(workdir).startswith("/dev/shm") \
            else "disk"
        return result
    finally:
        if str(workdir).startswith("/dev/shm"):
            shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def idle_store(backend: str, workdir: Path) -> Iterator[tuple[list[str], dict[str, str]]]:
    """The flags and environment of a sidecar on ``backend``, with the store running:
    a file, a real PostgreSQL, or a real kube-apiserver (the label off: idle, it would
    only be written on the one transition)."""
    if backend == "sqlite":
        yield ["--dsn", str(workdir / "idle.db")], {}
    elif backend in ("postgres", "postgres-row"):
        from testkit.testbed.postgres import PgServer

        server = PgServer().init()
        try:
            args = ["--backend", backend, "--dsn", server.dsn]
            if backend == "postgres-row":
                subprocess.run([sys.executable, "-m", "sidecar", "schema", "--apply", *args],
                               check=True, capture_output=True)
            yield args, {}
        finally:
            server.destroy()
    elif backend == "kubernetes":
        from testkit.kube_support import install_rbac
        from testkit.testbed.kube import ControlPlane

        cp = ControlPlane()
        cp.start()
        try:
            ns = cp.create_namespace("idle")
            kubeconfig = install_rbac(cp, ns, ("lease-sidecar.default",))
            yield (["--backend", "kubernetes", "--pod-label", "off"],
                   {"KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": ns})
        finally:
            cp.stop()
    else:
        raise ValueError(f"no idle measurement for backend {backend!r}")


def _idle_pair(seconds: float, workdir: Path, args: list[str],
               env: dict[str, str]) -> dict[str, object]:
    leader = SidecarProcess(workdir, "idle-leader", args=args, env=env).start()
    standby = SidecarProcess(workdir, "idle-standby", args=args, env=env)
    try:
        leader.wait_http()
        wait_until(lambda: leader.leader() == 200, timeout=30)
        standby.start()
        standby.wait_http()
        time.sleep(2)
        ticks = os.sysconf("SC_CLK_TCK")
        before = {p.identity: _cpu_seconds(p.proc.pid, ticks) for p in (leader, standby)}
        time.sleep(seconds)
        result: dict[str, object] = {}
        for p in (leader, standby):
            used = _cpu_seconds(p.proc.pid, ticks) - before[p.identity]
            result[p.identity] = {"cpu_percent_of_core": round(100 * used / seconds, 3),
                                  "rss_mb": round(_rss_kb(p.proc.pid) / 1024, 1)}
        assert leader.leader() == 200, "the leader lost the lease while idle"
        return result
    finally:
        leader.stop()
        standby.stop()


def _cpu_seconds(pid: int, ticks: int) -> float:
    """CPU time of every thread of ``pid`` so far, to the nanosecond where the kernel keeps
    schedstat (an idle sidecar uses a few clock ticks a second: /proc/<pid>/stat's
    ``utime + stime`` would quantise a 30 s window to 0.033 % of a core)."""
    try:
        return sum(int(Path(task, "schedstat").read_text().split()[0])
                   for task in Path(f"/proc/{pid}/task").iterdir()) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--lease-duration", default="3s")
    parser.add_argument("--claim-horizon", default="250ms")
    parser.add_argument("--wrk-seconds", type=int, default=10)
    parser.add_argument("--idle-seconds", type=float, default=30)
    parser.add_argument("--only", choices=["failover", "http", "idle"], default=None)
    parser.add_argument("--idle-backends", default="sqlite",
                        help=f"comma-separated, of {', '.join(IDLE_BACKENDS)}; sqlite is "
                             "'idle', the others 'idle_<backend>' in the results")
    args = parser.parse_args()
    lease, horizon = parse_duration(args.lease_duration), parse_duration(args.claim_horizon)
    workdir = Path(tempfile.mkdtemp(prefix="lease-bench-"))
    run = record.start(args.trials)
    results: dict[str, object] = {"lease_duration_s": lease, "claim_horizon_s": horizon}
    if args.only in (None, "failover"):
        results["sigterm_handover"] = failover(args.trials, lease, horizon, signal.SIGTERM,
                                               workdir)
        print("SIGTERM handover", json.dumps(results["sigterm_handover"]), flush=True)
        results["sigkill_takeover"] = failover(args.trials, lease, horizon, signal.SIGKILL,
                                               workdir)
        print("SIGKILL takeover", json.dumps(results["sigkill_takeover"]), flush=True)
    if args.only in (None, "http"):
        results["http"] = http_load(args.wrk_seconds, workdir)
        print("GET /leader", json.dumps(results["http"]), flush=True)
    if args.only in (None, "idle"):
        for backend in args.idle_backends.split(","):
            key = "idle" if backend == "sqlite" else f"idle_{backend.replace('-', '_')}"
            results[key] = idle_usage(args.idle_seconds, workdir, backend)
            print(key, json.dumps(results[key]), flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    name = "core.json" if args.only is None else f"core-{args.only}.json"
    record.write(name, run, results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
