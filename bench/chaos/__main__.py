"""``python -m bench.chaos --backend sqlite --seed 1 --duration 120 [--faults ...]``

Runs the chaos harness once, prints the table, optionally writes ``--out STEM`` (.json
and .md), and exits 1 on any safety, liveness or fencing violation. Replay a failure
with the same ``--seed``, ``--duration`` and settings.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

from bench import record
from sidecar.base.clock import parse_duration
from testkit.chaos.backends import ChaosTiming, make_env
from testkit.chaos.faults import ALL_FAULTS
from testkit.chaos.harness import Config, Harness
from testkit.chaos.report import markdown, summarize


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n")[2])
    p.add_argument("--backend", default="sqlite",
                   choices=("sqlite", "postgres", "postgres-row", "kubernetes"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--duration", type=parse_duration, default=120.0,
                   help="seconds of fault injection (plus warm-up and a quiet tail)")
    p.add_argument("--max-faults", type=int, default=None,
                   help="stop injecting after this many faults (bounded by --duration)")
    p.add_argument("--faults", default=None,
                   help=f"comma-separated subset of {','.join(ALL_FAULTS)} "
                        "(default: every fault the backend supports)")
    p.add_argument("--sidecars", type=int, default=5)
    p.add_argument("--pg-connect", choices=("proxy", "multi-host"), default="proxy",
                   help="postgres backends: through a proxy per sidecar (network faults; a "
                        "failover silences the old primary's connections) or a multi-host "
                        "DSN naming primary and standby")
    p.add_argument("--leader-bias", type=float, default=0.5,
                   help="probability that a fault targets the current leader")
    p.add_argument("--lease-duration", type=parse_duration, default=ChaosTiming.lease_duration)
    p.add_argument("--renew-interval", type=parse_duration, default=ChaosTiming.renew_interval)
    p.add_argument("--renew-deadline", type=parse_duration, default=ChaosTiming.renew_deadline)
    p.add_argument("--claim-horizon", type=parse_duration, default=ChaosTiming.claim_horizon)
    p.add_argument("--safety-margin", type=parse_duration, default=None,
                   help="default 500ms; 1s on kubernetes, the least that backend accepts")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where sidecar logs and state go (default: a new temp dir)")
    p.add_argument("--out", type=Path, default=None,
                   help="write STEM.json and STEM.md (e.g. bench/results/chaos-sqlite)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    margin = (args.safety_margin if args.safety_margin is not None
              else ChaosTiming.default_margin(args.backend))
    timing = ChaosTiming(args.lease_duration, args.renew_interval, args.renew_deadline,
                    args.claim_horizon, margin)
    env = make_env(args.backend, timing, style=args.pg_connect)
    faults = tuple(args.faults.split(",")) if args.faults else env.faults
    config = Config(backend=args.backend, seed=args.seed, duration=args.duration,
                    faults=faults, sidecars=args.sidecars, max_faults=args.max_faults,
                    leader_bias=args.leader_bias, timing=timing, workdir=args.workdir)
    run = record.start(args.max_faults or 0)
    try:
        result = asyncio.run(Harness(config, env).run())
    except (ValueError, RuntimeError) as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 2
    summary = summarize(result, "python -m bench.chaos " + shlex.join(argv))
    print(markdown(summary))
    print(f"sidecar logs: {result.workdir}")
    if args.out:
        # A chaos run's trials are its faults: --max-faults bounds them, --duration too.
        run["trials"] = summary["faults_injected"]
        record.write(args.out.name + ".json", run, summary, args.out.with_suffix(".json"))
        args.out.with_suffix(".md").write_text(markdown(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
