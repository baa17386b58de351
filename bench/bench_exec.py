"""``lease-sidecar exec`` figures: what the guard costs and how fast a job really ends.

    python -m bench.bench_exec [--trials 10]

1. Guard overhead: spawn-to-exit of ``python -I -S exec_guard.py ... -- true`` against
   ``true`` started directly.
2. ``POST /release`` → ``exec`` has exited with every worker of ``sh -c 'w & w'`` gone.
3. SIGKILL of ``exec`` → every worker gone (workers exit on SIGTERM).
4. SIGKILL of ``exec`` with workers that ignore SIGTERM and ``--grace 60s`` → every worker
   gone; bounded by the lease validity + safety margin (lease 2 s here), not the grace.

Workers are gone when ``/proc/<pid>`` is gone or a zombie. Sqlite, lease 2 s, renew
300 ms, safety margin 300 ms, horizon 100 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench import record
from bench.failover import summary
from sidecar.cli import exec_supervise as supervise
from testkit.support import SidecarProcess, wait_until

FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]
WORKER = """
import os, signal, sys, time
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1], "a") as fh:
    fh.write(f"{os.getpid()}\\n")
while True:
    time.sleep(0.05)
"""


def gone(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return raw[raw.rfind(")") + 2:].split()[0] == "Z"


def guard_overhead(trials: int) -> dict[str, object]:
    direct, guarded = [], []
    for _ in range(trials):
        started = time.perf_counter()
        subprocess.run(["true"], check=True)
        direct.append(time.perf_counter() - started)
        read_end, write_end = os.pipe()
        started = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", str(supervise.GUARD_SCRIPT), str(read_end),
                        "1.0", "0.1", repr(time.monotonic() + 60), "--", "true"],
                       pass_fds=(read_end,), check=True)
        guarded.append(time.perf_counter() - started)
        os.close(read_end)
        os.close(write_end)
    return {"direct": summary(direct), "guarded": summary(guarded)}


def job_end(trials: int, how: str, workdir: Path) -> dict[str, object]:
    script = workdir / "worker.py"
    script.write_text(WORKER)
    mode = "stubborn" if how == "sigkill-stubborn" else "polite"
    times = []
    for trial in range(trials):
        pids = workdir / f"{how}-{trial}.pids"
        one = f"{sys.executable} {script} {pids} {mode}"
        proc = SidecarProcess(workdir, f"{how}-{trial}", command="exec", args=[
            "--dsn", str(workdir / f"{how}.db"), *FAST, "--grace", "60s", "--",
            "sh", "-c", f"{one} & {one}"]).start()
        try:
            proc.wait_http()
            wait_until(lambda pids=pids: pids.exists() and len(pids.read_text().split()) == 2,
                       timeout=20)
            workers = [int(p) for p in pids.read_text().split()]
            started = time.monotonic()
            if how == "release":
                request = urllib.request.Request(proc.url + "/release", method="POST")
                urllib.request.urlopen(request, timeout=5).close()
                assert proc.proc is not None
                proc.proc.wait(30)
            else:
                proc.signal(signal.SIGKILL)
            wait_until(lambda workers=workers: all(gone(p) for p in workers), timeout=30,
                       interval=0.002)
            times.append(time.monotonic() - started)
        finally:
            proc.stop()
    return summary(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    run = record.start(args.trials)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        results = {
            "guard_overhead": guard_overhead(args.trials * 2),
            "release_to_job_gone": job_end(args.trials, "release", workdir),
            "sigkill_to_job_gone": job_end(args.trials, "sigkill", workdir),
            "sigkill_stubborn_to_job_gone": job_end(args.trials, "sigkill-stubborn", workdir),
        }
    print(json.dumps(results, indent=2))
    record.write("exec.json", run, results)


if __name__ == "__main__":
    main()
