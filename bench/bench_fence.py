"""The fencing guard: the zombie leader on every backend, and what the guard costs.

    flock /tmp/lease-bench.lock python -m bench.bench_fence [--zombie-writes 10000]
        [--rounds 6 --seconds 3] [--only zombie|cost] [--backends postgres,...]

Starts a throw-away PostgreSQL (and PgBouncer, and kube-apiserver + etcd for the
kubernetes backend) from the test bed; writes bench/results/fence.json.

- **zombie** (testkit/fence_zombie.py): on ``postgres``, ``postgres-row``, ``postgres-row``
  with both the lease and the application's writes through PgBouncer transaction pooling,
  and ``kubernetes``: the leader's app writes continuously; the leader (sidecar and app) is
  SIGSTOPped for twice the lease duration (3 s leases) right after its app checked its
  claim; the other sidecar takes over and its app writes; the old leader is resumed and
  its app fires ``--zombie-writes`` writes with its old token without checking again.
  Each setup runs with the guard and without it.
- **cost**: pgbench (C, so the client does not dominate), 8 connections, a single-row
  insert per transaction, with and without ``lease_fence`` in the same transaction, in
  alternating rounds of one run: throughput and per-transaction latency (p50, p99). The
  loss is judged on the median of the rounds' paired losses. Two anchors that are not
  guards: a function that only reads the guard's row (the floor of any guard run as a
  function), and an empty statement of its own (what a guard in its own statement costs
  before it does anything).
  Twice: with durable commits (``fsync=on``, PostgreSQL's default) and with the test
  bed's ``fsync=off`` (commits almost free: the guard's relative worst case).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import record
from bench.failover import pct
from testkit.fence_zombie import NAME, Setup, zombie_run
from testkit.support import SidecarProcess
from testkit.testbed.postgres import PgServer

LEASE_DURATION = 3.0
LEASE = ["--lease-duration", "3s", "--renew-interval", "500ms", "--renew-deadline", "2s"]
BACKENDS = ("postgres", "postgres-row", "postgres-row-pgbouncer", "kubernetes")
TARGET_LOSS = 0.10

BARE = """BEGIN;
INSERT INTO writes (writer, token, phase) VALUES ('bench', 5, 'cost');
END;
"""
GUARDED = """BEGIN;
SELECT "lease".lease_fence('bench', 5);
INSERT INTO writes (writer, token, phase) VALUES ('bench', 5, 'cost');
END;
"""
# The guard in the insert's own statement: no statement more than the bare transaction.
IN_STATEMENT = """BEGIN;
INSERT INTO writes (writer, token, phase)
SELECT 'bench', 5, 'cost' FROM "lease".lease_fence('bench', 5);
END;
"""
# Not a guard: a PL/pgSQL function that only reads the guard's row (no lock, no check
# that holds against a newer leader), in the insert's statement. What any guard run as a
# function in the database costs at least: the floor under the two rows above.
LOOKUP_ONLY_FUNCTION = """CREATE OR REPLACE FUNCTION "lease".bench_lookup_only(n text, t bigint)
RETURNS bigint LANGUAGE plpgsql AS $f$
DECLARE highest bigint;
BEGIN
    SELECT token INTO highest FROM "lease".lease_fence WHERE name = n;
    RETURN highest;
END $f$;"""
LOOKUP_ONLY = """BEGIN;
INSERT INTO writes (writer, token, phase)
SELECT 'bench', 5, 'cost' FROM "lease".bench_lookup_only('bench', 5);
END;
"""
# Not a guard either: an empty statement of its own in the bare transaction. What the
# guard in a statement of its own costs before it does anything (a round trip).
EXTRA_STATEMENT = """BEGIN;
SELECT 1;
INSERT INTO writes (writer, token, phase) VALUES ('bench', 5, 'cost');
END;
"""
SCRIPTS = {"bare": BARE, "guarded": GUARDED, "guarded_in_statement": IN_STATEMENT,
           "lookup_only": LOOKUP_ONLY, "extra_statement": EXTRA_STATEMENT}
COMPARED = ("guarded", "guarded_in_statement", "lookup_only", "extra_statement")


# -- zombie ---------------------------------------------------------------------------------
def sql_sidecar(backend: str, lease_dsn: str) -> Any:
    extra = ["--ensure-schema", "true"] if backend == "postgres-row" else []

    def make(workdir: Path, identity: str) -> SidecarProcess:
        return SidecarProcess(workdir, identity, args=[
            "--backend", backend, "--dsn", lease_dsn, "--name", NAME, *LEASE, *extra])

    return make


def kube_sidecar(namespace: str, kubeconfig: Path) -> Any:
    from testkit.kube_support import sidecar

    def make(workdir: Path, identity: str) -> SidecarProcess:
        return sidecar(workdir, identity, namespace, kubeconfig, "--pod-label", "off",
                       lease=NAME)

    return make


def zombie(pg: PgServer, backends: list[str], writes: int, workdir: Path) -> list[dict]:
    pg.create_database("app")
    app_dsn = pg.dsn_for("app")
    runs: list[dict] = []

    def both(setup: Setup) -> None:
        for guard in (True, False):
            run = zombie_run(setup, workdir / f"{setup.backend}-{setup.pooled}-{guard}",
                             guard, writes)
            print(json.dumps(run), flush=True)
            runs.append(run)

    for backend in backends:
        if backend in ("postgres", "postgres-row"):
            both(Setup(backend, app_dsn, sql_sidecar(backend, pg.dsn), LEASE_DURATION))
        elif backend == "postgres-row-pgbouncer":
            from testkit.testbed.pgbouncer import PgBouncer, version

            with PgBouncer(pg, pool_mode="transaction", pool_size=4) as bouncer:
                both(Setup("postgres-row", bouncer.dsn_for("app"),
                           sql_sidecar("postgres-row", bouncer.dsn_for(pg.dsn.rsplit("/")[-1])),
                           LEASE_DURATION, pooled=True,
                           details={"pgbouncer": version(), "pool_mode": "transaction"}))
        elif backend == "kubernetes":
            from testkit.kube_support import install_rbac
            from testkit.testbed.kube import ControlPlane

            with ControlPlane() as cp:
                ns = cp.create_namespace("fence")
                kubeconfig = install_rbac(cp, ns, (f"lease-sidecar.{NAME}",))
                both(Setup("kubernetes", app_dsn, kube_sidecar(ns, kubeconfig),
                           LEASE_DURATION, details={"kube_apiserver": cp.version}))
        else:
            raise SystemExit(f"bench_fence: unknown backend {backend!r}")
    return runs


# -- cost -----------------------------------------------------------------------------------
def pgbench(pg: PgServer, dsn: str, script: Path, seconds: float, logs: Path) -> dict:
    """One pgbench round: transactions per second and every transaction's latency (s)."""
    for old in logs.parent.glob(logs.name + "*"):
        old.unlink()
    result = subprocess.run(
        [str(pg.bindir / "pgbench"), "-n", "-M", "prepared", "-c", "8", "-j", "2",
         "-T", f"{seconds:g}", "-f", str(script), "-l", "--log-prefix", str(logs), dsn],
        capture_output=True, text=True, timeout=seconds + 60)
    if result.returncode != 0:
        raise SystemExit(f"pgbench failed: {result.stderr[-2000:]}")
    latencies = [int(line.split()[2]) / 1e6 for path in logs.parent.glob(logs.name + "*")
                 for line in path.read_text().splitlines()]
    return {"transactions": len(latencies), "seconds": seconds, "latencies": latencies}


def cost(pg: PgServer, rounds: int, seconds: float, workdir: Path) -> dict:
    dsn = pg.dsn_for("app")
    scripts = {name: workdir / f"{name}.sql" for name in SCRIPTS}
    for name, text in SCRIPTS.items():
        scripts[name].write_text(text)
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LOOKUP_ONLY_FUNCTION)
    out: dict[str, Any] = {"connections": 8, "pgbench_threads": 2, "rounds": rounds,
                           "seconds_per_round": seconds}
    for fsync in ("on", "off"):
        pg.psql(f"ALTER SYSTEM SET fsync = {fsync}")
        pg.psql("SELECT pg_reload_conf()")
        time.sleep(0.5)
        totals = {name: {"transactions": 0, "seconds": 0.0, "latencies": []}
                  for name in scripts}
        per_round = {name: [] for name in scripts}
        for index in range(rounds):
            # Alternate the order, so drift in the machine's load hits each alike.
            order = list(scripts) if index % 2 == 0 else list(scripts)[::-1]
            for name in order:
                got = pgbench(pg, dsn, scripts[name], seconds, workdir / f"log-{name}")
                total = totals[name]
                total["transactions"] += got["transactions"]
                total["seconds"] += got["seconds"]
                total["latencies"] += got["latencies"]
                per_round[name].append(got["transactions"] / got["seconds"])
        figures = {}
        for name, total in totals.items():
            lat = total["latencies"]
            figures[name] = {"tps": round(total["transactions"] / total["seconds"]),
                             "p50_ms": round(statistics.median(lat) * 1000, 3),
                             "p99_ms": round(pct(lat, 99) * 1000, 3),
                             "tps_per_round": [round(x) for x in per_round[name]]}
        bare = figures["bare"]
        for name in COMPARED:
            guarded = figures[name]
            guarded["throughput_loss"] = round(1 - guarded["tps"] / bare["tps"], 3)
            guarded["added_p50_ms"] = round(guarded["p50_ms"] - bare["p50_ms"], 3)
            guarded["added_p99_ms"] = round(guarded["p99_ms"] - bare["p99_ms"], 3)
            # Round by round (each pair ran side by side): the median of the paired
            # losses is what the target is judged on, since a drift in the machine's
            # load over the run moves the totals but hits both of a pair alike.
            losses = [1 - g / b for b, g in zip(per_round["bare"], per_round[name],
                                                  strict=True)]
            guarded["loss_per_round_median"] = round(statistics.median(losses), 3)
            guarded["meets_target"] = guarded["loss_per_round_median"] <= TARGET_LOSS
        out[f"fsync_{fsync}"] = figures
        print(json.dumps({f"fsync_{fsync}": figures}), flush=True)
    pg.psql("ALTER SYSTEM RESET fsync")
    pg.psql("SELECT pg_reload_conf()")
    out["target_throughput_loss"] = TARGET_LOSS
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zombie-writes", type=int, default=10_000)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--only", choices=("zombie", "cost"), default=None)
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    run = record.start(1)
    figures: dict[str, Any] = {"zombie_writes": args.zombie_writes,
                               "lease_duration_s": LEASE_DURATION}
    with tempfile.TemporaryDirectory(prefix="bench-fence-") as tmp, PgServer() as pg:
        workdir = Path(tmp)
        if args.only != "cost":
            figures["zombie"] = zombie(pg, backends, args.zombie_writes, workdir)
        else:
            pg.create_database("app")
        if args.only != "zombie":
            from testkit.fence_zombie import prepare_app_database

            prepare_app_database(pg.dsn_for("app"), guard=True)
            figures["cost"] = cost(pg, args.rounds, args.seconds, workdir)
            figures["cost"]["postgres_version"] = pg.psql("SHOW server_version")
    record.write("fence.json", run, figures)
    failed = [r for r in figures.get("zombie", []) if r["guard"] and (
        r["zombie_committed"] or r["new_leader_refused_or_failed"]
        or r["committed_out_of_token_order"])]
    if failed:
        print(f"bench_fence: the guard let stale writes through: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
