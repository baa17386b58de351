"""Run the deterministic simulation, or replay one seed step by step.

    python -m testkit.sim                                  # every backend, 10^6 faults in all
    python -m testkit.sim --faults 100000000               # the long mode
    python -m testkit.sim --backend postgres --seed 7 --faults 5000 --trace
    python -m testkit.sim ... --trace --trace-from 5300    # only the steps after t=5300s

A failure prints the command that replays it. ``--out`` writes the results file the
docs' table is generated from.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

BACKENDS = ("sqlite", "postgres", "postgres-row", "sqlserver", "kubernetes")


def run_one(backend: str, seed: int, faults: int, trace: bool = False,
            trace_from: float = 0.0, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    logging.disable(logging.CRITICAL)  # the sidecar's own log lines: millions of them
    warnings.simplefilter("ignore")  # coroutines of killed processes, never awaited
    from testkit.sim.backends import SETUPS
    from testkit.sim.scenario import Run

    def show(line: str) -> None:
        if float(line.split(None, 1)[0]) >= trace_from:
            print(line, flush=True)

    started = time.perf_counter()
    run = Run(backend, seed, faults, SETUPS[backend], trace=show if trace else None,
              exclude=frozenset(exclude))
    result = run.execute()
    return {"backend": backend, "seed": seed, "faults": result.faults,
            "simulated_s": result.simulated, "wall_s": time.perf_counter() - started,
            "claims": result.verdict.claims, "terms": result.verdict.terms,
            "violations": result.verdict.violations, "errors": result.errors,
            "recoveries": result.verdict.recoveries, "by_kind": result.by_kind}


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        # String hashes order sets; a replay must see the same order as the run.
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "testkit.sim",
                                  *(sys.argv[1:] if argv is None else argv)])
    parser = argparse.ArgumentParser(prog="python -m testkit.sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", action="append", choices=BACKENDS,
                        help="a backend to simulate (repeatable; default: all)")
    parser.add_argument("--faults", type=float, default=1e6,
                        help="faults in all, shared out over the backends (default 10^6)")
    parser.add_argument("--seed", type=int, default=None,
                        help="replay this seed (one run per backend)")
    parser.add_argument("--chunk", type=int, default=20_000,
                        help="faults per run: each run is one seed (default 20000)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes")
    parser.add_argument("--trace", action="store_true", help="print every step")
    parser.add_argument("--trace-from", type=float, default=0.0,
                        help="print steps from this simulated second on")
    parser.add_argument("--exclude", action="append", default=[],
                        help="a fault kind to leave out (repeatable; for narrowing down)")
    parser.add_argument("--out", type=Path, help="write the summary as JSON")
    args = parser.parse_args(argv)
    backends = args.backend or list(BACKENDS)
    if args.seed is not None:
        jobs = [(b, args.seed, int(args.faults)) for b in backends]
    else:
        per_backend = int(args.faults) // len(backends)
        runs = max(1, per_backend // args.chunk)
        jobs = [(b, 1000 * i + k, per_backend // runs) for i, b in enumerate(backends)
                for k in range(runs)]
    started = time.perf_counter()
    if args.trace or len(jobs) == 1:
        results = [run_one(b, s, f, args.trace, args.trace_from, tuple(args.exclude))
                   for b, s, f in jobs]
    else:
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_one, b, s, f, False, 0.0, tuple(args.exclude))
                       for b, s, f in jobs]
            results = [f.result() for f in futures]
    wall = time.perf_counter() - started
    failed = [r for r in results if r["violations"] or r["errors"]]
    for backend in backends:
        mine = [r for r in results if r["backend"] == backend]
        faults = sum(r["faults"] for r in mine)
        hours = sum(r["simulated_s"] for r in mine) / 3600
        bad = sum(len(r["violations"]) for r in mine)
        print(f"{backend:13} {faults:>10,} faults  {hours:8.1f} simulated h  "
              f"{len(mine)} runs  {bad} violations")
    for r in failed:
        print(f"\nFAILED {r['backend']} seed {r['seed']}:", *r["violations"][:5],
              *r["errors"][:3], sep="\n  ")
        print(f"  replay: python -m testkit.sim --backend {r['backend']} --seed {r['seed']} "
              f"--faults {r['faults']} --trace")
    print(f"\n{sum(r['faults'] for r in results):,} faults in {wall:.0f}s wall")
    if args.out:
        args.out.write_text(json.dumps({"wall_s": wall, "runs": results}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
