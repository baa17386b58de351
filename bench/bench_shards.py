"""A shard set on real sidecars: how shards move when members come and go, and what a
shard group costs its backend; writes results/shards.json.

    flock /tmp/lease-bench.lock python -m bench.bench_shards \\
        [--backends sqlite,postgres-row,postgres,kubernetes] [--shards 256] [--trials 1] \\
        [--cost 16,256,1024]

Default timing everywhere (15 s lease, the backend's renew interval, 250 ms claim
horizon): what a user gets. Real servers: a SQLite file, the PostgreSQL test bed, the
kube-apiserver test bed (admin credentials, no pod label).

**Scale** (per backend and trial): 256 shards; 3 members, then one more joins (4), then
four more (8), then five leave with SIGTERM (3). Every member's ``GET /shards`` is
recorded every 25 ms (:class:`testkit.shards.ShardRecorder`); per change:

- moments two members claimed one shard, over every shard and the whole run (the goal:
  none);
- shards moved (changes of owner whose new claims began after the change) against the
  least any assignment could move from the owners at the change
  (:func:`sidecar.shards.assign.least_moves`; the goal: at most 1.25 times);
- time from the change (the new members' start, or the SIGTERMs) to the first moment from
  which every shard is claimed by one member of the new set and none claims more than its
  fair share;
- unowned time per moved shard: from the end of the old owner's last claim to the new
  owner's first (the goal: at most two claim horizons and one round trip; the round trip
  is the mean renew round trip of the lease ``work`` on the same backend).

**Rollout** (``--only rollout``; results/shards-rollout.json): a rolling update of 4
members (one new joins, one old leaves, four times), through the assignment alone and on
real sidecars: how many times each shard changes owner, and each move's unowned time.

**Cost** (per backend and shard count): one member alone holding every shard; over 10 renew
intervals once all are led, the round trips it makes per renew interval — SQLite: write
transactions (the file's change counter); PostgreSQL: the wire protocol's round trips
through a counting proxy (:mod:`testkit.pgcount`); kubernetes: the apiserver's requests on
Leases (``apiserver_request_total``, the apiserver's own subtracted) — with the lease
``work``'s own renew among them, and the sidecar's RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import record
from bench.bench_kube_names import lease_metrics, rss_mib
from bench.failover import pct
from sidecar.shards.assign import assign, least_moves
from testkit.chaos.checker import Interval
from testkit.pgcount import CountingProxy
from testkit.shards import (
    ShardRecorder,
    moves,
    overlaps,
    settled_at,
    terms,
    token_problems,
    unowned,
)
from testkit.support import REPO, SidecarProcess, get_json, wait_until
from testkit.testbed.kube import ControlPlane
from testkit.testbed.postgres import PgServer

HORIZON = 0.25  # the default claim horizon
POLL = 0.025
BALANCE_TIMEOUT = 240.0
RENEW = {"kubernetes": 14 / 3}  # derived renew intervals; else 2/15 of 15 s
CHANGES = (("3 → 4", 4), ("4 → 8", 8), ("8 → 3", 3))


@dataclass
class Store:
    backend: str
    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def renew_interval(self) -> float:
        return RENEW.get(self.backend, 2.0)


class Servers:
    """The test beds, started on first use and kept for the run."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._pg: PgServer | None = None
        self._cp: ControlPlane | None = None
        self._dbs = 0

    def store(self, backend: str, workdir: Path) -> Store:
        if backend == "sqlite":
            return Store(backend, ["--dsn", str(workdir / "leases.db")])
        if backend == "kubernetes":
            if self._cp is None:
                self._cp = self._stack.enter_context(ControlPlane())
            namespace = self._cp.create_namespace("shards")
            return Store(backend, ["--backend", "kubernetes", "--pod-label", "off"],
                         {"KUBECONFIG": str(self._cp.kubeconfig), "POD_NAMESPACE": namespace})
        if self._pg is None:
            self._pg = self._stack.enter_context(PgServer())
        self._dbs += 1
        database = f"shards{self._dbs}"
        self._pg.create_database(database)
        dsn = self._pg.dsn_for(database)
        if backend == "postgres-row":
            subprocess.run([sys.executable, "-m", "sidecar", "schema", "--apply", "--backend",
                            backend, "--dsn", dsn], check=True, cwd=REPO,
                           capture_output=True, timeout=60)
        return Store(backend, ["--backend", backend, "--dsn", dsn])

    @property
    def control_plane(self) -> ControlPlane | None:
        return self._cp


def member(workdir: Path, store: Store, name: str, shards: int) -> SidecarProcess:
    return SidecarProcess(workdir, name, args=[*store.flags, "--name", "work", "--shards",
                                                str(shards)], env=store.env)


def owners_at(spans: dict[str, list[Any]], moment: float) -> dict[str, str | None]:
    """Who claimed each shard at ``moment`` (None: nobody), from the recorded claims."""
    found: dict[str, str | None] = {}
    for shard, claims in spans.items():
        held: list[Interval] = [iv for iv in terms(claims) if iv.start <= moment < iv.end]
        found[shard] = held[0].who[0] if held else None
    return found


def renew_rtt(proc: SidecarProcess) -> float | None:
    """Mean round trip of the lease ``work``'s renews, from the member's /metrics."""
    text = get_json(proc.url + "/metrics", timeout=5)[1]
    if not isinstance(text, str):
        return None
    total = re.search(r'lease_sidecar_renew_duration_seconds_sum\{lease="work",'
                      r'outcome="held"\} (\S+)', text)
    count = re.search(r'lease_sidecar_renew_duration_seconds_count\{lease="work",'
                      r'outcome="held"\} (\S+)', text)
    if not total or not count or float(count[1]) == 0:
        return None
    return float(total[1]) / float(count[1])


def scale(store: Store, shards: int, workdir: Path) -> dict[str, Any]:
    """3 → 4 → 8 → 3 members (see the module doc); figures per change."""
    procs: dict[str, SidecarProcess] = {}
    rows: list[dict[str, Any]] = []
    names = [f"m{i}" for i in range(8)]
    rtts: list[float] = []
    stuck: str | None = None
    try:
        for name in names[:3]:
            procs[name] = member(workdir, store, name, shards).start()
        for proc in procs.values():
            proc.wait_http(30)
        with ShardRecorder({n: p.url for n, p in procs.items()}, HORIZON, POLL) as recorder:
            wait_until(lambda: recorder.settled(names[:3], shards), BALANCE_TIMEOUT, 0.2)
            alive = names[:3]
            for label, size in CHANGES:
                changed = time.time()
                before = owners_at(recorder.spans, changed)
                if size > len(alive):
                    joining = names[len(alive):size]
                    for name in joining:
                        procs[name] = member(workdir, store, name, shards).start()
                    for name in joining:
                        procs[name].wait_http(30)
                        recorder.add(name, procs[name].url)
                    alive = names[:size]
                else:
                    leaving = alive[size:]
                    for name in leaving:
                        procs[name].signal(signal.SIGTERM)
                    for name in leaving:
                        proc = procs[name].proc
                        assert proc is not None
                        proc.wait(60)
                        recorder.remove(name)
                    alive = alive[:size]
                try:
                    wait_until(lambda alive=alive: recorder.settled(alive, shards),
                               BALANCE_TIMEOUT, 0.2)
                except TimeoutError:
                    # The claims recorded so far still count for safety: a trial that
                    # never balances may be the one where two members claimed a shard.
                    stuck = (f"{label}: not balanced within {BALANCE_TIMEOUT:g} s; "
                             f"{recorder.spread(alive, shards)}")
                    print(stuck, file=sys.stderr)
                    break
                time.sleep(1.0)  # claims after the balance, so the sweep sees it hold
                ended = time.time()
                at = settled_at(recorder.spans, alive, changed, ended)
                moved = moves(recorder.spans, changed, ended)
                gaps = unowned(recorder.spans, changed, ended)
                rows.append({
                    "change": label, "members": size,
                    "moved": sum(map(len, moved.values())),
                    "least": least_moves(before, alive),
                    "shards_moved_twice": sum(1 for steps in moved.values() if len(steps) > 1),
                    "balanced_after_s": None if at is None else round(at - changed, 2),
                    "unowned_ms": [round(g * 1000, 1) for g in gaps],
                })
                for name in alive:
                    if (rtt := renew_rtt(procs[name])) is not None:
                        rtts.append(rtt)
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "unowned_ms"}),
                      file=sys.stderr)
        safety = {"shards_recorded": len(recorder.spans),
                  "overlaps": sum(len(v) for v in overlaps(recorder.spans).values()),
                  "token_problems": len(token_problems(recorder.spans)),
                  "polls": recorder.polls}
    finally:
        for proc in procs.values():
            proc.stop(30)
    return {"changes": rows, **safety, "stuck": stuck,
            "renew_rtt_ms": round(statistics.mean(rtts) * 1000, 1) if rtts else None}


@contextmanager
def counted(store: Store, servers: Servers) -> Iterator[tuple[Store, Callable[[], float]]]:
    """The store (through a counting proxy on PostgreSQL) and a count of its round trips
    (see the module doc)."""
    if store.backend == "sqlite":
        db = Path(store.flags[1])
        yield store, lambda: float(int.from_bytes(db.read_bytes()[24:28], "big"))
        return
    if store.backend == "kubernetes":
        cp = servers.control_plane
        assert cp is not None
        yield store, lambda: sum(lease_metrics(cp)[0].values())
        return
    dsn = store.flags[store.flags.index("--dsn") + 1]
    parts = urllib.parse.urlsplit(dsn)
    with CountingProxy((parts.hostname or "127.0.0.1", parts.port or 5432)) as proxy:
        flags = list(store.flags)
        flags[flags.index("--dsn") + 1] = proxy.dsn(dsn)
        yield Store(store.backend, flags, store.env), lambda: float(proxy.round_trips)


def cost(store: Store, shards: int, workdir: Path, servers: Servers,
         own_per_s: float) -> dict[str, Any]:
    """One member holding ``shards`` shards: round trips per renew interval."""
    intervals = 10
    with counted(store, servers) as (counted_store, count):
        proc = member(workdir, counted_store, f"solo{shards}", shards).start()
        try:
            proc.wait_http(30)
            started = time.monotonic()
            try:
                # An unanswered request (None) counts as not yet: the member may be busy.
                wait_until(lambda: (get_json(proc.url + "/shards", timeout=10)[1] or {})
                           .get("count") == shards, BALANCE_TIMEOUT, 0.5)
            except TimeoutError:
                led = get_json(proc.url + "/shards", timeout=10)[1]
                tail = [line[:300] for line in proc.logs().splitlines()
                        if '"acquired lease"' not in line][-5:]
                raise RuntimeError(f"{led.get('count') if isinstance(led, dict) else '?'} of "
                                   f"{shards} led after {BALANCE_TIMEOUT:g} s; log: "
                                   f"{tail}") from None
            held = time.monotonic() - started
            time.sleep(2 * store.renew_interval)
            assert proc.proc is not None
            before, t0, cpu0 = count(), time.monotonic(), cpu_seconds(proc.proc.pid)
            time.sleep(intervals * store.renew_interval)
            seen, elapsed = count() - before, time.monotonic() - t0
            cpu = (cpu_seconds(proc.proc.pid) - cpu0) / elapsed
            led = (get_json(proc.url + "/shards", timeout=10)[1] or {}).get("count")
            rss = rss_mib(proc.proc.pid)
        finally:
            proc.stop(60)
    seen -= own_per_s * elapsed  # the apiserver's own requests on Leases
    per_interval = seen / (elapsed / store.renew_interval)
    return {"shards": shards, "round_trips_per_renew_interval": round(per_interval, 2),
            "led_at_end": led, "all_held_after_s": round(held, 1), "rss_mib": rss,
            "cpu_percent": round(cpu * 100, 1)}


def cpu_seconds(pid: int) -> float:
    """The process's user and system CPU time so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def apiserver_own(servers: Servers, seconds: float = 20.0) -> float:
    """The apiserver's own requests on Leases per second, with no sidecar running."""
    cp = servers.control_plane
    assert cp is not None
    before, t0 = sum(lease_metrics(cp)[0].values()), time.monotonic()
    time.sleep(seconds)
    return (sum(lease_metrics(cp)[0].values()) - before) / (time.monotonic() - t0)


def summarize(trials: list[dict[str, Any]], horizon: float) -> dict[str, Any]:
    """Per change, over the trials: moves against the least, balance and unowned times."""
    out: dict[str, Any] = {}
    for label, _ in CHANGES:
        rows = [row for trial in trials for row in trial["changes"] if row["change"] == label]
        gaps = [g for row in rows for g in row["unowned_ms"]]
        balanced = [row["balanced_after_s"] for row in rows if row["balanced_after_s"]]
        out[label] = {
            "moved": [row["moved"] for row in rows], "least": [row["least"] for row in rows],
            "worst_ratio": round(max(row["moved"] / row["least"] for row in rows), 3),
            "moved_twice": sum(row["shards_moved_twice"] for row in rows),
            "balanced_s": {"n": len(balanced), "p50": round(statistics.median(balanced), 2),
                           "p99": round(pct(balanced, 99), 2)} if balanced else None,
            "unowned_ms": {"n": len(gaps), "p50": round(statistics.median(gaps), 1),
                           "p99": round(pct(gaps, 99), 1), "max": round(max(gaps), 1)}
            if gaps else None,
        }
    rtts = [t["renew_rtt_ms"] for t in trials if t["renew_rtt_ms"] is not None]
    rtt = statistics.mean(rtts) if rtts else 0.0
    return {"per_change": out,
            "overlaps": sum(t["overlaps"] for t in trials),
            "token_problems": sum(t["token_problems"] for t in trials),
            "shards_recorded": min(t["shards_recorded"] for t in trials),
            "renew_rtt_ms": round(rtt, 1),
            "unowned_bound_ms": round(2 * horizon * 1000 + rtt, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgres-row,postgres,kubernetes")
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--cost", default="16,256,1024",
                        help="shard counts of the cost rows ('' for none)")
    parser.add_argument("--only", choices=("scale", "cost", "rollout"), default=None,
                        help="rollout: a rolling update of 4 members (the assignment alone, "
                             "and real sidecars on the first of --backends), written to "
                             "shards-rollout.json")
    parser.add_argument("--out", default="shards.json")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if args.only == "rollout":
        rollout_main(backends[0], args.shards)
        return
    costs = [int(c) for c in args.cost.split(",") if c]
    run = record.start(args.trials)
    results: dict[str, Any] = {"shards": args.shards, "claim_horizon_ms": HORIZON * 1000,
                               "poll_ms": POLL * 1000, "backends": {}}
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp, ExitStack() as stack:
        servers = Servers(stack)
        for backend in backends:
            entry: dict[str, Any] = {}
            if args.only in (None, "scale"):
                trials, failed = [], []
                for trial in range(args.trials):
                    print(f"{backend}: scale, trial {trial + 1}", file=sys.stderr)
                    workdir = Path(tmp) / f"{backend}-scale-{trial}"
                    workdir.mkdir()
                    try:
                        trials.append(scale(servers.store(backend, workdir), args.shards,
                                            workdir))
                        if trials[-1]["stuck"]:
                            failed.append(f"trial {trial + 1}: {trials[-1]['stuck']}")
                    except Exception as exc:  # the trial says why; the others count
                        failed.append(f"trial {trial + 1}: {type(exc).__name__}: "
                                      f"{str(exc)[:300]}")
                        print(failed[-1], file=sys.stderr)
                if trials:
                    # A stuck trial's changes up to the stuck one are figures; its
                    # claims count for safety; it is named among the failed.
                    entry["scale"] = {**summarize(trials, HORIZON),
                                      "trials": sum(1 for t in trials if not t["stuck"]),
                                      "failed_trials": failed}
                entry["scale_trials"] = trials
            if args.only in (None, "cost") and costs:
                own = apiserver_own(servers) if backend == "kubernetes" else 0.0
                rows = []
                for count in costs:
                    print(f"{backend}: cost, {count} shards", file=sys.stderr)
                    workdir = Path(tmp) / f"{backend}-cost-{count}"
                    workdir.mkdir()
                    try:
                        rows.append(cost(servers.store(backend, workdir), count, workdir,
                                         servers, own))
                    except Exception as exc:  # a row that could not run says why
                        rows.append({"shards": count, "error": f"{type(exc).__name__}: "
                                                                f"{str(exc)[:200]}"})
                    print(json.dumps(rows[-1]), file=sys.stderr)
                entry["cost"] = rows
                entry["renew_interval_s"] = round(RENEW.get(backend, 2.0), 2)
            results["backends"][backend] = entry
            # After each backend: a run that fails later keeps what it measured.
            record.write(args.out, run, {**results, "complete": False})
    path = record.write(args.out, run, {**results, "complete": True})
    print(f"wrote {path}")
    for backend, entry in results["backends"].items():
        scale_part = entry.get("scale")
        if scale_part:
            print(backend, json.dumps(scale_part))
        for row in entry.get("cost", []):
            print(backend, json.dumps(row))
    if any(entry.get("scale", {}).get("overlaps") for entry in results["backends"].values()):
        sys.exit(1)


def rollout_assignment(shards: int, pods: int, trials: int = 20) -> dict[str, Any]:
    """The assignment alone (no processes) through a rolling update of ``pods`` pods
    that adds one new pod, then removes one old (oldest first), until all are new; each
    change settled before the next: how many times each shard changes owner."""
    names = [f"work-{i}" for i in range(shards)]
    worst, means = [], []
    for trial in range(trials):
        old = [f"old{trial}-{i}" for i in range(pods)]
        new = [f"new{trial}-{i}" for i in range(pods)]
        members = list(old)
        owner = assign(names, members)
        changes = dict.fromkeys(names, 0)
        for i in range(pods):
            for step in ("add", "remove"):
                members = [*members, new[i]] if step == "add" else \
                    [m for m in members if m != old[i]]
                now = assign(names, members)
                for shard in names:
                    changes[shard] += now[shard] != owner[shard]
                owner = now
        worst.append(max(changes.values()))
        means.append(statistics.mean(changes.values()))
    return {"pods": pods, "trials": trials, "max_changes_per_shard": max(worst),
            "mean_changes_per_shard": round(statistics.mean(means), 2)}


def rollout(store: Store, shards: int, workdir: Path, pods: int = 4) -> dict[str, Any]:
    """Real sidecars through the same rolling update: per shard, its changes of owner,
    and each move's unowned time."""
    procs: dict[str, SidecarProcess] = {}
    old = [f"old-{i}" for i in range(pods)]
    new = [f"new-{i}" for i in range(pods)]
    try:
        for name in old:
            procs[name] = member(workdir, store, name, shards).start()
        for proc in procs.values():
            proc.wait_http(30)
        with ShardRecorder({n: p.url for n, p in procs.items()}, HORIZON, POLL) as recorder:
            alive = list(old)
            wait_until(lambda: recorder.settled(alive, shards), BALANCE_TIMEOUT, 0.2)
            started = time.time()
            for i in range(pods):
                procs[new[i]] = member(workdir, store, new[i], shards).start()
                procs[new[i]].wait_http(30)
                recorder.add(new[i], procs[new[i]].url)
                alive = [*alive, new[i]]
                wait_until(lambda alive=alive: recorder.settled(alive, shards),
                           BALANCE_TIMEOUT, 0.2)
                procs[old[i]].signal(signal.SIGTERM)
                gone = procs[old[i]].proc
                assert gone is not None
                gone.wait(60)
                recorder.remove(old[i])
                alive = [m for m in alive if m != old[i]]
                wait_until(lambda alive=alive: recorder.settled(alive, shards),
                           BALANCE_TIMEOUT, 0.2)
            time.sleep(1.0)
            ended = time.time()
            moved = moves(recorder.spans, started, ended)
            gaps = unowned(recorder.spans, started, ended)
            per_shard = [len(moved.get(s, [])) for s in recorder.spans]
            return {"pods": pods, "shards": shards,
                    "max_changes_per_shard": max(per_shard),
                    "mean_changes_per_shard": round(statistics.mean(per_shard), 2),
                    "shards_changed_more_than_twice": sum(1 for n in per_shard if n > 2),
                    "unowned_ms": {"n": len(gaps),
                                   "p50": round(statistics.median(gaps) * 1000, 1),
                                   "p99": round(pct(gaps, 99) * 1000, 1)} if gaps else None,
                    "overlaps": sum(len(v) for v in overlaps(recorder.spans).values()),
                    "token_problems": len(token_problems(recorder.spans))}
    finally:
        for proc in procs.values():
            proc.stop(30)


def rollout_main(backend: str, shards: int) -> None:
    run = record.start(1)
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp, ExitStack() as stack:
        servers = Servers(stack)
        workdir = Path(tmp) / "rollout"
        workdir.mkdir()
        processes = rollout(servers.store(backend, workdir), shards, workdir)
    path = record.write("shards-rollout.json", run, {
        "backend": backend, "assignment": rollout_assignment(shards, 4),
        "processes": processes})
    print(json.dumps({"assignment": rollout_assignment(shards, 4), "processes": processes}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
