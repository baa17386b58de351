"""Failover on the ``postgres`` backend (session advisory lock); prints figures, writes JSON.

    flock /tmp/lease-bench.lock python -m bench.bench_postgres_advisory [--trials 20]

Three real sidecar processes contend on a throw-away PostgreSQL (the test bed's
``PgServer``). Per trial one leader is signalled and replaced by a fresh process:

1. SIGKILL takeover, in two figures:
   - lock passing: SIGKILL → the standby's "acquired lease" log line (its JSON ``ts``);
     the session of a killed process ends at once, and a standby waiting inside
     ``pg_advisory_lock`` is granted the lock by the server;
   - published claim: SIGKILL → the standby's first ``200`` (lock passing plus the one
     ``claim_horizon`` the new holder waits before publishing).
2. SIGTERM handover: SIGTERM → the standby's first ``200`` (the old holder unpublishes,
   lets its outstanding claims run out, unlocks; the new one waits one horizon).

Targets: lock passing p50 ≤ 25 ms, p99 ≤ 100 ms; published claim p50 ≤ horizon + 50 ms,
p99 ≤ horizon + 150 ms.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
from pathlib import Path

from bench import record
from bench.failover import failover_trials, summary
from sidecar.base.clock import parse_duration
from testkit.testbed.postgres import PgServer


def contender_args(dsn: str, lease: float, renew: float, horizon: float) -> list[str]:
    return ["--backend", "postgres", "--dsn", dsn, "--name", "bench",
            "--lease-duration", f"{lease}s", "--renew-interval", f"{renew}s",
            "--renew-deadline", f"{lease * 2 / 3}s", "--claim-horizon", f"{horizon}s"]


def verdict(figures: dict[str, float], p50: float, p99: float) -> str:
    ok = figures["p50_ms"] <= p50 and figures["p99_ms"] <= p99
    return f"{'meets' if ok else 'MISSES'} p50 <= {p50:g} ms, p99 <= {p99:g} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--lease-duration", default="3s")
    parser.add_argument("--renew-interval", default="500ms")
    parser.add_argument("--claim-horizon", default="250ms")
    args = parser.parse_args()
    lease = parse_duration(args.lease_duration)
    renew = parse_duration(args.renew_interval)
    horizon = parse_duration(args.claim_horizon)
    horizon_ms = horizon * 1000
    run = record.start(args.trials)
    with tempfile.TemporaryDirectory(prefix="bench-pg-") as tmp, PgServer() as pg:
        workdir = Path(tmp)
        server_version = pg.psql("show server_version")
        common = contender_args(pg.dsn, lease, renew, horizon)
        # Let the standbys settle into their in-server wait, as in steady state.
        kill = failover_trials(signal.SIGKILL, args.trials, common, workdir, settle=0.3)
        term = failover_trials(signal.SIGTERM, args.trials, common, workdir, settle=0.3)
    result = {
        "backend": "postgres", "postgres": server_version, "lease_duration_s": lease,
        "renew_interval_s": renew, "claim_horizon_s": horizon,
        "sigkill_lock_passing": summary(kill["lease"]),
        "sigkill_published_claim": summary(kill["claim"]),
        "sigterm_handover_claim": summary(term["claim"]),
        "sigterm_lock_passing": summary(term["lease"]),
    }
    result["targets"] = {
        "sigkill_lock_passing": verdict(result["sigkill_lock_passing"], 25, 100),
        "sigkill_published_claim": verdict(result["sigkill_published_claim"],
                                           horizon_ms + 50, horizon_ms + 150),
    }
    out = record.write("postgres_advisory.json", run, result)
    print(f"postgres {server_version}, {args.trials} trials each, lease {lease:g}s, "
          f"renew {renew:g}s, horizon {horizon_ms:g} ms, {run['cores']} cores, "
          f"load average {run['loadavg_at_start']}")
    print(f"{'figure':<28}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}  target")
    for key in ("sigkill_lock_passing", "sigkill_published_claim", "sigterm_handover_claim",
                "sigterm_lock_passing"):
        row = result[key]
        print(f"{key:<28}{row['p50_ms']:>10}{row['p99_ms']:>10}{row['max_ms']:>10}  "
              f"{result['targets'].get(key, '')}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
