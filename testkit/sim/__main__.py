"""Run the deterministic simulation, or replay one seed step by step.

    python -m testkit.sim                                  # every backend, 10^6 faults in all
    python -m testkit.sim --faults 100000000               # the long mode
    python -m testkit.sim --backend postgres --seed 7 --faults 5000 --trace
    python -m testkit.sim ... --trace --trace-from 5300    # only the steps after t=5300s

Each run is one seed and ``--chunk`` faults; the runs are shared out over ``--jobs``
worker processes. A failure prints the command that replays it (the same seed, the same
faults, every step). Exit status 1 when any run found a violation or an error.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any

BACKENDS = ("sqlite", "postgres", "postgres-row", "sqlserver", "kubernetes")


def run_one(backend: str, seed: int, faults: int, trace: bool = False,
            trace_from: float = 0.0, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """One seeded run; what it found, as plain data."""
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
    return {"backend": backend, "seed": seed, "target": faults, "faults": result.faults,
            "simulated_s": result.simulated, "wall_s": time.perf_counter() - started,
            "claims": result.verdict.claims, "terms": result.verdict.terms,
            "excused": result.verdict.excused, "violations": result.verdict.violations,
            "errors": result.errors, "recoveries": result.verdict.recoveries,
            "by_kind": result.by_kind}


def simulate(backends: tuple[str, ...], faults: int, chunk: int = 20_000,
             jobs: int | None = None, seed: int | None = None) -> list[dict[str, Any]]:
    """``faults`` in all, shared out over ``backends``, in runs of ``chunk`` faults each
    (seeds 1000 x backend index + run); with ``seed``, one run of each backend."""
    if seed is not None:
        plan = [(b, seed, faults) for b in backends]
    else:
        per_backend = faults // len(backends)
        runs = max(1, per_backend // chunk)
        plan = [(b, 1000 * BACKENDS.index(b) + k, per_backend // runs)
                for b in backends for k in range(runs)]
    if len(plan) == 1:
        return [run_one(*plan[0])]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(run_one, *zip(*plan, strict=True)))


def summary(results: list[dict[str, Any]], backend: str) -> dict[str, Any]:
    """One backend's figures over its runs."""
    mine = [r for r in results if r["backend"] == backend]
    recoveries = sorted(x for r in mine for x in r["recoveries"])
    kinds: dict[str, int] = {}
    for r in mine:
        for kind, count in r["by_kind"].items():
            kinds[kind] = kinds.get(kind, 0) + count
    return {"backend": backend, "runs": len(mine), "faults": sum(r["faults"] for r in mine),
            "simulated_h": sum(r["simulated_s"] for r in mine) / 3600,
            "wall_s": sum(r["wall_s"] for r in mine),
            "claims": sum(r["claims"] for r in mine), "terms": sum(r["terms"] for r in mine),
            "excused": sum(r["excused"] for r in mine),
            "violations": sum(len(r["violations"]) for r in mine),
            "errors": sum(len(r["errors"]) for r in mine),
            "recovery_p50_s": statistics.median(recoveries) if recoveries else None,
            "recovery_max_s": recoveries[-1] if recoveries else None,
            "recoveries": len(recoveries), "by_kind": dict(sorted(kinds.items()))}


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
    args = parser.parse_args(argv)
    backends = tuple(args.backend or BACKENDS)
    started = time.perf_counter()
    if args.trace:
        results = [run_one(b, args.seed if args.seed is not None else 1, int(args.faults),
                           True, args.trace_from, tuple(args.exclude)) for b in backends]
    else:
        results = simulate(backends, int(args.faults), args.chunk, args.jobs, args.seed)
    wall = time.perf_counter() - started
    for backend in backends:
        s = summary(results, backend)
        print(f"{backend:13} {s['faults']:>11,} faults  {s['simulated_h']:8.1f} simulated h  "
              f"{s['runs']:>3} runs  {s['violations']} violations  {s['errors']} errors")
    failed = [r for r in results if r["violations"] or r["errors"]]
    for r in failed:
        print(f"\nFAILED {r['backend']} seed {r['seed']}:", *r["violations"][:5],
              *r["errors"][:3], sep="\n  ")
        # The run's own target: the schedule (phases, the quiet phase after the last
        # fault) depends on it, not only the faults injected before the violation.
        print(f"  replay: python -m testkit.sim --backend {r['backend']} --seed {r['seed']} "
              f"--faults {r['target']} --trace")
    print(f"\n{sum(r['faults'] for r in results):,} faults in {wall:.0f}s wall")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
