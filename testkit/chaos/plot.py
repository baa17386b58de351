"""``python -m testkit.chaos.plot RESULT.json ... -o takeover.png``

One box per backend and fault kind: takeover latency (fault injected → a leader claims
again), from the ``takeovers`` of each result file written by ``python -m bench.chaos``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI machines
import matplotlib.pyplot as plt  # after choosing the backend


def plot(results: list[dict], out: Path) -> None:
    labels, data = [], []
    for result in results:
        for row in result["rows"]:
            if row["takeovers"]:
                labels.append(f"{result['backend']}\n{row['kind']}\n(n={len(row['takeovers'])})")
                data.append([t * 1000 for t in row["takeovers"]])
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(data) + 2), 5), dpi=120)
    ax.boxplot(data, whis=(1, 99), showfliers=True, flierprops={"markersize": 2})
    ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=8)
    ax.set_ylabel("takeover latency (ms): fault → a leader claims again")
    ax.set_title("Chaos: takeover latency by backend and fault (whiskers p1-p99)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, metadata={"Software": None})  # the same results, the same bytes
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testkit.chaos.plot")
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("-o", "--out", type=Path,
                        default=Path("docs/images/bench-chaos-takeover.png"))
    args = parser.parse_args(argv)
    plot([json.loads(p.read_text()) for p in args.results], args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
