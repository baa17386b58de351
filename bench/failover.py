"""Shared by the failover benchmarks: signal the leader, time the standby's takeover."""

from __future__ import annotations

import json
import signal
import statistics
import time
from pathlib import Path

from testkit.support import SidecarProcess, one_leader, unix_time, wait_until


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": round(statistics.median(values) * 1000, 1),
            "p99_ms": round(pct(values, 99) * 1000, 1),
            "max_ms": round(max(values) * 1000, 1)}


def acquired_at(proc: SidecarProcess, after: float) -> float | None:
    """Wall time of the first 'acquired lease' log line after ``after``."""
    for line in proc.logs().splitlines():
        if '"acquired lease"' in line:
            at = unix_time(json.loads(line)["ts"])
            if at >= after:
                return at
    return None


def failover_trials(sig: signal.Signals, trials: int, args: list[str], workdir: Path,
                    contenders: int = 3, settle: float = 0.0,
                    timeout: float = 30.0) -> dict[str, list[float]]:
    """Per trial: signal the one leader, time until a standby holds the lease ("lease",
    from its log line) and answers 200 ("claim"); replace the signalled process.

    ``settle`` lets standbys reach their steady-state wait before the signal.
    """
    name = sig.name.lower()
    procs = [SidecarProcess(workdir, f"{name}-{i}", args=list(args)).start()
             for i in range(contenders)]
    lease_times: list[float] = []
    claim_times: list[float] = []
    try:
        for proc in procs:
            proc.wait_http()
        for trial in range(trials):
            leader = wait_until(lambda: one_leader(procs, timeout=0.5), timeout=timeout)
            others = [p for p in procs if p is not leader]
            time.sleep(settle)
            wall0, mono0 = time.time(), time.monotonic()
            leader.signal(sig)
            successor = wait_until(lambda rest=others: one_leader(rest, timeout=0.5),
                                   timeout=timeout, interval=0.002)
            claim_times.append(time.monotonic() - mono0)
            at = acquired_at(successor, wall0)
            if at is not None:
                lease_times.append(at - wall0)
            leader.stop()
            index = procs.index(leader)
            procs[index] = SidecarProcess(workdir, f"{name}-{index}-{trial}",
                                          args=list(args)).start()
            procs[index].wait_http()
    finally:
        for proc in procs:
            proc.stop()
    return {"lease": lease_times, "claim": claim_times}
