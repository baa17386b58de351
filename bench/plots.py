"""The docs' benchmark pictures, drawn from the same results files as the tables
(``python -m bench.report`` calls ``draw_all``): a hand-over's timeline per backend, the
chaos runs' takeover latency by fault and backend, and the rollout hand-overs.

A picture whose results file lacks the data says so in the picture, so the page that
shows it never points at a missing file.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on CI machines
import matplotlib.pyplot as plt  # after choosing the backend
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from bench.record import REPO

IMAGES = REPO / "docs" / "images"
CHAOS_BACKENDS = ("sqlite", "postgres", "postgres-row", "kubernetes")
# The moments bench_handover records per trial, in the order they happen.
MOMENTS = (("old_last_claim_until", "old holder's last claim runs out", "tab:blue"),
           ("old_stepped_down", 'old holder released (its "stepped down" line)', "tab:gray"),
           ("new_acquired", 'new holder acquired (its "acquired lease" line)', "tab:orange"),
           ("new_first_claim", "new holder's first claim", "tab:green"))


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / name
    return json.loads(path.read_text()) if path.exists() else None


def _save(fig: Figure, out: Path, layout: bool = True) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    if layout:
        fig.tight_layout()
    # No version or date in the file: the same results draw the same bytes.
    fig.savefig(out, metadata={"Software": None})
    plt.close(fig)
    return out


def _missing(out: Path, what: str) -> Path:
    fig, ax = plt.subplots(figsize=(7, 1.6), dpi=100)
    ax.axis("off")
    ax.text(0.5, 0.5, f"Not measured yet: {what}", ha="center", va="center", wrap=True)
    return _save(fig, out)


def handover_timeline(results: Path, out: Path) -> Path:
    r = _load(results, "handover.json")
    backends = [b for b in ("sqlite", "postgres", "postgres-row", "kubernetes")
                if r and isinstance(r.get(b), dict) and r[b].get("timeline")]
    if not r or not backends:
        return _missing(out, "bench/results/handover.json has no per-trial timeline;\n"
                             "python -m bench run handover records it")
    moments = {b: {key: [t[key] * 1000 for t in r[b]["timeline"] if t.get(key) is not None]
                   for key, _, _ in MOMENTS} for b in backends}
    # The axis ends a little past the slowest backend's median first claim; a trial
    # beyond it is drawn at the edge and counted, so one outlier does not flatten the rest.
    edge = 1.6 * max(statistics.median(m["new_first_claim"] or [1.0])
                     for m in moments.values())
    fig, ax = plt.subplots(figsize=(9, 0.8 * len(backends) + 2.0), dpi=110)
    for row, backend in enumerate(reversed(backends)):
        medians = {}
        beyond = []
        for key, label, color in MOMENTS:
            seen = moments[backend][key]
            if not seen:
                continue
            medians[key] = statistics.median(seen)
            inside = [v for v in seen if v <= edge]
            beyond += [v for v in seen if v > edge]
            ax.scatter(inside, [row + 0.2] * len(inside), s=10, color=color, alpha=0.5)
            ax.plot([medians[key]] * 2, [row - 0.25, row + 0.25], color=color, lw=2.5,
                    label=label if row == 0 else None)
        if beyond:
            points = f"{len(beyond)} point{'s' if len(beyond) > 1 else ''}"
            ax.annotate(f"{points} beyond, up to {max(beyond):,.0f} ms →",
                        (edge, row - 0.2), ha="right", fontsize=7, color="dimgray")
        if "old_last_claim_until" in medians and "new_first_claim" in medians:
            ax.barh(row, medians["new_first_claim"] - medians["old_last_claim_until"],
                    left=medians["old_last_claim_until"], height=0.3, color="tab:red",
                    alpha=0.15, label="nobody claims (median)" if row == 0 else None)
    horizons = r.get("claim_horizon_ms") or {}

    def label(backend: str) -> str:
        horizon = horizons.get(backend, horizons.get("others"))
        return backend if horizon is None else f"{backend}\nclaim horizon {horizon:g} ms"

    ax.set_yticks(range(len(backends)), [label(b) for b in reversed(backends)])
    ax.set_xlabel("ms after POST /handover (lines: medians; dots: each trial)")
    ax.set_title("A hand-over, per backend (each at the claim horizon under its name)")
    ax.set_xlim(0, edge)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(fontsize=7, loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return _save(fig, out, layout=False)


def _timing_label(timing: dict[str, Any]) -> str:
    """A run's lease and claim horizon, as the docs write them."""
    def text(value: float) -> str:
        return f"{value * 1000:g} ms" if value < 1 else f"{value:g} s"

    return (f"lease {text(timing['lease_duration'])}, "
            f"claim horizon {text(timing['claim_horizon'])}")


def chaos_takeover(results: Path, out: Path) -> Path:
    """One panel per backend (its run's timing in the title), one box per fault kind, on
    a log axis: a hand-over of a hundred milliseconds and a takeover after a lease of
    seconds both stay readable, and one outlier does not flatten the rest."""
    runs = [r for b in CHAOS_BACKENDS if (r := _load(results, f"chaos-{b}.json"))]
    if not runs:
        return _missing(out, "no bench/results/chaos-*.json")
    columns = 2 if len(runs) > 1 else 1
    lines = -(-len(runs) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(10, 3.6 * lines), dpi=110,
                             sharey=True, squeeze=False)
    for ax, r in zip(axes.flat, runs, strict=False):
        rows = [x for x in r["rows"] if x["takeovers"]]
        data = [[t * 1000 for t in x["takeovers"]] for x in rows]
        ax.boxplot(data, whis=(1, 99), showfliers=True, flierprops={"markersize": 2})
        ax.set_xticks(range(1, len(rows) + 1),
                      [f"{x['kind']}\n(n={len(x['takeovers'])})" for x in rows], fontsize=7)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
        ax.set_title(f"{r['backend']} ({_timing_label(r['timing'])})", fontsize=9)
        ax.grid(axis="y", which="both", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("fault → a leader claims again (ms)", fontsize=8)
    for ax in list(axes.flat)[len(runs):]:
        ax.axis("off")
    fig.suptitle("Chaos runs: takeover after each fault (boxes p25-p75, whiskers p1-p99)",
                 fontsize=10)
    return _save(fig, out)


def rollout(results: Path, out: Path) -> Path:
    r = _load(results, "rollout.json")
    if not r:
        return _missing(out, "bench/results/rollout.json; python -m bench run rollout")
    configs = [(mode, strategy) for mode, by in r["results"].items() for strategy in by]
    labels = [f"{mode}\n{strategy}" for mode, strategy in configs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    most = max(max(r["results"][m][s]["handovers_per_rollout"]) for m, s in configs)
    bottom = [0] * len(configs)
    for count in range(1, most + 1):
        heights = [r["results"][m][s]["handovers_per_rollout"].count(count) for m, s in configs]
        left.bar(range(len(configs)), heights, bottom=bottom,
                 label=f"{count} hand-over{'s' if count > 1 else ''}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    left.set_xticks(range(len(configs)), labels, fontsize=7)
    left.set_ylabel("rollouts")
    left.set_title("Hand-overs per rolling restart")
    left.legend(fontsize=7)
    for i, (mode, strategy) in enumerate(configs):
        gaps = [g * 1000 for trial in r["raw"][mode][strategy] for g in trial["gaps"]]
        right.scatter([i] * len(gaps), gaps, s=12, alpha=0.6)
    right.set_xticks(range(len(configs)), labels, fontsize=7)
    right.set_ylabel("ms without a leader, per hand-over")
    right.set_title("Gap per hand-over")
    right.set_ylim(bottom=0)
    right.grid(axis="y", alpha=0.3)
    return _save(fig, out)


def draw_all(results: Path, images: Path = IMAGES) -> list[Path]:
    return [handover_timeline(results, images / "bench-handover-timeline.png"),
            chaos_takeover(results, images / "bench-chaos-takeover.png"),
            rollout(results, images / "bench-rollout.png")]
