"""The deterministic simulator's figures: faults, simulated hours, wall time, violations
and how soon a leader came back, per backend. Writes results/simulation.json.

    python -m bench.bench_simulation [--faults 1000000] [--jobs 2]

The real elector, states and backend lease code run on a virtual clock against models of
each server (``testkit/sim``); a seeded scheduler injects pauses, crashes, partitions,
lost replies, clock steps, server restarts, failovers, ``pg_upgrade``, watch stalls and
hand edits; the checkers judge every claim handed out. ``scripts/test`` runs the same
number of faults and fails on any violation; this benchmark records the figures the docs
show (``docs/benchmarks.md``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench import record
from testkit.sim.__main__ import BACKENDS, simulate, summary


def main() -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"  # the runs' order of sets, as a replay has it
        os.execv(sys.executable, [sys.executable, "-m", "bench.bench_simulation",
                                  *sys.argv[1:]])
    parser = argparse.ArgumentParser()
    parser.add_argument("--faults", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=20_000)
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args()
    run = record.start(trials=1)
    started = time.perf_counter()
    results = simulate(BACKENDS, args.faults, args.chunk, args.jobs)
    wall = time.perf_counter() - started
    rows = [summary(results, backend) for backend in BACKENDS]
    for row in rows:
        print(f"{row['backend']:13} {row['faults']:>11,} faults  {row['simulated_h']:8.1f} h  "
              f"{row['violations']} violations  leader back p50 {row['recovery_p50_s']:.1f}s "
              f"max {row['recovery_max_s']:.1f}s")
    print(f"{sum(r['faults'] for r in rows):,} faults in {wall:.0f}s wall")
    record.write("simulation.json", run, {
        "faults_asked": args.faults, "chunk": args.chunk, "jobs": args.jobs,
        "wall_s": round(wall, 1), "backends": rows,
        "failed_seeds": [{"backend": r["backend"], "seed": r["seed"],
                          "violations": r["violations"][:3], "errors": r["errors"][:3]}
                         for r in results if r["violations"] or r["errors"]]})
    return 1 if any(r["violations"] or r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
