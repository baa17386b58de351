"""Deliberate hand-over (``POST /handover?to=``): the named standby leads how soon, and
never beside the old leader.

    flock /tmp/lease-bench.lock python bench/bench_handover.py [--dsn URL] [--trials 10]
        [--backends sqlite,postgres,postgres-row]

Without ``--dsn`` it starts a throw-away PostgreSQL from the test bed. Per backend three
real ``lease-sidecar run`` processes (2 s lease, 300 ms renew interval, 100 ms claim
horizon); per trial, with both standbys in the race (the previous leader's sit-out is
waited out), the leader is asked to hand over to one of them picked at random, and the
time from the request to the named standby's first ``200`` on ``GET /leader`` is taken
(:mod:`testkit.handover`). A poller on every sidecar (~10 ms) counts overlapping claims
(must be 0). Target: the named standby leads within two claim horizons + one round trip
(200 ms + RTT here). Prints a table and writes ``bench/results/handover.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.failover import summary  # noqa: E402
from testkit.handover import BACKENDS, CLAIM_HORIZON, run_trials  # noqa: E402

RESULTS = REPO / "bench" / "results" / "handover.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    opts = parser.parse_args()
    backends = opts.backends.split(",")
    server = None
    dsn = opts.dsn
    if dsn is None and any(b != "sqlite" for b in backends):
        from testkit.testbed.postgres import PgServer

        server = PgServer().init()
        dsn = server.dsn
    results: dict[str, object] = {
        "trials": opts.trials, "claim_horizon_ms": CLAIM_HORIZON * 1000,
        "target": "named standby leads within 2 claim horizons + 1 round trip; 0 overlaps"}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-handover-") as workdir:
            for backend in backends:
                here = Path(workdir) / backend
                here.mkdir()
                where = str(here / "leases.db") if backend == "sqlite" else dsn
                assert where is not None
                run = run_trials(backend, where, here, opts.trials, cli_every=0)
                times = [t.seconds for t in run.trials]
                results[backend] = {
                    **summary(times), "overlapping_claims": run.overlaps,
                    "claims_seen": run.claims,
                    "named_standby_led": len(run.trials)}
                print(f"{backend:13} p50 {results[backend]['p50_ms']:7.1f} ms  "  # type: ignore[index]
                      f"p99 {results[backend]['p99_ms']:7.1f} ms  "  # type: ignore[index]
                      f"overlaps {run.overlaps}", flush=True)
    finally:
        if server is not None:
            server.destroy()
    print(json.dumps(results, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
