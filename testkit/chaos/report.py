"""Turns a run's result into the printed/markdown table and the JSON file."""

from __future__ import annotations

import statistics
from typing import Any

from testkit.chaos.checker import percentile
from testkit.chaos.harness import Result

HEADER = ("| backend | fault | faults | leader hits | overlaps | max overlap ms "
          "| max leaderless gap ms | bound ms | takeovers | p50 takeover ms "
          "| p99 takeover ms |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def rows_markdown(summary: dict[str, Any]) -> list[str]:
    lines = []
    for row in summary["rows"]:
        lines.append(
            f"| {summary['backend']} | {row['kind']} | {row['faults']} | {row['leader_hits']} "
            f"| {row['overlaps']} | {row['max_overlap'] * 1000:.1f} | {_ms(row['max_gap'])} "
            f"| {_ms(row['bound'])} | {len(row['takeovers'])} | {_ms(row['takeover_p50'])} "
            f"| {_ms(row['takeover_p99'])} |")
    return lines


def sampling(result: Result) -> dict[str, Any]:
    rec = result.recorder
    http = [p for s in rec.http_stats.values() for p in s.periods]
    files = rec.file_stats.periods
    return {
        "interval": rec.interval,
        "file_reads": rec.file_stats.count,
        "file_period_p50": percentile(files, 50), "file_period_p99": percentile(files, 99),
        "file_period_max": max(files, default=None),
        "http_requests": sum(s.count for s in rec.http_stats.values()),
        "http_period_p50": percentile(http, 50), "http_period_p99": percentile(http, 99),
        "claims_observed": len(rec.spans),
    }


def summarize(result: Result, command: str) -> dict[str, Any]:
    cfg, verdict = result.config, result.verdict
    return {
        "backend": cfg.backend,
        "command": command,
        "seed": cfg.seed,
        "duration": cfg.duration,
        "observed_seconds": round(result.end - result.begin, 3),
        "sidecars": cfg.sidecars,
        "timing": vars(cfg.timing),
        "faults_injected": len(result.faults),
        "restarts": sum(m.restarts for m in result.members),
        "ok": verdict.ok,
        "violations": verdict.violations,
        "notes": result.notes,
        "claimed_fraction": round(verdict.claimed_fraction, 5),
        "blind_gaps": len(verdict.blind),
        "blind_gap_max": max((g.length for g in verdict.blind), default=0.0),
        "blips": len(verdict.blips),
        "blip_max": max((g.length for g in verdict.blips), default=0.0),
        "overlaps": [vars(o) for o in verdict.overlaps],
        "longest_gaps": [vars(g) for g in sorted(verdict.gaps, key=lambda g: -g.length)[:20]],
        "rows": [row.to_json() for _, row in sorted(verdict.rows.items())],
        "sampling": sampling(result),
        "faults": [f.to_json() for f in result.faults],
        "workdir": str(result.workdir),
    }


def markdown(summary: dict[str, Any]) -> str:
    s = summary["sampling"]
    lines = [f"### Chaos: `{summary['backend']}`", "",
             f"Command: `{summary['command']}`", "",
             f"{summary['faults_injected']} faults, {summary['restarts']} sidecar restarts, "
             f"{summary['observed_seconds']:.0f} s observed, leader claimed "
             f"{summary['claimed_fraction'] * 100:.2f} % of the time; "
             f"sampling: file p50 {_ms(s['file_period_p50'])} ms / p99 "
             f"{_ms(s['file_period_p99'])} ms, HTTP p50 {_ms(s['http_period_p50'])} ms / p99 "
             f"{_ms(s['http_period_p99'])} ms per sidecar; {s['claims_observed']} claims; "
             f"{summary['blips']} unexplained blips (max {_ms(summary['blip_max'])} ms, "
             f"within one lease duration), {summary['blind_gaps']} blind gaps (recorder "
             f"stalled, max {_ms(summary['blind_gap_max'])} ms).", "",
             HEADER, *rows_markdown(summary), ""]
    all_takeovers = [t for row in summary["rows"] for t in row["takeovers"]]
    if all_takeovers:
        lines.append(f"All takeovers: median {_ms(statistics.median(all_takeovers))} ms, "
                     f"p99 {_ms(percentile(all_takeovers, 99))} ms.")
        lines.append("")
    verdict = "PASS" if summary["ok"] else "FAIL"
    lines.append(f"Verdict: **{verdict}** ({len(summary['violations'])} violations)")
    lines += [f"- {v}" for v in summary["violations"][:50]]
    if summary["notes"]:
        lines += ["", "Notes:", *[f"- {n}" for n in summary["notes"][:50]]]
    return "\n".join(lines) + "\n"
