"""Long-poll wake-ups on an idle lease, and how fast a real change wakes waiters.

    python -m bench.bench_longpoll [--minutes 1] [--wait 20] [--waiters 4]
                                   [--handovers 10] [--source DIR] [--out FILE]

Two real sidecars on one SQLite file (lease 3 s, renew 300 ms, horizon 250 ms). Idle
phase: ``--waiters`` clients per sidecar loop on ``GET /leader?wait=WAIT`` with the
ETag of their last answer for ``--minutes``; an answer that comes before its wait ran
out is a wake-up. Nothing changes leadership meanwhile, so every wake-up is one a
waiter did not need (target: 0 per minute; only the ``wait`` timeouts return).
Handover phase: each round parks a waiter on both sidecars, ``POST /release`` to the
leader, and measures how long the leader's waiter takes to hear "not leader" and how
long after its first claim (``since`` + the claim delay its "acquired lease" log line
gives: one horizon, or none after a recorded release) the standby's waiter hears
"leader".

``--source DIR`` runs the sidecars from another checkout (``git archive <commit> | tar
-x -C DIR``), the same client code measuring: that is the "before" figure.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import record
from testkit.support import SidecarProcess, get_json, long_poll, one_leader, unix_time, wait_until

HORIZON = 0.25
SETTINGS = ["--lease-duration", "3s", "--renew-interval", "300ms", "--renew-deadline", "2s",
            "--claim-horizon", "250ms"]


def renews(proc: SidecarProcess) -> float:
    """Renews that held, from the metrics of either version of the sidecar."""
    text = get_json(proc.url + "/metrics")[1]
    found = re.search(r'^(?:lease_sidecar_)?renew_duration_seconds_count\{lease="default",'
                      r'outcome="held"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else float("nan")


def claim_delay(proc: SidecarProcess) -> float:
    """Seconds from the acquire to the first claim of the sidecar's latest term, from its
    "acquired lease" log line (none after a release recorded as over; one horizon
    otherwise, and in versions whose line does not say)."""
    delays = [json.loads(line).get("claim_delay_ms") for line in proc.logs().splitlines()
              if '"acquired lease"' in line]
    return HORIZON if not delays or delays[-1] is None else delays[-1] / 1000


class Waiter(threading.Thread):
    def __init__(self, url: str, wait: float, until: float) -> None:
        super().__init__(daemon=True)
        self.url, self.wait, self.until = url, wait, until
        self.wakeups = 0
        self.timeouts = 0
        self.unchanged_wakeups = 0  # early, and the ETag said nothing changed

    def run(self) -> None:
        tag = long_poll(self.url, None, 0).tag
        while time.monotonic() < self.until:
            answer = long_poll(self.url, tag, self.wait)
            if answer.status == 0:
                time.sleep(0.1)
                continue
            if answer.waited >= self.wait - 0.5:
                self.timeouts += 1
            else:
                self.wakeups += 1
                self.unchanged_wakeups += answer.tag == tag
            tag = answer.tag


def idle_phase(procs: list[SidecarProcess], leader: SidecarProcess, args: argparse.Namespace
               ) -> dict[str, Any]:
    seconds = args.minutes * 60
    until = time.monotonic() + seconds
    before = renews(leader)
    waiters = {p.identity: [Waiter(p.url, args.wait, until) for _ in range(args.waiters)]
               for p in procs}
    for group in waiters.values():
        for waiter in group:
            waiter.start()
    for group in waiters.values():
        for waiter in group:
            waiter.join(seconds + args.wait + 30)
    result: dict[str, Any] = {"seconds": seconds, "renews": renews(leader) - before}
    for proc in procs:
        group = waiters[proc.identity]
        wakeups = sum(w.wakeups for w in group)
        result["leader" if proc is leader else "standby"] = {
            "waiters": len(group),
            "wakeups": wakeups,
            "wakeups_per_minute_per_waiter": round(wakeups / len(group) / args.minutes, 1),
            "wakeups_with_unchanged_etag": sum(w.unchanged_wakeups for w in group),
            "timeouts": sum(w.timeouts for w in group),
        }
    return result


def one_handover(leader: SidecarProcess, standby: SidecarProcess) -> tuple[float, float]:
    """(ms from POST /release to the leader's waiter hearing 503, ms from the standby's
    first claim to its waiter hearing 200)."""
    results: dict[str, Any] = {}

    def lead_waiter() -> None:
        tag = long_poll(leader.url, None, 0).tag
        until = time.monotonic() + 10
        while time.monotonic() < until:  # an older version answers at every renew
            answer = long_poll(leader.url, tag, 30)
            tag = answer.tag
            if answer.status != 200:
                results["leader"] = (answer.status, time.monotonic())
                return

    def standby_waiter() -> None:
        tag = long_poll(standby.url, None, 0).tag
        # The holder changes at the acquire, then the first claim comes (an older
        # version also answers at every state change: bounded by time, not count).
        until = time.monotonic() + 10
        while time.monotonic() < until:
            answer = long_poll(standby.url, tag, 30)
            tag = answer.tag
            if answer.status == 200:
                results["standby"] = (answer.body, time.time())
                return

    threads = [threading.Thread(target=lead_waiter), threading.Thread(target=standby_waiter)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # both parked, through renews
    asked = time.monotonic()
    assert leader.release() == 202
    for thread in threads:
        thread.join(40)
    status, answered = results["leader"]
    assert status == 503, status
    body, answered_wall = results["standby"]
    claim_from = unix_time(body["since"]) + claim_delay(standby)
    return (answered - asked) * 1000, (answered_wall - claim_from) * 1000


def handover_phase(procs: list[SidecarProcess], rounds: int) -> dict[str, Any]:
    step_down_ms: list[float] = []
    first_claim_ms: list[float] = []
    for _ in range(rounds):
        leader = wait_until(lambda: one_leader(procs), timeout=15)
        standby = next(p for p in procs if p is not leader)
        holder = leader.identity
        # The standby must be contending again (not sitting out a previous release).
        wait_until(lambda s=standby, h=holder: long_poll(s.url, None, 0).body["holder"] == h, 10)
        down, first = one_handover(leader, standby)
        step_down_ms.append(down)
        first_claim_ms.append(first)
        time.sleep(3.2)  # the released one sits out one lease duration
    return {"rounds": rounds, "release_to_leader_answer_ms": summary(step_down_ms),
            "first_claim_to_standby_answer_ms": summary(first_claim_ms)}


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 1),
            "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 1),
            "max": round(ordered[-1], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--wait", type=float, default=20.0)
    parser.add_argument("--waiters", type=int, default=4)
    parser.add_argument("--handovers", type=int, default=10)
    parser.add_argument("--source", type=Path, default=None,
                        help="run the sidecars from this checkout instead")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/longpoll.json")
    args = parser.parse_args()
    run = record.start(args.handovers)
    env: dict[str, str] = {}
    if args.source is not None:
        # -P semantics: the bench's own directory must not shadow the other checkout.
        env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": str(args.source.resolve())}
    workdir = Path(tempfile.mkdtemp(prefix="bench-longpoll-"))
    procs = [SidecarProcess(workdir, f"lp-{i}", env=env,
                            args=["--dsn", str(workdir / "leases.db"), *SETTINGS]).start()
             for i in range(2)]
    try:
        for proc in procs:
            proc.wait_http()
        leader = wait_until(lambda: one_leader(procs), timeout=15)
        time.sleep(1.0)
        result = {"source": str(args.source) if args.source else "this checkout",
                  "settings": " ".join(SETTINGS), "wait_s": args.wait,
                  "idle": idle_phase(procs, leader, args)}
        if args.handovers:
            result["handover"] = handover_phase(procs, args.handovers)
    finally:
        for proc in procs:
            proc.stop()
    idle = result["idle"]
    print(f"idle {idle['seconds']:g} s, wait={args.wait:g} s, {idle['renews']:g} renews:")
    for role in ("leader", "standby"):
        r = idle[role]
        print(f"  {role}: {r['wakeups_per_minute_per_waiter']} wake-ups/min per waiter "
              f"({r['wakeups']} over {r['waiters']} waiters, {r['wakeups_with_unchanged_etag']} "
              f"with an unchanged ETag), {r['timeouts']} wait timeouts")
    if "handover" in result:
        h = result["handover"]
        print(f"handover x{h['rounds']}: POST /release -> leader's waiter answered 503 "
              f"p50 {h['release_to_leader_answer_ms']['p50']} ms, "
              f"max {h['release_to_leader_answer_ms']['max']} ms; standby's first claim -> "
              f"its waiter answered 200 p50 {h['first_claim_to_standby_answer_ms']['p50']} ms, "
              f"max {h['first_claim_to_standby_answer_ms']['max']} ms")
    record.write("longpoll.json", run, result, args.out)


if __name__ == "__main__":
    main()
