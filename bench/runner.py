"""Every benchmark, how to run it in full (the docs' figures) and quickly (a smoke run),
and what it needs from this host: ``python -m bench run [--quick] [NAME ...]``.

A full run writes ``bench/results/*.json`` on the current commit (``bench.record``); then
``python -m bench.report`` regenerates the tables and pictures in the docs. A quick run
uses a few trials and writes into a scratch directory (``LEASE_BENCH_RESULTS``), so it
checks that each benchmark still runs without replacing a figure. A benchmark whose
needs this host lacks is skipped with the reason; the run ends with a table of what ran,
what failed and what was skipped. Benchmarks run one at a time; on a shared machine wrap
the run in ``flock /tmp/lease-bench.lock`` so no other benchmark measures alongside.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.record import REPO, results_dir

CHAOS = ("--seed", "7", "--duration", "1500", "--max-faults", "1000")
CHAOS_QUICK = ("--seed", "7", "--duration", "20", "--max-faults", "8", "--sidecars", "3")


@dataclass(frozen=True)
class Bench:
    name: str
    module: str  # run as python -m MODULE
    full: tuple[str, ...]  # the trial counts the docs' figures use
    quick: tuple[str, ...]  # a smoke run: a few trials, seconds to a minute or two
    needs: tuple[str, ...] = ()  # keys of NEEDS
    writes: tuple[str, ...] = ()  # results files (under bench/results), for the report
    partly: tuple[str, ...] = ()  # keys of NEEDS without which part of it is left out


def _chaos(backend: str, needs: tuple[str, ...]) -> Bench:
    out = ("--out", "{results}/chaos-" + backend)
    return Bench(f"chaos-{backend}", "bench.chaos", ("--backend", backend, *CHAOS, *out),
                 ("--backend", backend, *CHAOS_QUICK, *out), needs,
                 (f"chaos-{backend}.json", f"chaos-{backend}.md"))


BENCHES: tuple[Bench, ...] = (
    Bench("core", "bench.bench_core", ("--trials", "20"),
          ("--trials", "2", "--wrk-seconds", "1", "--idle-seconds", "2"), (), ("core.json",),
          partly=("wrk",)),
    # Idle CPU and RSS of a leader and a standby on each backend, default timing. Two
    # minutes a backend: one 30 s window varied by ±0.03 % of a core, the margin to the goal.
    Bench("core_idle", "bench.bench_core",
          ("--only", "idle", "--idle-backends", "sqlite,postgres,postgres-row,kubernetes",
           "--idle-seconds", "120"),
          ("--only", "idle", "--idle-seconds", "2"), ("postgres", "apiserver"),
          ("core-idle.json",)),
    Bench("sqlite_commit", "bench.bench_sqlite_commit", ("--commits", "300"),
          ("--commits", "10"), (), ("sqlite-commit.json",)),
    Bench("metrics", "bench.bench_metrics", ("--scrapes", "200"), ("--scrapes", "10"), (),
          ("metrics.json",)),
    Bench("exec", "bench.bench_exec", ("--trials", "20"), ("--trials", "2"), (),
          ("exec.json",)),
    Bench("http_limits", "bench.bench_http_limits", ("--slowloris-limit", "30"),
          ("--waiters", "300", "--slowloris", "10", "--slowloris-limit", "8"), (),
          ("http-limits.json",)),
    Bench("longpoll", "bench.bench_longpoll", ("--minutes", "1", "--handovers", "10"),
          ("--minutes", "0.1", "--wait", "2", "--handovers", "2"), (), ("longpoll.json",)),
    Bench("postgres_advisory", "bench.bench_postgres_advisory", ("--trials", "20"),
          ("--trials", "2"), ("postgres",), ("postgres_advisory.json",)),
    Bench("postgres_row", "bench.bench_postgres_row", ("--trials", "20"),
          ("--trials", "2", "--seconds", "1", "--claim-horizon", "250ms"), ("postgres",),
          ("postgres_row.json",)),
    Bench("pgbouncer", "bench.bench_pgbouncer", ("--rounds", "5", "--trials", "10"),
          ("--rounds", "1", "--trials", "2"), ("postgres", "pgbouncer"), ("pgbouncer.json",)),
    Bench("pg_failover", "bench.bench_pg_failover", ("--failovers", "10"),
          ("--failovers", "1", "--backends", "postgres", "--styles", "proxy"), ("postgres",),
          ("pg-failover.json",)),
    Bench("handover", "bench.bench_handover", ("--trials", "10"), ("--trials", "2"),
          ("postgres", "apiserver"), ("handover.json",)),
    Bench("kubernetes", "bench.bench_kubernetes", ("--trials", "20"), ("--trials", "2"),
          ("apiserver",), ("kubernetes.json",)),
    Bench("kube_names", "bench.bench_kube_names", ("--names", "1,8,64", "--seconds", "60"),
          ("--names", "1,2", "--seconds", "5"), ("apiserver",), ("kube-names.json",)),
    Bench("kubernetes_foreign", "bench.bench_kubernetes_foreign", ("--trials", "10"),
          ("--trials", "2"), ("apiserver",), ("kubernetes-foreign.json",)),
    # An even number of rounds and kills: the run ends with a sidecar leading, whose stop
    # lets the last client-go standby claim (the benchmark checks that every contender did).
    Bench("clientgo_interop", "bench.bench_clientgo_interop", ("--rounds", "20", "--kills", "4"),
          ("--rounds", "2", "--kills", "2"), ("apiserver", "go"), ("clientgo-interop.json",)),
    Bench("lean", "bench.bench_lean", ("--trials", "10", "--groups", "5,10,20"),
          ("--trials", "2", "--groups", "5"), ("postgres", "apiserver", "go"), ("lean.json",)),
    Bench("pods", "bench.bench_pods", ("--trials", "10"), ("--trials", "1"), ("pods",),
          ("pods-kubernetes.json",)),
    Bench("pods_postgres", "bench.bench_pods", ("--trials", "10", "--backend", "postgres"),
          ("--trials", "1", "--backend", "postgres"), ("pods", "postgres"),
          ("pods-postgres.json",)),
    Bench("pods_postgres_row", "bench.bench_pods",
          ("--trials", "10", "--backend", "postgres-row"),
          ("--trials", "1", "--backend", "postgres-row"), ("pods", "postgres"),
          ("pods-postgres-row.json",)),
    # The zombie leader on every backend (10,000 stale writes each, with and without the
    # guard) and the guard's cost under pgbench.
    Bench("fence", "bench.bench_fence", ("--zombie-writes", "10000"),
          ("--zombie-writes", "200", "--backends", "postgres-row", "--rounds", "1",
           "--seconds", "1"), ("postgres", "pgbouncer", "apiserver"), ("fence.json",)),
    # The deterministic simulator: 10^6 faults over the five backends, as scripts/test runs.
    Bench("simulation", "bench.bench_simulation", ("--faults", "1000000"),
          ("--faults", "5000", "--chunk", "1000"), (), ("simulation.json",)),
    # A shard set of 256 shards on 3 -> 4 -> 8 -> 3 members, and one member's round
    # trips per renew interval for 16, 256 and 1,024 shards, on every backend.
    Bench("shards", "bench.bench_shards", ("--trials", "2"),
          ("--trials", "1", "--shards", "24", "--cost", "16", "--backends",
           "sqlite,postgres-row,postgres,kubernetes"), ("postgres", "apiserver"),
          ("shards.json",)),
    # A rolling update of 4 members holding 256 shards: the assignment alone, and real
    # sidecars on SQLite (not pods).
    Bench("shards_rollout", "bench.bench_shards", ("--only", "rollout", "--backends", "sqlite"),
          ("--only", "rollout", "--backends", "sqlite", "--shards", "24"), (),
          ("shards-rollout.json",)),
    Bench("image", "bench.bench_image", (), (), ("image",), ("image.json",)),
    Bench("rollout", "bench.bench_rollout", ("--trials", "10"), ("--trials", "1"), ("pods",),
          ("rollout.json",)),
    _chaos("sqlite", ()),
    _chaos("postgres", ("postgres",)),
    _chaos("postgres-row", ("postgres",)),
    _chaos("kubernetes", ("apiserver",)),
)
# Modules under bench/ that are helpers, not benchmarks (tests check every other one is
# in BENCHES).
HELPERS = ("bench.failover", "bench.record", "bench.runner", "bench.report", "bench.plots")


def _postgres() -> str | None:
    from testkit.testbed.postgres import find_bindir

    return None if find_bindir() else "PostgreSQL server binaries not under /usr/lib/postgresql"


def _pgbouncer() -> str | None:
    from testkit.testbed.pgbouncer import PgBouncerError, find_binary

    try:
        find_binary()
    except PgBouncerError as exc:
        return str(exc)
    return None


def _go() -> str | None:
    found = shutil.which("go") or os.access("/usr/local/go/bin/go", os.X_OK)
    return None if found else "no Go toolchain to build the test bed's Go tools"


def _apiserver() -> str | None:
    from testkit.testbed import gobuild

    # Look only: resolving the Kubernetes version builds it when nothing is cached, and
    # listing what this host can run must not start a half-hour build.
    built = all(any(gobuild.binary_path(tool, version).exists()
                    for version in gobuild.candidate_versions(tool))
                for tool in ("kube-apiserver", "etcd"))
    return None if built else _go()


def _wrk() -> str | None:
    return None if shutil.which("wrk") else "wrk not installed (apt-get install wrk)"


def _image() -> str | None:
    from testkit.testbed import image

    return image.unavailable_reason()


def _pods() -> str | None:
    from testkit.testbed import cluster, image

    return cluster.unavailable_reason() or image.unavailable_reason()


NEEDS: dict[str, Callable[[], str | None]] = {
    "postgres": _postgres, "pgbouncer": _pgbouncer, "go": _go, "apiserver": _apiserver,
    "pods": _pods, "image": _image, "wrk": _wrk}


def unmet(bench: Bench) -> str | None:
    """Why this host cannot run ``bench``, or None."""
    for need in bench.needs:
        reason = NEEDS[need]()
        if reason:
            return f"{need}: {reason}"
    return None


def left_out(bench: Bench) -> str | None:
    """What part of ``bench`` this host leaves out, and why, or None."""
    reasons = [f"{need}: {reason}" for need in bench.partly if (reason := NEEDS[need]())]
    return "; ".join(reasons) or None


def command(bench: Bench, quick: bool, results: Path) -> list[str]:
    args = bench.quick if quick else bench.full
    return [sys.executable, "-m", bench.module,
            *(a.replace("{results}", str(results)) for a in args)]


def select(names: list[str]) -> list[Bench]:
    known = {b.name: b for b in BENCHES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"bench: unknown benchmark {', '.join(unknown)} "
                         f"(known: {', '.join(known)})")
    return [known[n] for n in names] if names else list(BENCHES)


def run(benches: list[Bench], quick: bool, results: Path) -> list[tuple[str, str, str]]:
    """Run each benchmark in turn; (name, outcome, detail) per benchmark."""
    env = {**os.environ, "LEASE_BENCH_RESULTS": str(results),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    outcomes = []
    for bench in benches:
        reason = unmet(bench)
        if reason:
            outcomes.append((bench.name, "skipped", reason))
            print(f"==> {bench.name}: skipped ({reason})", flush=True)
            continue
        cmd = command(bench, quick, results)
        partial = left_out(bench)
        print(f"==> {bench.name}: {' '.join(cmd[1:])}"
              + (f" (partly: {partial})" if partial else ""), flush=True)
        started = time.monotonic()
        code = subprocess.run(cmd, cwd=REPO, env=env).returncode
        took = f"{time.monotonic() - started:.0f} s"
        outcomes.append((bench.name, "ok" if code == 0 else f"failed (exit {code})",
                         took + (f"; left out {partial}" if partial else "")))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    run_p = sub.add_parser("run", help="run benchmarks (all by default)")
    run_p.add_argument("--quick", action="store_true",
                       help="a few trials each, results into a scratch directory")
    run_p.add_argument("--results", type=Path, default=None,
                       help="where results go (default: bench/results; --quick: a temp dir)")
    run_p.add_argument("names", nargs="*", metavar="NAME")
    sub.add_parser("list", help="every benchmark, its full command and what it needs")
    args = parser.parse_args(argv)
    if args.verb == "list":
        for bench in BENCHES:
            reason, partial = unmet(bench), left_out(bench)
            where = results_dir()
            shown = where.relative_to(REPO) if where.is_relative_to(REPO) else where
            full = " ".join(command(bench, False, shown)[2:])
            print(f"{bench.name:<20} python -m {full}"
                  + (f"\n{'':<20} (skipped here: {reason})" if reason else "")
                  + (f"\n{'':<20} (partly here: {partial})" if partial else ""))
        print(f"helpers, not benchmarks: {' '.join(HELPERS)}")
        return 0
    benches = select(args.names)
    results = args.results or (Path(tempfile.mkdtemp(prefix="bench-quick-")) if args.quick
                               else results_dir())
    outcomes = run(benches, args.quick, results)
    print(f"\nresults in {results}")
    for name, outcome, detail in outcomes:
        print(f"  {name:<20} {outcome:<18} {detail}")
    return 1 if any(o.startswith("failed") for _, o, _ in outcomes) else 0
