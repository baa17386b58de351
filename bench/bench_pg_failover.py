"""PostgreSQL failover: no two leaders, tokens that only grow, and the gap it costs.

``python -m bench.bench_pg_failover [--failovers 10] [--backends postgres,postgres-row]
[--styles multi-host,proxy]``

Per backend and connection style, a real primary with an asynchronous streaming standby
(:class:`~testkit.testbed.pg_failover.PgFailover`) and three real sidecars, driven by the
chaos harness with only the ``failover`` fault. Each failover: the standby stops
receiving WAL (lag); the lease is handed over (``POST /release``) once or twice during
the lag, so the tokens of those terms never reach the standby; then the primary is
killed (``-m immediate``) and the standby promoted 0.1 to 0.5 s later. ``multi-host``:
sidecars use ``postgresql://…@h:p1,h:p2/db?target_session_attrs=read-write``;
``proxy``: each sidecar goes through a TCP proxy that first silences every open
connection to the old primary for good (its host dropped off the network), then points
at the promoted server.

The recorder polls every sidecar's ``GET /leader`` and leader file (≤ 10 ms) and judges:
overlapping published claims (must be 0), fencing (each new term's token larger than
every earlier one, none handed out twice), and per failover the *leaderless gap*: from
the end of the last claim before the first claim on the new timeline to that claim, and
the time from promotion to that claim. Prints a table and writes
``bench/results/pg-failover.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path
from typing import Any

from bench import record
from bench.failover import summary
from testkit.chaos.backends import ChaosTiming, make_env
from testkit.chaos.failover import gaps, token_problems
from testkit.chaos.harness import Config, Harness, Result


async def run_one(backend: str, style: str, failovers: int, seed: int,
                  timing: ChaosTiming) -> tuple[Result, dict[str, Any]]:
    env = make_env(backend, timing, style=style)
    config = Config(backend=backend, seed=seed, duration=3600.0, faults=("failover",),
                    sidecars=3, max_faults=failovers, timing=timing)
    result = await Harness(config, env).run()
    measured = gaps(result)
    verdict = result.verdict
    report = {
        "backend": backend, "style": style, "failovers": len(result.faults),
        "timelines": [f.params.get("timeline") for f in result.faults],
        "handovers_during_lag": sum(g["handovers_during_lag"] for g in measured),
        "overlaps": len(verdict.overlaps),
        "overlap_ms": round(sum(o.length for o in verdict.overlaps) * 1000, 1),
        "token_problems": token_problems(result.recorder.spans),
        "violations": verdict.violations,
        "terms": len({(s.identity, s.token) for s in result.recorder.spans}),
        "log_tracebacks": sum(m.process.logs().count("Traceback") for m in result.members),
        "leaderless_gap": summary([g["leaderless"] for g in measured]) if measured else None,
        "promotion_to_claim": (summary([g["promotion_to_claim"] for g in measured])
                               if measured else None),
        "logs": str(result.workdir),
    }
    return result, report


def line(report: dict[str, Any]) -> str:
    gap, promo = report["leaderless_gap"] or {}, report["promotion_to_claim"] or {}
    return (f"| {report['backend']} | {report['style']} | {report['failovers']} | "
            f"{report['handovers_during_lag']} | {report['overlaps']} | "
            f"{len(report['token_problems'])} | {report['log_tracebacks']} | "
            f"{gap.get('p50_ms')} / {gap.get('p99_ms')} / {gap.get('max_ms')} | "
            f"{promo.get('p50_ms')} / {promo.get('max_ms')} |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.bench_pg_failover")
    p.add_argument("--failovers", type=int, default=10)
    p.add_argument("--backends", default="postgres,postgres-row")
    p.add_argument("--styles", default="multi-host,proxy")
    p.add_argument("--seed", type=int, default=18)
    p.add_argument("--out", type=Path, default=None,
                   help="default: bench/results/pg-failover.json")
    args = p.parse_args(argv)
    run = record.start(args.failovers)
    timing = ChaosTiming()
    reports = []
    print("| backend | connection | failovers | handovers in lag | overlaps | token "
          "problems | tracebacks | leaderless gap ms p50 / p99 / max | promotion → claim ms "
          "p50 / max |")
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for backend in args.backends.split(","):
        for style in args.styles.split(","):
            _, report = asyncio.run(run_one(backend, style, args.failovers, args.seed,
                                            ChaosTiming.for_backend(backend)))
            reports.append(report)
            print(line(report), flush=True)
    ok = all(r["overlaps"] == 0 and not r["token_problems"] and not r["violations"]
             and r["failovers"] >= args.failovers and r["log_tracebacks"] == 0
             for r in reports)
    out = record.write("pg-failover.json", run, {
        "command": "python -m bench.bench_pg_failover " + shlex.join(argv),
        "timing": vars(timing), "ok": ok, "runs": reports}, args.out)
    print(f"{'PASS' if ok else 'FAIL'}; written {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
