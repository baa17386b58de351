"""lease-sidecar next to client-go's own leader election on one Lease: handover times and
overlaps, per direction; prints a table and writes results/clientgo-interop.json.

    flock /tmp/lease-bench.lock python -m bench.bench_clientgo_interop [--rounds 20] [--kills 4]

The set-up of tests/integration/test_clientgo_interop.py (see
testkit/clientgo_support.py), with more rounds: one sidecar and one client-go
elector (LeaseLock, ReleaseOnCancel, retry 100 ms) at a time, 3 s leases, the sidecar on
its default safety margin (1 s) and claim horizon (250 ms). ``--rounds`` SIGTERM rounds,
then ``--kills`` SIGKILL rounds; holders alternate kinds, so each direction gets half.

Figures: signal → the new holder's first claim (a sidecar's first sampled ``200`` or
leader file; client-go's ``OnStartedLeading``), and every overlap of two contenders'
claims (must be none).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench import record
from bench.failover import summary
from testkit.clientgo_support import CLIENTGO_ARGS, OBJECT, Contest
from testkit.kube_support import install_rbac
from testkit.testbed import gobuild
from testkit.testbed.kube import ControlPlane


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="SIGTERM rounds")
    parser.add_argument("--kills", type=int, default=4, help="SIGKILL rounds")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/clientgo-interop.json")
    args = parser.parse_args()
    binary = gobuild.ensure_binary("clientgo-elector")
    run = record.start(args.rounds)
    with tempfile.TemporaryDirectory(prefix="bench-interop-") as tmp, ControlPlane() as cp:
        ns = cp.create_namespace("interop")
        contest = Contest(Path(tmp), ns, install_rbac(cp, ns, (OBJECT,)), binary)
        try:
            contest.start()
            for i, sig in enumerate([signal.SIGTERM] * args.rounds
                                    + [signal.SIGKILL] * args.kills):
                contest.round(sig)
                last = contest.takeovers[-1]
                print(f"  round {i + 1}: {last.signal} {last.direction} "
                      f"{last.seconds * 1000:.0f} ms", file=sys.stderr)
            time.sleep(0.5)
        finally:
            contest.stop()
        version = cp.version
        # Inside the block: the electors' event files live in the temporary directory.
        overlaps = contest.overlaps()
        terms = contest.tokens_by_term()
        claimed = {who: len(spans) for who, spans in contest.claims().items()}
    rows = {}
    for sig in ("SIGTERM", "SIGKILL"):
        for direction in ("sidecar->client-go", "client-go->sidecar"):
            times = [t.seconds for t in contest.takeovers
                     if t.signal == sig and t.direction == direction]
            if times:
                rows[f"{sig} {direction}"] = summary(times)
    tokens = [token for _, _, token in terms]
    # A run in which some leader's claims went unseen would prove nothing. (The contender
    # started in the last round is a standby at the end and never claims.)
    led = {t.old for t in contest.takeovers} | {t.new for t in contest.takeovers}
    assert led <= set(claimed), (sorted(led - set(claimed)), claimed)
    result = {
        "kubernetes": version, "kills": args.kills,
        "lease_duration_s": 3, "sidecar": "renew 500ms, safety margin 1s, horizon 250ms",
        "client_go": " ".join(CLIENTGO_ARGS),
        "signal_to_first_claim": rows,
        "overlaps": [{"a": a, "b": b, "ms": round(s * 1000, 1)} for a, b, s in overlaps],
        "fencing_tokens_grow": tokens == sorted(set(tokens)),
    }
    out = record.write("clientgo-interop.json", run, result, args.out)
    print(f"kube-apiserver {version}, client-go {gobuild.clientgo_version(version)}, "
          f"{run['cores']} cores, load average {run['loadavg_at_start']}")
    print(f"{'signal → first claim of the new holder':<40}{'n':>4}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'max ms':>9}")
    for key, row in rows.items():
        print(f"{key:<40}{row['n']:>4}{row['p50_ms']:>9}{row['p99_ms']:>9}{row['max_ms']:>9}")
    print(f"overlaps: {len(overlaps)}"
          + (f" (max {max(s for _, _, s in overlaps) * 1000:.1f} ms)" if overlaps else ""))
    print(f"fencing tokens grow: {result['fencing_tokens_grow']}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
