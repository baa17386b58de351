"""The docs' benchmark tables, generated from ``bench/results/*.json``, never typed.

    python -m bench.report            # rewrite every table block (and draw the pictures)
    python -m bench.report --check    # exit 1 naming each block that differs from its file

A block in any page (README.md, DEVELOPMENT.md, docs/*.md) is

    <!-- bench:NAME -->
    ...generated...
    <!-- /bench -->

where NAME is a key of ``TABLES``. Each table ends with the line that says which file,
commit, date and trial count it describes. A results file that names no commit (written
before ``bench/record.py`` recorded one), names uncommitted code (``+dirty``) or that no
table shows is refused: ``bench/results`` holds results of committed code that the docs
show, and nothing else (runs of earlier code are in the git history).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.record import REPO, RESULTS

Row = dict[str, Any]
BLOCK = re.compile(r"(<!-- bench:([a-z0-9-]+) -->\n)(.*?)(<!-- /bench -->)", re.S)


# -- formatting --------------------------------------------------------------------------
def ms(value: float | None) -> str:
    """Milliseconds as the docs write them: 9.4, 261, 3,321."""
    if value is None:
        return "—"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def p50_p99(s: Row | None, unit: str = " ms") -> str:
    return "—" if not s or "p50_ms" not in s else f"{ms(s['p50_ms'])} / {ms(s['p99_ms'])}{unit}"


def p50_max(s: Row | None, unit: str = " ms") -> str:
    return "—" if not s or "p50_ms" not in s else f"{ms(s['p50_ms'])} / {ms(s['max_ms'])}{unit}"


def n(s: Row | None) -> str:
    return "—" if not s else str(s["n"])


def table(header: list[str], rows: list[list[Any]], right: int = 1) -> list[str]:
    """A markdown table; columns from ``right`` on are right-aligned (figures)."""
    align = ["---" if i < right else "---:" for i in range(len(header))]
    return [f"| {' | '.join(header)} |", f"|{'|'.join(align)}|",
            *(f"| {' | '.join(str(c) for c in row)} |" for row in rows)]


# -- the tables --------------------------------------------------------------------------
def core(r: Row) -> list[str]:
    term, kill = r["sigterm_handover"], r["sigkill_takeover"]
    return table(["figure", "p50 / p99", "n"], [
        ["SIGTERM → the standby holds the lease (its `acquired lease` line)",
         p50_p99(term["lease"]), n(term["lease"])],
        ["SIGTERM → first claim of the new leader", p50_p99(term["claim"]), n(term["claim"])],
        ["SIGKILL → the standby holds the lease", p50_p99(kill["lease"]), n(kill["lease"])],
        ["SIGKILL → first claim of the new leader", p50_p99(kill["claim"]), n(kill["claim"])],
    ])


def core_costs(r: Row) -> list[str]:
    rows = []
    http = r.get("http") or {}
    if "sidecar" in http:
        side, bare = http["sidecar"], http["bare_aiohttp"]
        rows.append(["`GET /leader`, wrk, 1 thread and 32 connections",
                     f"{side['requests_per_s']:,} req/s, p99 {side['p99_ms']} ms; bare aiohttp "
                     f"in the same run {bare['requests_per_s']:,} req/s, p99 {bare['p99_ms']} ms "
                     f"(ratio {http['ratio']:.2f})"])
    elif http:
        rows.append(["`GET /leader` under wrk", f"not measured: {http.get('skipped')}"])
    idle = r.get("idle")
    if idle:
        lead, stand = idle["idle-leader"], idle["idle-standby"]
        where = idle.get("state_dir_filesystem", "disk")
        rows += [[f"idle RSS, leader / standby (over {idle['seconds']:g} s)",
                  f"{lead['rss_mb']} / {stand['rss_mb']} MB"],
                 [f"idle CPU, leader / standby (state directory on {where})",
                  f"{lead['cpu_percent_of_core']:.2f} % / {stand['cpu_percent_of_core']:.2f} % "
                  "of a core"]]
    return table(["figure", "value"], rows, right=2)


def core_idle(r: Row) -> list[str]:
    """bench_core --only idle: a leader and a standby per backend, default timing."""
    rows = []
    for key, backend in (("idle", "sqlite"), ("idle_postgres", "postgres"),
                         ("idle_postgres_row", "postgres-row"),
                         ("idle_kubernetes", "kubernetes")):
        idle = r.get(key)
        if not idle:
            continue
        lead, stand = idle["idle-leader"], idle["idle-standby"]
        rows.append([backend, f"{lead['cpu_percent_of_core']:.2f} % / "
                              f"{stand['cpu_percent_of_core']:.2f} %",
                     f"{lead['rss_mb']} / {stand['rss_mb']} MB"])
    where = next((r[k].get("state_dir_filesystem", "disk") for k in ("idle",) if k in r),
                 "tmpfs")
    seconds = next((r[k]["seconds"] for k in r if k.startswith("idle")), 0)
    return table([f"backend (over {seconds:g} s, state directory on {where})",
                  "idle CPU of a core, leader / standby", "RSS, leader / standby"], rows)


def http_limits(r: Row) -> list[str]:
    w, fat, slow = r["waiters"], r.get("fat_heads"), r["slowloris"]
    rows = [
        ["RSS, idle", f"{r['rss_mib_idle']} MiB"],
        [f"RSS, {w['connections_attempted']:,} clients each sending `GET /leader?wait=300` "
         "(peak)", f"{w['rss_mib_peak']} MiB: {w['parked']} parked, "
         f"{w['answered_at_once_wait_cap']:,} answered at once (`Lease-Wait: full`), "
         f"{w['refused_503_connection_cap']:,} refused `503` + `Retry-After`"],
        ["parked waiters after a `POST /release`",
         f"{w['parked_answered_after_release']} answered, "
         f"{w['parked_told_leader_after_release']} told \"leader\""],
    ]
    if fat:
        rows.append([f"RSS, {fat['connections']} connections each holding an unfinished "
                     f"head of {fat['head_bytes_each'] / 1024:.0f} KiB (peak)",
                     f"{fat['rss_mib_peak']} MiB"])
    rows.append([f"{slow['connections']} half-sent requests (one more header line a second)",
                 f"{slow['closed_by_server']} closed by the sidecar after "
                 f"{slow['open_seconds_p50']} s (p50) / {slow['open_seconds_max']} s (max); "
                 f"header timeout {slow['header_timeout_s']:g} s"])
    rows.append(["the sidecar answers `/healthz` afterwards", "yes" if r["alive_after"] else
                 "**no**"])
    return table(["figure", "value"], rows, right=2)


def exec_(r: Row) -> list[str]:
    g = r["guard_overhead"]
    return table(["figure", "p50 / p99", "n"], [
        ["`POST /release` → `exec` has exited, both workers gone",
         p50_p99(r["release_to_job_gone"]), n(r["release_to_job_gone"])],
        ["SIGKILL of `exec` → both workers gone (they exit on SIGTERM)",
         p50_p99(r["sigkill_to_job_gone"]), n(r["sigkill_to_job_gone"])],
        ["SIGKILL of `exec`, workers ignore SIGTERM, `--grace 60s` → both gone",
         p50_p99(r["sigkill_stubborn_to_job_gone"]), n(r["sigkill_stubborn_to_job_gone"])],
        ["the guard's spawn-to-exit around `true`", p50_p99(g["guarded"]), n(g["guarded"])],
        ["`true` alone", p50_p99(g["direct"]), n(g["direct"])],
    ])


def sqlite_commit(r: Row) -> list[str]:
    return table(["journal mode", "commit p50 / p99", "n"],
                 [[f"`{mode}`", p50_p99(s), n(s)] for mode, s in r["commit_time"].items()])


def metrics(r: Row) -> list[str]:
    return table(["figure", "value"], [
        [f"`GET /metrics` body, {r['leases']} lease(s)",
         f"{r['body_bytes']:,} bytes, {r['body_lines']} lines"],
        ["one scrape over loopback, p50 / p99", p50_p99(r["scrape"])],
    ], right=2)


def longpoll(r: Row) -> list[str]:
    idle, h = r["idle"], r.get("handover")
    rows = [[f"wake-ups per minute per waiter besides `wait` timeouts, idle {role}",
             f"{idle[role]['wakeups_per_minute_per_waiter']:g} "
             f"({idle[role]['timeouts']} timeouts over {idle[role]['waiters']} waiters)"]
            for role in ("leader", "standby")]
    if h:
        a, b = h["release_to_leader_answer_ms"], h["first_claim_to_standby_answer_ms"]
        rows += [[f"`POST /release` → the leader's waiter hears `503`, p50 / max ({h['rounds']})",
                  f"{ms(a['p50'])} / {ms(a['max'])} ms"],
                 [f"the standby's first claim → its waiter hears `200`, p50 / max "
                  f"({h['rounds']})", f"{ms(b['p50'])} / {ms(b['max'])} ms"]]
    return table(["figure", "value"], rows, right=2)


def postgres_advisory(r: Row) -> list[str]:
    rows = [["SIGKILL → lock passes", "sigkill_lock_passing"],
            ["SIGKILL → first claim", "sigkill_published_claim"],
            ["SIGTERM → lock passes", "sigterm_lock_passing"],
            ["SIGTERM → first claim", "sigterm_handover_claim"]]
    return table(["figure", "p50 / p99", "n"],
                 [[label, p50_p99(r[key]), n(r[key])] for label, key in rows])


def postgres_row(r: Row) -> list[str]:
    t, rt = r["throughput"], r["round_trips"]
    rows = [[f"renews/s over {t['names']:,} names ({t['callers']} callers, pool of "
             f"{t['pool_size']})", f"{t['renews_per_s']:,} (p50 {t['latency_ms_p50']} ms, "
             f"p99 {t['latency_ms_p99']} ms)"],
            ["round trips per renew (driver calls / client writes / server replies)",
             f"{rt['driver_calls_per_renew']:g} / {rt['client_writes_per_renew']:g} / "
             f"{rt['server_replies_per_renew']:g}"]]
    for h in r.get("sigterm_handover", []):
        rows.append([f"SIGTERM → first claim, claim horizon {h['claim_horizon_s'] * 1000:g} ms "
                     f"({h['trials']} trials)", p50_p99(h)])
    return table(["figure", "value"], rows, right=2)


def pgbouncer_refusals(r: Row) -> list[str]:
    rows = []
    for x in r["advisory_transaction_pooling"]:
        took = x["start_to_all_refused"]
        rows.append([f"pool {x['pool_size']}, {x['sidecars']} sidecars", x["rounds"],
                     f"{x['samples']:,}", x["claims"], f"**{x['overlaps']}**", x["refused"],
                     "—" if not took else f"{took['p50_ms'] / 1000:.1f} / "
                                          f"{took['max_ms'] / 1000:.1f} s"])
    return table(["`postgres` (advisory), `pool_mode=transaction`", "rounds", "samples",
                  "claims", "overlaps", "refused (exit 2)", "start → all refused p50 / max"],
                 rows)


def pgbouncer_handovers(r: Row) -> list[str]:
    rows = [[f"`{x['backend']}`, `pool_mode={x['pool_mode']}`, pool {x['pool_size']}",
             p50_p99(x["sigterm_handover"]), x["trials"], f"{x['samples']:,}",
             f"**{x['overlaps']}**", x["prepared_statement_errors"]] for x in r["handovers"]]
    return table(["SIGTERM hand-over through the pooler (3 sidecars)", "first claim p50 / p99",
                  "trials", "samples", "overlaps", "prepared-statement errors"], rows)


def pg_failover(r: Row) -> list[str]:
    rows = []
    for x in r["runs"]:
        gap, promo = x["leaderless_gap"] or {}, x["promotion_to_claim"] or {}
        rows.append([f"`{x['backend']}`", x["style"], x["failovers"], x["handovers_during_lag"],
                     x["overlaps"], len(x["token_problems"]), x["log_tracebacks"],
                     "—" if not gap else f"{ms(gap['p50_ms'])} / {ms(gap['p99_ms'])} / "
                                         f"{ms(gap['max_ms'])}",
                     "—" if not promo else f"{ms(promo['p50_ms'])} / {ms(promo['max_ms'])}"])
    return table(["backend", "connection", "failovers", "hand-overs during the lag",
                  "overlapping claims", "token problems", "tracebacks in logs",
                  "leaderless gap ms p50 / p99 / max", "promotion → first claim ms p50 / max"],
                 rows, right=2)


def kubernetes(r: Row) -> list[str]:
    rows = [["SIGTERM hand-over (new holder's `acquireTime`)", "sigterm_handover_sidecar",
             "sigterm_handover_anchor"],
            ["SIGKILL takeover (new holder's `acquireTime`)", "sigkill_takeover_sidecar",
             "sigkill_takeover_anchor"],
            ["SIGTERM → first claim", "sigterm_published_claim_sidecar", None],
            ["SIGKILL → first claim", "sigkill_published_claim_sidecar", None],
            ["label lag (new holder → `lease-role=leader` visible)", "label_lag_sidecar", None],
            ["stale `leader` label demoted after SIGKILL", "stale_label_demotion_sidecar", None],
            ["SIGTERM → own label `standby` (before the release)",
             "unpublish_after_sigterm_sidecar", None]]
    return table(["figure", "lease-sidecar p50 / p99", "the client's leaderelection p50 / p99"],
                 [[label, p50_p99(r.get(ours)), p50_p99(r.get(theirs)) if theirs else "—"]
                  for label, ours, theirs in rows if r.get(ours)], right=3)


def kubernetes_foreign(r: Row) -> list[str]:
    labels = {"holder-cleared": "`holderIdentity` cleared",
              "holder-to-standby": "`holderIdentity` → a standby",
              "duration-1s": "`leaseDurationSeconds: 1`",
              "deleted": "Lease deleted, a newcomer started at once"}
    rows = []
    for edit, x in r["edits"].items():
        kept = x["holder_kept_leading"]
        step = (f"kept leading ({kept} of {x['trials']})" if kept == x["trials"]
                else p50_p99(x["step_down"]))
        rows.append([labels.get(edit, edit), x["trials"], x["overlapping_claims"],
                     x["token_regressions"], step, p50_p99(x["next_leader_first_claim"])])
    hand = r["preferred_holder_handoff"]
    rows.append(["`spec.preferredHolder` set to a standby", hand["n"],
                 hand["overlapping_claims"], "—", "—", p50_p99(hand)])
    return table(["write", "trials", "overlapping claims", "token regressions",
                  "holder's step-down p50 / p99", "next leader's first claim p50 / p99"], rows,
                 right=1)


def kube_names(r: Row) -> list[str]:
    rows = []
    for x in r["rows"]:
        calls = x["requests_per_min"]
        gap = x["renew_gap_s"]
        rows.append([x["names"], f"{x['rss_mib']} MiB", f"{x['cpu_percent']:g} %",
                     x["connections"], f"{x['watches_open']:g}",
                     f"{calls.get('PUT', 0):g} / {calls.get('GET', 0):g} / "
                     f"{calls.get('WATCH', 0):g}",
                     f"{gap['p50']:g} / {gap['p99']:g} / {gap['max']:g} s",
                     "all" if x["all_held_at_end"] and not x["lost"] else "NOT ALL"])
    extra = r["per_extra_name"]
    return [*table(["names", "RSS (VmRSS)", "CPU, of one core", "TCP connections",
                    "watches open", "requests a minute: PUT / GET / WATCH ended",
                    "renew gap per Lease, p50 / p99 / max", "held throughout"], rows),
            "", f"Each name beyond the first: {extra['rss_kib']} KiB of RSS and "
                f"{extra['cpu_percent']:g} % of a core."]


def shards_moves(r: Row) -> list[str]:
    """bench_shards' scale rows: per backend and change of members."""
    rows = []
    for backend, entry in r["backends"].items():
        part = entry.get("scale")
        if not part:
            continue
        for change, x in part["per_change"].items():
            balanced, gaps = x["balanced_s"], x["unowned_ms"]
            rows.append([
                f"`{backend}`", change,
                " / ".join(f"{m} / {least}" for m, least in zip(x["moved"], x["least"],
                                                                 strict=True)),
                f"{x['worst_ratio']:.2f}", x["moved_twice"],
                "—" if not balanced else f"{balanced['p50']:g} / {balanced['p99']:g} s",
                "—" if not gaps else f"{ms(gaps['p50'])} / {ms(gaps['p99'])} ms "
                                     f"(n {gaps['n']})",
                f"{ms(part['unowned_bound_ms'])} ms", part["overlaps"]])
    failed = [f"`{backend}` {why}" for backend, entry in r["backends"].items()
              for why in (entry.get("scale") or {}).get("failed_trials", [])]
    notes = [f"{r['shards']} shards, default timing; every member's `GET /shards` recorded "
             f"every {r['poll_ms']:g} ms; moved / least per trial."]
    if failed:
        notes.append("Trials that did not finish: " + "; ".join(failed) + ". One that did "
                     "not balance after a change keeps its earlier changes in the figures "
                     "and all its claims in the moments with two claimants; one that failed "
                     "otherwise counts nowhere.")
    if not r.get("complete", True):
        notes.append("The run did not finish: backends missing here were not measured.")
    return [*table(["backend", "members", "moved / least", "worst moved ÷ least",
                    "moved twice", "to balanced p50 / p99", "unowned per move p50 / p99",
                    "two horizons + a round trip", "moments with two claimants"], rows,
                   right=2), "", *notes]


def shards_cost(r: Row) -> list[str]:
    """bench_shards' cost rows: round trips per renew interval of one member."""
    counts = sorted({row["shards"] for entry in r["backends"].values()
                     for row in entry.get("cost", [])})
    rows = []
    for backend, entry in r["backends"].items():
        by = {row["shards"]: row for row in entry.get("cost", [])}
        if not by:
            continue
        cells = []
        for count in counts:
            row = by.get(count)
            if row is None or "error" in row:
                cells.append("not measured" if row is None
                             # the error's first part; its log tail stays in the file
                             else f"failed: {row['error'].split('; log:')[0]}")
            else:
                held = "" if (row["led_at_end"] or 0) >= count else \
                    f", only {row['led_at_end'] or 0:,} held at the end"
                cpu = f", {row['cpu_percent']:g} % CPU" if "cpu_percent" in row else ""
                cells.append(f"{row['round_trips_per_renew_interval']:g} "
                             f"({row['rss_mib']:g} MiB{cpu}{held})")
        rows.append([f"`{backend}`", f"{entry['renew_interval_s']:g} s", *cells])
    return table(["backend", "renew interval", *(f"{c:,} shards" for c in counts)], rows,
                 right=1)


def shards_rollout(r: Row) -> list[str]:
    """bench_shards' rollout: owner changes per shard through a rolling update."""
    a, p = r["assignment"], r["processes"]
    gaps = p.get("unowned_ms")
    return table(["rolling update of 4 members", "owner changes per shard: mean / max",
                  "shards changed more than twice", "unowned per move p50 / p99",
                  "moments with two claimants"], [
        [f"the assignment alone ({a['trials']} random groups)",
         f"{a['mean_changes_per_shard']:g} / {a['max_changes_per_shard']}", "—", "—", "—"],
        [f"real sidecars on `{r['backend']}`, {p['shards']} shards",
         f"{p['mean_changes_per_shard']:g} / {p['max_changes_per_shard']}",
         p["shards_changed_more_than_twice"],
         "—" if not gaps else f"{ms(gaps['p50'])} / {ms(gaps['p99'])} ms", p["overlaps"]],
    ])


def clientgo_interop(r: Row) -> list[str]:
    labels = {"SIGTERM sidecar->client-go": "SIGTERM, sidecar → client-go (`OnStartedLeading`)",
              "SIGTERM client-go->sidecar": "SIGTERM, client-go → sidecar (first `200`)",
              "SIGKILL sidecar->client-go": "SIGKILL, sidecar → client-go",
              "SIGKILL client-go->sidecar": "SIGKILL, client-go → sidecar"}
    rows = [[labels.get(k, k), p50_p99(s), n(s)] for k, s in r["signal_to_first_claim"].items()]
    rows.append(["overlapping claims", f"**{len(r['overlaps'])}**", ""])
    rows.append(["fencing token grew on every takeover",
                 "yes" if r["fencing_tokens_grow"] else "**no**", ""])
    return table(["signal → first claim of the new holder", "p50 / p99", "n"], rows)


def handover(r: Row) -> list[str]:
    horizons = r["claim_horizon_ms"]
    rows = []
    labels = {"kubernetes-clientgo-target": "`kubernetes`, a client-go elector named"}
    for backend in ("sqlite", "postgres", "postgres-row", "kubernetes",
                    "kubernetes-clientgo-target"):
        x = r.get(backend)
        if not x:
            continue
        horizon = horizons.get(backend.split("-clientgo")[0], horizons.get("others"))
        # Results from before the bench measured the round trip have no such field.
        trip = x.get("round_trip")
        rows.append([labels.get(backend, f"`{backend}`"), f"{horizon:g} ms", p50_p99(x),
                     p50_p99(x["leaderless_gap"]), x["overlapping_claims"],
                     f"{x['named_standby_led']} of {x['n']}",
                     p50_p99(trip) if trip else "—",
                     f"{x['within_bound']} of {x['n']}" if trip else "—"])
    return table(["backend", "claim horizon", "request → named standby leads, p50 / p99",
                  "leaderless gap, p50 / p99", "overlapping claims", "named standby led",
                  "round trip, p50 / p99", "within 2 horizons + round trip p99"],
                 rows, right=2)


def pods(r: Row) -> list[str]:
    rows = [["pod start → sidecar container ready", "pod_start_to_sidecar_ready"],
            ["pod start → pod Ready (2/2)", "pod_start_to_pod_ready"],
            ["`kubectl delete pod <leader>` → another pod's first claim",
             "deletion_to_first_claim"],
            ["leader deletion: longest leaderless gap", "deletion_longest_gap"],
            ["`kubectl rollout restart`: longest leaderless gap", "restart_longest_gap"],
            ["`kubectl rollout restart`: duration", "restart_duration"]]
    out = [[label, p50_p99(r[key]), n(r[key])] for label, key in rows if r.get(key)]
    out.append(["overlapping claims (deletions / restarts)",
                f"**{r['deletion_overlaps']} / {r['restart_overlaps']}**", ""])
    return table(["figure", "p50 / p99", "n"], out)


def pods_usage(r: Row) -> list[str]:
    rows = []
    for role in ("leader", "standby"):
        x = r["sidecar_usage"][role]
        rows.append([f"{role} ({x['pods']} pod{'s' if x['pods'] != 1 else ''})",
                     f"{x['rss_mb']} MiB", f"{x['working_set_mb']} MiB",
                     f"{x['kubelet_cpu_millicores']} millicores",
                     f"{x['cgroup_cpu_percent']} % of a core"])
    return table(["sidecar container, idle", "RSS", "working set", "CPU, kubelet",
                  "CPU, cgroup"], rows)


def pods_idle(r: Row) -> list[str]:
    """Idle memory from the sidecar containers' own cgroup and the start-up figure, for
    one backend (bench_pods --backend)."""
    m = r.get("idle_sidecar_memory")
    if not m:
        return ["*This results file predates the per-trial cgroup memory reading.*"]

    def mib(key: str) -> str:
        x = m[key]
        return f"{x['p50_mib']} / {x['max_mib']} MiB" if x["n"] else "—"

    rows = [["idle `total_rss` (anonymous memory; the kubelet's RSS)", mib("rss_mib"),
             m["rss_mib"]["n"]],
            ["idle working set (usage minus inactive file)", mib("working_set_mib"),
             m["working_set_mib"]["n"]],
            ["idle file pages charged: mapped / cache",
             f"{m['mapped_file_mib']['p50_mib']} / {m['cache_mib']['p50_mib']} MiB (p50)",
             m["cache_mib"]["n"]],
            ["pod start → sidecar container ready", p50_p99(r["pod_start_to_sidecar_ready"]),
             n(r["pod_start_to_sidecar_ready"])]]
    steps = r.get("startup_steps") or {}
    labels = {"ip": "pod IP", "container_running": "container running",
              "process_started": "process started", "logged_started": "logged `started`",
              "ready": "ready"}
    if steps:
        rows.append(["start-up steps (ms after the first watch event, p50): "
                     + ", ".join(f"{labels[k]} {ms(x.get('p50_ms'))}" for k, x in steps.items()),
                     "", steps["ready"]["n"]])
    return table([f"`{r['backend']}` backend, real pods", "p50 / max (ready: p50 / p99)",
                  "n"], rows)


def image_sizes(r: Row) -> list[str]:
    rows = []
    for target, x in r["targets"].items():
        top = ", ".join(f"{name} {mb}" for name, mb in list(x["distributions_mb"].items())[:4])
        rows.append([f"`{target}`", top, f"**{x['archive_mb']} MB**", f"{x['files_mb']} MB",
                     f"{x['stdlib_mb']} MB", f"{x['system_mb']} MB"])
    b = r["backends"]
    sql = b["sqlserver"]
    adds = [["kubernetes", "nothing: aiohttp is the core", f"{b['kubernetes_mb']} MB"],
            ["sqlite", "`_sqlite3` and libsqlite3", f"{b['sqlite_mb']} MB"],
            ["postgres, postgres-row", "asyncpg", f"{b['postgres_and_postgres_row_mb']} MB"],
            ["sqlserver (the `sidecar-sqlserver` image)",
             f"pyodbc {sql['pyodbc_mb']} MB; unixODBC, FreeTDS and the libraries they load "
             f"{sql['odbc_driver_and_libraries_mb']} MB; glibc's gconv converters "
             f"{sql['gconv_mb']} MB", f"{sql['archive_mb']} MB"]]
    return [*table(["target", "largest distributions (MB)", "docker archive", "files",
                    "standard library", "interpreter, shared libraries, /etc"], rows, right=2),
            "", *table(["backend", "what it adds to its image", "archive"], adds, right=2)]


def rollout(r: Row) -> list[str]:
    strategies = {"default": "default (25 % / 25 %)",
                  "surge1-unavailable0": "`maxSurge: 1, maxUnavailable: 0`"}
    rows = []
    for mode, by in r["results"].items():
        for strategy, x in by.items():
            per = x["handovers_per_rollout"]
            rows.append([f"`{mode}`", strategies.get(strategy, strategy),
                         f"{x['exactly_one_handover']} of {x['rollouts']}",
                         "all 1" if set(per) == {1} else " ".join(map(str, per)),
                         x["handovers_to_an_old_pod"], p50_p99(x["gap"]), x["overlaps"]])
    return table(["`shutdownHandover`", "strategy", "exactly one hand-over",
                  "hand-overs per rollout", "hand-overs to an old pod",
                  "gap per hand-over, p50 / p99", "overlapping claims"], rows, right=2)


def rollout_service(r: Row) -> list[str]:
    rows = []
    for mode, by in r["results"].items():
        for strategy, x in by.items():
            through = x.get("service_claim_to_client")
            rows.append([f"`{mode}`", strategy, p50_p99(x.get("service_claim_to_label")),
                         p50_p99(x.get("service_claim_to_endpoints")), p50_p99(through),
                         "—" if through is None else
                         f"{x['service_client_other_pod_after']} / "
                         f"{x['service_client_no_answer_after']}"])
    return table(["`shutdownHandover`", "strategy", "first claim → pod label `leader`",
                  "first claim → EndpointSlice lists only its pod",
                  "first claim → a client pod's request through the ClusterIP reaches it",
                  "later requests: another pod answered / none did"], rows, right=2)


def lean_lone(r: Row) -> list[str]:
    rows = []
    for backend, x in r["lone"].items():
        rss, start, cpu = x["idle_rss_mib"], x["start_to_healthz_ms"], x.get("start_cpu_ms")
        rows.append([backend, f"{rss['p50']} / {rss['max']} MiB",
                     f"{ms(start['p50'])} / {ms(start['max'])} ms",
                     f"{ms(cpu['p50'])} / {ms(cpu['max'])} ms" if cpu else "—", x["trials"]])
    return table(["backend", "idle RSS p50 / max (VmRSS, outside pods)",
                  "process start → `/healthz` 200, p50 / max",
                  "its CPU time by then, p50 / max", "trials"], rows)


def lean_apiserver(r: Row) -> list[str]:
    g = r["idle_group_of_3"]
    rows = [["apiserver requests per minute, idle group of 3: sidecars / client-go electors",
             f"{g['sidecars_per_min']:g} / {g['clientgo_per_min']:g} "
             f"(ratio {g['ratio']:.2f}; baseline {g['baseline_per_min']:g} subtracted)"]]
    rows += [[f"watch events per leadership change, {w['sidecars']} sidecars",
              f"{w['watch_events_per_change']:g} (over {w['changes']} changes)"]
             for w in r["watch_fanout"]]
    return table(["figure", "value"], rows, right=2)


def fence_zombie(r: Row) -> list[str]:
    """bench_fence: the zombie leader per backend, with and without the guard."""
    rows = []
    for x in r["zombie"]:
        where = x["backend"] + (" via PgBouncer (transaction pooling)" if x["pooled"] else "")
        refused = ", ".join(f"{n:,} `{state}`" for state, n in x["zombie_refused"].items())
        rows.append([where, "on" if x["guard"] else "**off**",
                     f"{x['zombie_writes']:,}", f"{x['zombie_committed']:,}", refused or "0",
                     f"{x['new_leader_committed']:,} of {x['new_leader_writes']:,}",
                     f"{x['committed_out_of_token_order']:,}", f"{x['takeover_s']:g} s"])
    return table(["backend", "guard", "stale writes fired", "stale writes committed",
                  "refused (SQLSTATE)", "new leader's writes committed",
                  "committed out of token order", "takeover"], rows, right=2)


def fence_cost(r: Row) -> list[str]:
    """bench_fence: pgbench, single-row inserts, with and without the guard."""
    c = r["cost"]
    rows = []
    forms = (("guarded_in_statement", "guard in the insert's statement"),
             ("guarded", "guard, its own statement"),
             ("extra_statement", "an empty statement of its own (no guard: a round trip)"),
             ("lookup_only", "a function that only reads the guard's row (no guard)"))
    for key, commits in (("fsync_on", "durable (`fsync=on`)"),
                         ("fsync_off", "`fsync=off` (almost free)")):
        bare = c[key]["bare"]
        rows.append([commits, "no guard", f"{bare['tps']:,}",
                     f"{bare['p50_ms']:.2f} / {bare['p99_ms']:.2f}", "—", "—"])
        for name, form in forms:
            if name not in c[key]:
                continue  # a results file from before this anchor was measured
            g = c[key][name]
            loss = g.get("loss_per_round_median", g["throughput_loss"])
            # The target's form and commits: the guard in the insert's statement, durable.
            mark = ""
            if name == "guarded_in_statement" and key == "fsync_on":
                mark = (f" (target ≤ {c['target_throughput_loss'] * 100:.0f} %: "
                        + ("met)" if g["meets_target"] else "**not met**)"))
            rows.append([commits, form, f"{g['tps']:,}",
                         f"{g['p50_ms']:.2f} / {g['p99_ms']:.2f}",
                         f"{g['added_p50_ms']:+.2f} / {g['added_p99_ms']:+.2f}",
                         f"{loss * 100:.0f} %{mark}"])
    return table(["commits", "transaction", "transactions/s", "latency p50 / p99 ms",
                  "added p50 / p99 ms", "throughput lost (median of paired rounds)"],
                 rows, right=2)


def checkout_free(command: str) -> str:
    """The command as run from the repository's root: a results file records where its
    checkout was (``--out /work/main/bench/results/chaos-sqlite``), and the docs must read
    the same whichever checkout renders them."""
    return re.sub(r"(?<=\s)\S*/(?=bench/results/)", "", command)


def chaos(r: Row) -> list[str]:
    rows = [[x["kind"], x["faults"], x["leader_hits"], x["overlaps"],
             f"{x['max_overlap'] * 1000:.1f}", ms(x["max_gap"] * 1000), ms(x["bound"] * 1000),
             len(x["takeovers"]),
             ms(None if x["takeover_p50"] is None else x["takeover_p50"] * 1000),
             ms(None if x["takeover_p99"] is None else x["takeover_p99"] * 1000)]
            for x in r["rows"]]
    verdict = "**PASS**" if r["ok"] else f"**FAIL** ({len(r['violations'])} violations)"
    return [*table(["fault", "faults", "leader hits", "overlaps", "max overlap ms",
                    "max leaderless gap ms", "bound ms", "takeovers", "p50 takeover ms",
                    "p99 takeover ms"], rows),
            "", f"Verdict: {verdict}; {r['faults_injected']:,} faults, "
                f"{r['restarts']} sidecar restarts, "
                f"`{checkout_free(r['command'])}`."]

def simulation(r: Row) -> list[str]:
    """The deterministic simulator (testkit/sim): faults and simulated time per backend,
    every claim judged, and how soon someone led once the faults stopped."""
    rows = [[x["backend"], f"{x['faults']:,}", f"{x['simulated_h']:,.0f}", x["runs"],
             f"{x['claims']:,}", f"{x['terms']:,}", x["violations"], x["errors"],
             tenths(x["recovery_p50_s"]), tenths(x["recovery_max_s"])]
            for x in r["backends"]]
    total = sum(x["faults"] for x in r["backends"])
    hours = sum(x["simulated_h"] for x in r["backends"])
    bad = sum(x["violations"] + x["errors"] for x in r["backends"])
    verdict = "**PASS**" if not bad else f"**FAIL** ({bad} violations or errors)"
    return [*table(["backend", "faults", "simulated h", "runs", "claims judged", "terms",
                    "violations", "errors", "leader back p50", "leader back max"], rows),
            "", f"Verdict: {verdict}; {total:,} faults, {hours:,.0f} simulated hours in "
                f"{r['wall_s']:,.0f} s of wall time on {r['cores']} cores. \"Leader back\": "
                "seconds from the end of a phase of faults (everything healed, a hand edit "
                "written back, now and then one application left not ready) to the first "
                "claim."]


def tenths(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} s"


# -- tables from several files -------------------------------------------------------------
BACKENDS = ("sqlite", "postgres", "postgres-row", "kubernetes")


def seconds(value: float) -> str:
    """A setting read from a results file, as the docs write durations: 250 ms, 3 s."""
    return f"{value * 1000:g} ms" if value < 1 else f"{value:g} s"


def _timing(r: Row) -> str:
    parts = [f"{label} {seconds(r[key])}" for key, label in
             (("lease_duration_s", "lease"), ("renew_interval_s", "renew interval"),
              ("claim_horizon_s", "claim horizon")) if r.get(key)]
    return ", ".join(parts)


HANDOVER_SOURCES = (("core.json", "core"), ("postgres_advisory.json", "postgres_advisory"),
                    ("postgres_row.json", "postgres_row"), ("kubernetes.json", "kubernetes"),
                    ("handover.json", "handover"), ("pods-kubernetes.json", "pods"),
                    ("pods-postgres.json", "pods_postgres"),
                    ("pods-postgres-row.json", "pods_postgres_row"))


def handover_answer(f: dict[str, Row]) -> list[str]:
    """How long a hand-over takes, per backend and per way of ending a term: each cell
    from the benchmark that measures it, with the timing that benchmark ran at."""
    core, adv, row, kube, hand = (f.get(x) or {} for x in (
        "core.json", "postgres_advisory.json", "postgres_row.json", "kubernetes.json",
        "handover.json"))
    row_term = next((h for h in row.get("sigterm_handover", [])
                     if h.get("claim_horizon_s") == 0.25), None)
    sigterm = {"sqlite": (core.get("sigterm_handover") or {}).get("claim"),
               "postgres": adv.get("sigterm_handover_claim"), "postgres-row": row_term,
               "kubernetes": kube.get("sigterm_published_claim_sidecar")}
    sigkill = {"sqlite": (core.get("sigkill_takeover") or {}).get("claim"),
               "postgres": adv.get("sigkill_published_claim"), "postgres-row": None,
               "kubernetes": kube.get("sigkill_published_claim_sidecar")}
    horizons = hand.get("claim_horizon_ms") or {}
    rows = []
    for b in BACKENDS:
        named = hand.get(b)
        horizon = horizons.get(b, horizons.get("others"))
        pods = (f.get(f"pods-{b}.json") or {}).get("deletion_to_first_claim")
        rows.append([f"`{b}`", p50_p99(sigterm[b]), p50_p99(sigkill[b]),
                     f"{p50_p99(named)} (claim horizon {horizon:g} ms)" if named else "—",
                     p50_p99(pods)])
    settings = [f"`{name}`: {_timing(f[name])}" for name in
                ("core.json", "postgres_advisory.json", "kubernetes.json")
                if name in f and _timing(f[name])]
    if row_term:
        settings.append("`postgres_row.json`: claim horizon 250 ms")
    return [*table(["backend", "SIGTERM → the next leader's first claim, p50 / p99",
                    "SIGKILL → the next leader's first claim, p50 / p99",
                    "`POST /handover` → the named standby leads, p50 / p99",
                    "leader pod deleted → another pod's first claim (real pods, the "
                    "chart's defaults), p50 / p99"], rows),
            "", "Timing of the runs outside pods: " + "; ".join(settings) + "."]


PODS_SOURCES = tuple((f"pods-{b}.json", f"pods{'' if b == 'kubernetes' else '_' + b}"
                      .replace("-", "_")) for b in ("kubernetes", "postgres", "postgres-row"))


def pods_deletions(f: dict[str, Row]) -> list[str]:
    """Leader deletions and rolling restarts in real pods, per backend."""
    rows = []
    for b in ("kubernetes", "postgres", "postgres-row"):
        r = f.get(f"pods-{b}.json")
        if not r:
            continue
        rows.append([f"`{b}`", p50_p99(r.get("deletion_to_first_claim")),
                     p50_p99(r.get("deletion_longest_gap")),
                     p50_p99(r.get("restart_longest_gap")),
                     f"**{r['deletion_overlaps']} / {r['restart_overlaps']}**",
                     n(r.get("deletion_to_first_claim"))])
    return table(["backend", "leader deletion → another pod's first claim, p50 / p99",
                  "leader deletion: longest leaderless gap, p50 / p99",
                  "`kubectl rollout restart`: longest leaderless gap, p50 / p99",
                  "overlapping claims (deletions / restarts)", "deletions"], rows)


# -- goals -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Goal:
    """A goal the project set itself, and how to judge it from the results files."""

    text: str  # what the goal is, with its bound
    judge: Callable[[dict[str, Row]], tuple[str, bool] | None]  # (figure, met), or None


def _range(values: list[float], unit: str) -> str:
    low, high = min(values), max(values)
    return f"{ms(low)}{unit}" if low == high else f"{ms(low)} to {ms(high)}{unit}"


def _lean(key: str, bound: float, unit: str) -> Callable[[dict[str, Row]], Any]:
    def judge(f: dict[str, Row]) -> tuple[str, bool] | None:
        lone = (f.get("lean.json") or {}).get("lone")
        if not lone:
            return None
        values = [x[key]["p50"] for x in lone.values()]
        return f"{_range(values, unit)} p50", max(values) <= bound
    return judge


def _idle_cpu(f: dict[str, Row]) -> tuple[str, bool] | None:
    r = f.get("core-idle.json")
    if not r:
        return None
    values = [r[k]["idle-leader"]["cpu_percent_of_core"] for k in r if k.startswith("idle")]
    return f"{min(values):.2f} to {max(values):.2f} %", max(values) <= 0.3


def _pods(key: str, bound: float, unit: str, scale: float = 1.0,
          ) -> Callable[[dict[str, Row]], Any]:
    def judge(f: dict[str, Row]) -> tuple[str, bool] | None:
        values = []
        for b in ("kubernetes", "postgres", "postgres-row"):
            r = f.get(f"pods-{b}.json")
            if not r:
                continue
            if key == "rss":
                x = (r.get("idle_sidecar_memory") or {}).get("rss_mib") or {}
                if x.get("n"):
                    values.append((b, x["max_mib"]))
            elif r.get(key):
                values.append((b, r[key]["p50_ms"] * scale))
        if not values:
            return None
        text = ", ".join(f"{b} {ms(v)}" for b, v in values)
        return f"{text}{unit}", all(v <= bound for _, v in values)
    return judge


def _image(f: dict[str, Row]) -> tuple[str, bool] | None:
    r = f.get("image.json")
    if not r:
        return None
    mb = r["targets"]["sidecar"]["archive_mb"]
    return f"{mb} MB", mb <= 134


def _requests(f: dict[str, Row]) -> tuple[str, bool] | None:
    g = (f.get("lean.json") or {}).get("idle_group_of_3")
    if not g:
        return None
    return (f"{g['sidecars_per_min']:g} / {g['clientgo_per_min']:g} a minute "
            f"(ratio {g['ratio']:.2f})", g["ratio"] <= 0.3)


def _named(f: dict[str, Row]) -> tuple[str, bool] | None:
    r = f.get("handover.json")
    if not r:
        return None
    runs = [r[b] for b in BACKENDS if r.get(b) and "within_bound" in r[b]]
    ok = sum(x["within_bound"] for x in runs)
    total = sum(x["n"] for x in runs)
    overlaps = sum(x["overlapping_claims"] for x in runs)
    return (f"{ok} of {total} hand-overs, {overlaps} overlapping claims",
            ok == total and overlaps == 0)


def _rollout(f: dict[str, Row]) -> tuple[str, bool] | None:
    r = f.get("rollout.json")
    if not r or "youngest-ready" not in r["results"]:
        return None
    runs = r["results"]["youngest-ready"].values()
    one = sum(x["exactly_one_handover"] for x in runs)
    total = sum(x["rollouts"] for x in runs)
    return f"{one} of {total} rollouts", one == total


def _chaos(f: dict[str, Row]) -> tuple[str, bool] | None:
    runs = [(b, f[f"chaos-{b}.json"]) for b in BACKENDS if f"chaos-{b}.json" in f]
    if not runs:
        return None
    text = ", ".join(f"{b} {'PASS' if r['ok'] else 'FAIL'} ({r['faults_injected']:,} "
                     f"faults, {sum(x['overlaps'] for x in r['rows'])} overlaps)"
                     for b, r in runs)
    return text, all(r["ok"] and not any(x["overlaps"] for x in r["rows"]) for _, r in runs)


def _p99(source: str, key: str, bound: float) -> Callable[[dict[str, Row]], Any]:
    def judge(f: dict[str, Row]) -> tuple[str, bool] | None:
        x = (f.get(source) or {}).get(key)
        if not x:
            return None
        return f"{p50_p99(x)} (p50 / p99)", x["p99_ms"] <= bound
    return judge


def _row_handover(f: dict[str, Row]) -> tuple[str, bool] | None:
    x = next((h for h in (f.get("postgres_row.json") or {}).get("sigterm_handover", [])
              if h.get("claim_horizon_s") == 0.25), None)
    if not x:
        return None
    return f"{p50_p99(x)} (p50 / p99)", x["p99_ms"] <= 250


def _renews(f: dict[str, Row]) -> tuple[str, bool] | None:
    t = (f.get("postgres_row.json") or {}).get("throughput")
    if not t:
        return None
    return f"{t['renews_per_s']:,} renews/s", t["renews_per_s"] >= 2000


def _fenced(f: dict[str, Row]) -> tuple[str, bool] | None:
    rows = [x for x in (f.get("fence.json") or {}).get("zombie", []) if x["guard"]]
    if not rows:
        return None
    stale = sum(x["zombie_committed"] for x in rows)
    lost = sum(x["new_leader_writes"] - x["new_leader_committed"] for x in rows)
    return (f"{stale:,} of {sum(x['zombie_writes'] for x in rows):,} stale writes committed, "
            f"{lost:,} of the new leaders' lost ({len(rows)} setups)"), not stale and not lost


def _fence_cost(f: dict[str, Row]) -> tuple[str, bool] | None:
    cost = (f.get("fence.json") or {}).get("cost", {}).get("fsync_on")
    if not cost:
        return None
    # The guard is judged in the insert's statement, where it adds no statement; in a
    # statement of its own it adds a round trip too, shown beside it with an empty
    # statement's cost for scale (older results lack that anchor).
    inline = cost["guarded_in_statement"]["loss_per_round_median"]
    own = cost["guarded"]["loss_per_round_median"]
    empty = cost.get("extra_statement", {}).get("loss_per_round_median")
    extra = "" if empty is None else f", of which an empty statement alone {empty:.0%}"
    return (f"{inline:.0%} in the insert's statement; {own:.0%} as a statement of its "
            f"own{extra} (median of paired rounds)", inline <= 0.10)


def _shard_moves(f: dict[str, Row]) -> tuple[str, bool] | None:
    parts = {b: e["scale"] for b, e in (f.get("shards.json") or {}).get("backends", {}).items()
             if e.get("scale")}
    if not parts:
        return None
    worst = max(x["worst_ratio"] for part in parts.values() for x in part["per_change"].values())
    overlaps = sum(part["overlaps"] for part in parts.values())
    return (f"worst {worst:.2f} times the least, {overlaps} moments with two claimants "
            f"({len(parts)} backends)"), worst <= 1.25 and not overlaps


def _shard_unowned(f: dict[str, Row]) -> tuple[str, bool] | None:
    parts = {b: e["scale"] for b, e in (f.get("shards.json") or {}).get("backends", {}).items()
             if e.get("scale")}
    if not parts:
        return None
    over = {b: max(x["unowned_ms"]["p99"] for x in part["per_change"].values()
                   if x["unowned_ms"]) for b, part in parts.items()}
    text = ", ".join(f"{b} {ms(p99)} ms (bound {ms(parts[b]['unowned_bound_ms'])})"
                     for b, p99 in over.items())
    return f"worst p99: {text}", all(p99 <= parts[b]["unowned_bound_ms"]
                                     for b, p99 in over.items())


GOALS = (
    Goal("never two leaders: every chaos run passes with 0 overlapping claims", _chaos),
    Goal("`POST /handover`: the named standby leads within two claim horizons + one "
         "round trip, 0 overlaps, every trial", _named),
    Goal("rolling update with `shutdownHandover: youngest-ready`: exactly one hand-over, "
         "every rollout", _rollout),
    Goal("`postgres`: SIGKILL → the next leader's first claim ≤ 400 ms p99",
         _p99("postgres_advisory.json", "sigkill_published_claim", 400)),
    Goal("`postgres-row`: SIGTERM → the next leader's first claim ≤ 250 ms p99 "
         "(claim horizon 250 ms)", _row_handover),
    Goal("`kubernetes`: SIGTERM → the next holder's `acquireTime` ≤ 250 ms p99",
         _p99("kubernetes.json", "sigterm_handover_sidecar", 250)),
    Goal("`postgres-row`: ≥ 2,000 renews/s over 1,000 names", _renews),
    Goal("process start → first `/healthz` 200 ≤ 300 ms p50, every backend",
         _lean("start_to_healthz_ms", 300, " ms")),
    Goal("idle RSS outside pods ≤ 48 MiB, every backend", _lean("idle_rss_mib", 48, " MiB")),
    Goal("idle leader ≤ 0.3 % of a core, every backend", _idle_cpu),
    Goal("real pods: idle sidecar RSS (`total_rss`, max) ≤ 40 MiB, every backend",
         _pods("rss", 40, " MiB")),
    Goal("real pods: pod start → sidecar ready ≤ 1.5 s p50, every backend",
         _pods("pod_start_to_sidecar_ready", 1500, " ms")),
    Goal("the `sidecar` image ≤ 134 MB (a third of the first image)", _image),
    Goal("apiserver requests of an idle group of 3 ≤ 0.3 of client-go's", _requests),
    Goal("fencing: a paused leader's stale writes through the guard: none committed, every "
         "write of the new leader committed", _fenced),
    Goal("fencing: the guard costs ≤ 10 % of single-row insert throughput (durable "
         "commits)", _fence_cost),
    Goal("shards: each change of members moves ≤ 1.25 times the least any assignment could, "
         "0 moments with two claimants", _shard_moves),
    Goal("shards: unowned time per moved shard ≤ two claim horizons + a round trip (p99)",
         _shard_unowned),
)
GOAL_SOURCES = (("chaos-sqlite.json", "chaos-sqlite"), ("chaos-postgres.json", "chaos-postgres"),
                ("chaos-postgres-row.json", "chaos-postgres-row"),
                ("chaos-kubernetes.json", "chaos-kubernetes"), ("handover.json", "handover"),
                ("rollout.json", "rollout"), ("postgres_advisory.json", "postgres_advisory"),
                ("postgres_row.json", "postgres_row"), ("kubernetes.json", "kubernetes"),
                ("lean.json", "lean"), ("core-idle.json", "core_idle"), *PODS_SOURCES,
                ("image.json", "image"), ("fence.json", "fence"), ("shards.json", "shards"))


def goals(f: dict[str, Row]) -> list[str]:
    """Each goal beside the measured figure, ✓ or ✗ computed from the figure."""
    rows = []
    for goal in GOALS:
        judged = goal.judge(f)
        rows.append([goal.text, "not measured" if judged is None else judged[0],
                     "—" if judged is None else ("✓" if judged[1] else "✗")])
    return table(["goal", "measured", "met"], rows, right=3)



@dataclass(frozen=True)
class Table:
    source: str  # the results file, under bench/results
    render: Callable[[Row], list[str]]
    bench: str  # its name for python -m bench run

    @property
    def sources(self) -> tuple[tuple[str, str], ...]:
        return ((self.source, self.bench),)


@dataclass(frozen=True)
class Combined:
    """A table drawn from several results files: ``render`` gets each file's figures by
    its name (a file not measured yet is absent), and one provenance line per file
    follows the table."""

    sources: tuple[tuple[str, str], ...]  # (results file, its name for python -m bench run)
    render: Callable[[dict[str, Row]], list[str]]


TABLES: dict[str, Table | Combined] = {
    "core": Table("core.json", core, "core"),
    "core-costs": Table("core.json", core_costs, "core"),
    "core-idle": Table("core-idle.json", core_idle, "core_idle"),
    "http-limits": Table("http-limits.json", http_limits, "http_limits"),
    "exec": Table("exec.json", exec_, "exec"),
    "sqlite-commit": Table("sqlite-commit.json", sqlite_commit, "sqlite_commit"),
    "metrics": Table("metrics.json", metrics, "metrics"),
    "longpoll": Table("longpoll.json", longpoll, "longpoll"),
    "postgres-advisory": Table("postgres_advisory.json", postgres_advisory, "postgres_advisory"),
    "postgres-row": Table("postgres_row.json", postgres_row, "postgres_row"),
    "pgbouncer-refusals": Table("pgbouncer.json", pgbouncer_refusals, "pgbouncer"),
    "pgbouncer-handovers": Table("pgbouncer.json", pgbouncer_handovers, "pgbouncer"),
    "pg-failover": Table("pg-failover.json", pg_failover, "pg_failover"),
    "kubernetes": Table("kubernetes.json", kubernetes, "kubernetes"),
    "kubernetes-foreign": Table("kubernetes-foreign.json", kubernetes_foreign,
                                "kubernetes_foreign"),
    "kube-names": Table("kube-names.json", kube_names, "kube_names"),
    "clientgo-interop": Table("clientgo-interop.json", clientgo_interop, "clientgo_interop"),
    "handover": Table("handover.json", handover, "handover"),
    "pods": Table("pods-kubernetes.json", pods, "pods"),
    "pods-usage": Table("pods-kubernetes.json", pods_usage, "pods"),
    "pods-idle-kubernetes": Table("pods-kubernetes.json", pods_idle, "pods"),
    "pods-idle-postgres": Table("pods-postgres.json", pods_idle, "pods_postgres"),
    "pods-idle-postgres-row": Table("pods-postgres-row.json", pods_idle, "pods_postgres_row"),
    "image": Table("image.json", image_sizes, "image"),
    "rollout": Table("rollout.json", rollout, "rollout"),
    "rollout-service": Table("rollout.json", rollout_service, "rollout"),
    "lean-lone": Table("lean.json", lean_lone, "lean"),
    "lean-apiserver": Table("lean.json", lean_apiserver, "lean"),
    "fence-zombie": Table("fence.json", fence_zombie, "fence"),
    "fence-cost": Table("fence.json", fence_cost, "fence"),
    "simulation": Table("simulation.json", simulation, "simulation"),
    "shards-moves": Table("shards.json", shards_moves, "shards"),
    "shards-cost": Table("shards.json", shards_cost, "shards"),
    "shards-rollout": Table("shards-rollout.json", shards_rollout, "shards_rollout"),
    **{f"chaos-{b}": Table(f"chaos-{b}.json", chaos, f"chaos-{b}")
       for b in ("sqlite", "postgres", "postgres-row", "kubernetes")},
    "handover-answer": Combined(HANDOVER_SOURCES, handover_answer),
    "pods-deletions": Combined(PODS_SOURCES, pods_deletions),
    "goals": Combined(GOAL_SOURCES, goals),
}


def provenance(source: str, bench: str, r: Row) -> str:
    """The line under every table: which file, commit, date and trial count."""
    where = f"`bench/results/{source}`"
    start, end = r.get("loadavg_at_start"), r.get("loadavg_at_end")
    load = f"load average {start[0]:g} → {end[0]:g}" if start and end else "load not recorded"
    kept = r.get("earlier_run") or {}
    earlier = ""
    if kept.get("sections"):  # a run of some sections keeps the others' figures
        when = f"commit `{kept['commit'][:7]}`" if kept.get("commit") else "unrecorded commit"
        earlier = (f" ({', '.join(f'`{x}`' for x in kept['sections'])} from an earlier run, "
                   f"{when})")
    trials = f"{r['trials']} trial{'' if r['trials'] == 1 else 's'}"
    return (f"*{where}: commit `{r['commit'][:7]}`, {r['date'][:10]}, {trials}, "
            f"{r['cores']} cores, {load}{earlier}; `python -m bench run {bench}`.*")


def overview(results: Path) -> str:
    """The ``files`` block: every results file a table uses, and what it describes."""
    rows = []
    for source in sorted({source for t in TABLES.values() for source, _ in t.sources}):
        path = results / source
        if not path.exists():
            rows.append([f"`{source}`", "missing", "", "", ""])
            continue
        r = json.loads(path.read_text())
        rows.append([f"`{source}`", f"`{r['commit'][:7]}`", r["date"][:10], r["trials"],
                     f"{r['loadavg_at_start'][0]:g} → {r['loadavg_at_end'][0]:g}"])
    return "\n".join(table(["results file", "commit", "date", "trials", "load average"],
                           rows, right=3)) + "\n"


def unvouched(results: Path) -> list[str]:
    """Results files the docs cannot stand behind, each with what to do about it."""
    shown = {source: bench for t in TABLES.values() for source, bench in t.sources}
    problems = []
    for path in sorted(results.glob("*.json")):
        if path.name not in shown:
            problems.append(f"{path.name}: no table shows it (delete it, or give it a table)")
            continue
        commit = json.loads(path.read_text()).get("commit")
        rerun = f"python -m bench run {shown[path.name]}"
        if not commit:
            problems.append(f"{path.name}: names no commit; re-run it: {rerun}")
        elif commit.endswith("+dirty"):
            problems.append(f"{path.name}: measured uncommitted code ({commit}); commit, "
                            f"then re-run it: {rerun}")
    return problems


def render(name: str, results: Path) -> str:
    if name == "files":
        return overview(results)
    t = TABLES[name]
    found = {source: json.loads((results / source).read_text())
             for source, _ in t.sources if (results / source).exists()}
    if not found:
        return "".join(f"*Not measured yet: `bench/results/{source}` is missing; "
                       f"`python -m bench run {bench}` writes it.*\n"
                       for source, bench in t.sources)
    if isinstance(t, Table):
        r = found[t.source]
        return "\n".join([*t.render(r), "", provenance(t.source, t.bench, r)]) + "\n"
    return "\n".join([*t.render(found), "", provenance_of_many(t, found)]) + "\n"


def provenance_of_many(t: Combined, found: dict[str, Row]) -> str:
    """The line under a table drawn from several files: each file's commit, date and
    trial count (the files table on docs/benchmarks.md has the rest)."""
    parts = []
    for source, _ in t.sources:
        r = found.get(source)
        if r is None:
            parts.append(f"`bench/results/{source}` not measured yet")
            continue
        trials = f"{r['trials']} trial{'' if r['trials'] == 1 else 's'}"
        parts.append(f"`bench/results/{source}`: commit `{r['commit'][:7]}`, "
                     f"{r['date'][:10]}, {trials}")
    benches = " ".join(dict.fromkeys(bench for _, bench in t.sources))
    return f"*{'; '.join(parts)}; `python -m bench run {benches}`.*"


def pages(root: Path = REPO) -> list[Path]:
    return [p for p in [root / "README.md", root / "DEVELOPMENT.md",
                        *sorted((root / "docs").rglob("*.md"))] if p.exists()]


def regenerate(text: str, results: Path, where: str) -> tuple[str, list[str]]:
    """``text`` with every block regenerated, and the names of blocks that changed."""
    changed: list[str] = []

    def one(m: re.Match[str]) -> str:
        name = m.group(2)
        if name not in TABLES and name != "files":
            raise SystemExit(f"{where}: unknown bench block {name!r} "
                             f"(known: {', '.join(TABLES)})")
        body = render(name, results)
        if body != m.group(3):
            changed.append(name)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a block differs from its results file")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--no-pictures", action="store_true")
    parser.add_argument("--images", type=Path, default=None,
                        help="where the pictures go (default: docs/images)")
    parser.add_argument("pages", nargs="*", type=Path,
                        help="default: README.md, DEVELOPMENT.md, docs/**/*.md")
    args = parser.parse_args(argv)
    if problems := unvouched(args.results):
        print(f"results files in {args.results} the docs cannot show:\n  "
              + "\n  ".join(problems), file=sys.stderr)
        return 1
    stale = []
    for page in args.pages or pages():
        text = page.read_text()
        new, changed = regenerate(text, args.results, str(page))
        if changed:
            stale += [f"{page}: {name}" for name in changed]
            if not args.check:
                page.write_text(new)
    if args.check:
        if stale:
            print("tables that differ from their results file (python -m bench.report "
                  "rewrites them):\n  " + "\n  ".join(stale), file=sys.stderr)
            return 1
        return 0
    for line in stale:
        print(f"rewrote {line}")
    if not args.no_pictures:
        from bench import plots

        for out in plots.draw_all(args.results, args.images or plots.IMAGES):
            print(f"drew {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
