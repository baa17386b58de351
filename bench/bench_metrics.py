"""Cost of one ``GET /metrics`` scrape of a real sidecar (SQLite backend); prints figures.

    python -m bench.bench_metrics [--scrapes 200] [--leases 1]

Starts one sidecar, waits until it leads and has renewed, then scrapes ``/metrics``
over loopback ``--scrapes`` times in a row: the body's size and lines, and the round
trip's median and p99. Run from another checkout (``cd old && python -m
bench.bench_metrics``) to compare versions on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import record
from bench.failover import summary
from testkit.support import SidecarProcess, wait_until


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--leases", type=int, default=1)
    args = parser.parse_args()
    run = record.start(args.scrapes)
    workdir = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    names = ",".join(f"lease{i}" for i in range(args.leases))
    sidecar = SidecarProcess(workdir, "metrics", args=[
        "--dsn", str(workdir / "leases.sqlite3"), "--name", names,
        "--lease-duration", "3s", "--renew-interval", "300ms", "--renew-deadline", "2s"])
    sidecar.start()
    try:
        sidecar.wait_http()
        wait_until(lambda: sidecar.leader() == 200, 15)
        time.sleep(1.0)  # a few renews, so every histogram has seen something
        times = []
        body = b""
        for _ in range(args.scrapes):
            started = time.perf_counter()
            with urllib.request.urlopen(sidecar.url + "/metrics", timeout=10) as response:
                body = response.read()
            times.append((time.perf_counter() - started) * 1000)
    finally:
        sidecar.stop()
    times.sort()
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    print(f"leases {args.leases}: {len(body)} bytes, {len(body.splitlines())} lines; "
          f"scrape p50 {statistics.median(times):.2f} ms, p99 {p99:.2f} ms "
          f"(n={len(times)})")
    record.write("metrics.json", run, {
        "leases": args.leases, "body_bytes": len(body), "body_lines": len(body.splitlines()),
        "scrape": summary([t / 1000 for t in times])})


if __name__ == "__main__":
    main()
