"""Both PostgreSQL backends through a real PgBouncer; prints figures, writes JSON.

    flock /tmp/lease-bench.lock python -m bench.bench_pgbouncer [--rounds 5] [--trials 10]

A throw-away PostgreSQL (the test bed's ``PgServer``) and Debian's ``pgbouncer`` in front
of it (``testkit.testbed.pgbouncer``). Every sidecar's ``GET /leader`` is sampled about every
10 ms on this process's one clock; a ``200`` is a claim from ``max(request sent,
valid_until - claim horizon)`` (the earliest it can have been handed out) up to its
``valid_until``, and an overlap is two sidecars' claims covering one instant.

1. ``postgres`` (advisory lock), ``pool_mode=transaction``, pool sizes 1 and 5, 2 and 3
   sidecars started together, ``--rounds`` rounds each: samples, claims, overlaps, how
   many sidecars refused (exit code 2 with the one log line) and how long until all had.
2. ``postgres``, ``pool_mode=session`` (pool 5, 3 sidecars) and ``postgres-row``,
   ``pool_mode=transaction`` (pools 1 and 5, 3 sidecars): ``--trials`` SIGTERM handovers
   (SIGTERM → another sidecar's first ``200``), the signalled sidecar replaced each time,
   with the overlaps over the whole run.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import record
from bench.failover import summary
from testkit.support import (
    SidecarProcess,
    claim_overlaps,
    get_json,
    one_leader,
    unix_time,
    wait_until,
)
from testkit.testbed.pgbouncer import PgBouncer, version
from testkit.testbed.postgres import PgServer

LEASE, RENEW, DEADLINE, HORIZON = 3.0, 0.3, 2.0, 0.25
TIMING = ["--lease-duration", f"{LEASE}s", "--renew-interval", f"{RENEW}s",
          "--renew-deadline", f"{DEADLINE}s", "--claim-horizon", f"{HORIZON}s"]


class Sampler:
    """One polling thread per sidecar (added as they start); claims on one clock."""

    def __init__(self) -> None:
        self.claims: list[tuple[str, float, float]] = []
        self.samples = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def add(self, proc: SidecarProcess) -> None:
        thread = threading.Thread(target=self._poll, args=(proc,), daemon=True)
        self._threads.append(thread)
        thread.start()

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)

    def _poll(self, proc: SidecarProcess) -> None:
        while not self._stop.is_set() and proc.proc is not None and proc.proc.poll() is None:
            sent = time.time()
            status, body, _ = get_json(proc.url + "/leader", timeout=0.5)
            with self._lock:
                self.samples += 1
                if status == 200:
                    until = unix_time(body["valid_until"])
                    # Handed out after the send and at most one horizon before its end.
                    self.claims.append((proc.identity, max(sent, until - HORIZON), until))
            time.sleep(0.01)

    def overlaps(self) -> int:
        return len(claim_overlaps(self.claims))


def sidecar(workdir: Path, identity: str, backend: str, dsn: str) -> SidecarProcess:
    return SidecarProcess(workdir, identity, args=["--backend", backend, "--dsn", dsn,
                                                   "--name", "bench", *TIMING]).start()


def refusal_rounds(pg: PgServer, workdir: Path, pool: int, count: int,
                   rounds: int) -> dict:
    sampler = Sampler()
    refused = started = 0
    refusal_times: list[float] = []
    for r in range(rounds):
        dbname = f"tx_{pool}_{count}_{r}"
        pg.create_database(dbname)
        with PgBouncer(pg, "transaction", pool) as bouncer:
            t0 = time.monotonic()
            procs = [sidecar(workdir, f"tx{pool}-{count}-{r}-{i}", "postgres",
                             bouncer.dsn_for(dbname)) for i in range(count)]
            for proc in procs:
                sampler.add(proc)
            started += count
            try:
                wait_until(lambda ps=procs: all(p.proc.poll() is not None for p in ps),
                           timeout=20)
                refusal_times.append(time.monotonic() - t0)
            except TimeoutError:
                pass
            for proc in procs:
                code = proc.stop()
                refused += code == 2 and "a transaction pooler is in the way" in proc.logs()
    sampler.close()
    return {"pool_size": pool, "sidecars": count, "rounds": rounds, "samples": sampler.samples,
            "claims": len(sampler.claims), "overlaps": sampler.overlaps(),
            "refused": f"{refused}/{started}",
            "start_to_all_refused": summary(refusal_times) if refusal_times else None}


def handover_trials(pg: PgServer, workdir: Path, backend: str, mode: str, pool: int,
                    trials: int, count: int = 3) -> dict:
    dbname = f"ho_{backend.replace('-', '_')}_{mode}_{pool}"
    pg.create_database(dbname)
    sampler = Sampler()
    took: list[float] = []
    bad_exits: list[str] = []
    with PgBouncer(pg, mode, pool) as bouncer:
        dsn = bouncer.dsn_for(dbname)
        if backend == "postgres-row":
            subprocess.run([sys.executable, "-m", "sidecar", "schema", "--backend", backend,
                            "--dsn", dsn, "--apply"], check=True, capture_output=True,
                           timeout=60)
        procs = [sidecar(workdir, f"{backend}-{mode}{pool}-{i}", backend, dsn)
                 for i in range(count)]
        try:
            for proc in procs:
                proc.wait_http()
                sampler.add(proc)
            for trial in range(trials):
                leader = wait_until(lambda: one_leader(procs, timeout=0.5), timeout=30)
                others = [p for p in procs if p is not leader]
                time.sleep(1.0)  # standbys in their steady state
                t0 = time.monotonic()
                leader.signal(signal.SIGTERM)
                wait_until(lambda rest=others: one_leader(rest, timeout=0.5), timeout=30,
                           interval=0.002)
                took.append(time.monotonic() - t0)
                try:
                    code = leader.proc.wait(15)
                except subprocess.TimeoutExpired:
                    code = None
                leader.stop()
                if code != 0:
                    bad_exits.append(f"{leader.identity}: {code}: {leader.logs()[-1500:]}")
                index = procs.index(leader)
                procs[index] = sidecar(workdir, f"{backend}-{mode}{pool}-{index}-{trial}",
                                       backend, dsn)
                procs[index].wait_http()
                sampler.add(procs[index])
        finally:
            sampler.close()
            for proc in procs:
                proc.stop()
    logs = "".join(path.read_text(errors="replace")
                   for path in workdir.glob(f"{backend}-{mode}{pool}-*.log"))
    return {"backend": backend, "pool_mode": mode, "pool_size": pool, "sidecars": count,
            "trials": trials, "samples": sampler.samples, "claims": len(sampler.claims),
            "overlaps": sampler.overlaps(), "sigterm_handover": summary(took),
            "prepared_statement_errors": logs.count("prepared statement"),
            "unclean_exits": bad_exits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    run = record.start(args.trials)
    with tempfile.TemporaryDirectory(prefix="bench-pgb-") as tmp, PgServer() as pg:
        workdir = Path(tmp)
        refusals = [refusal_rounds(pg, workdir, pool, count, args.rounds)
                    for pool in (1, 5) for count in (2, 3)]
        handovers = [handover_trials(pg, workdir, "postgres", "session", 5, args.trials),
                     handover_trials(pg, workdir, "postgres-row", "transaction", 1,
                                     args.trials),
                     handover_trials(pg, workdir, "postgres-row", "transaction", 5,
                                     args.trials)]
        server_version = pg.psql("show server_version")
    result = {"pgbouncer": version(), "postgres": server_version, "rounds": args.rounds,
              "lease_duration_s": LEASE, "renew_interval_s": RENEW,
              "renew_deadline_s": DEADLINE, "claim_horizon_s": HORIZON,
              "advisory_transaction_pooling": refusals, "handovers": handovers}
    out = record.write("pgbouncer.json", run, result)
    print(f"PgBouncer {result['pgbouncer']}, PostgreSQL {server_version}, load average "
          f"{run['loadavg_at_start']}")
    print("postgres (advisory) through pool_mode=transaction:")
    for row in refusals:
        took = row["start_to_all_refused"]
        print(f"  pool {row['pool_size']}, {row['sidecars']} sidecars x {row['rounds']}: "
              f"{row['samples']} samples, {row['claims']} claims, {row['overlaps']} overlaps, "
              f"refused {row['refused']}, start -> all refused p50/max "
              f"{took and took['p50_ms']}/{took and took['max_ms']} ms")
    print("SIGTERM handovers through the pooler:")
    for row in handovers:
        h = row["sigterm_handover"]
        print(f"  {row['backend']} {row['pool_mode']} pool {row['pool_size']}: "
              f"{row['trials']} trials, p50/p99 {h['p50_ms']}/{h['p99_ms']} ms, "
              f"{row['samples']} samples, {row['overlaps']} overlaps, "
              f"{row['prepared_statement_errors']} prepared-statement errors")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
