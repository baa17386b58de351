"""Deliberate hand-overs between real sidecar processes, for the integration test and
``bench/bench_handover.py``.

Three sidecars share one lease; per trial the leader is asked (``POST /handover?to=`` or
``lease-sidecar handover --to``) to hand over to one of the two standbys, picked at
random; the trial times the request until the named standby answers ``200`` on
``/leader``. A :class:`~testkit.support.ClaimRecorder` polls every sidecar throughout
and counts overlapping published claims. Between trials the harness waits out the old
leader's sit-out (one lease duration) so *both* standbys are in the race each time: the
named one must win against a rival that is free to try.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from testkit.support import (
    REPO,
    ClaimRecorder,
    SidecarProcess,
    one_leader,
    post_json,
    unix_time,
    wait_until,
)

# A 2 s lease; 100 ms claim horizon: the hand-over's floor is one horizon where the
# release is on record, two on the advisory lock.
LEASE_DURATION = 2.0
CLAIM_HORIZON = 0.1
FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]
BACKENDS = ("sqlite", "postgres", "postgres-row", "kubernetes")


def backend_args(backend: str, dsn: str) -> list[str]:
    extra = ["--ensure-schema", "true"] if backend == "postgres-row" else []
    return ["--backend", backend, "--dsn", dsn, "--name", "handover", *extra, *FAST]


@dataclass
class Trial:
    leader: str
    target: str
    seconds: float  # request sent -> the target answers 200
    via: str  # "http" or "cli"
    sent_wall: float = 0.0
    # From the end of the old leader's last claim to the target's first claim seen by
    # the recorder: the time nobody led (None: the recorder saw too little).
    gap: float | None = None
    # The hand-over's moments in seconds after the request (None: not seen), for the
    # timeline in docs/benchmarks.md: the old leader's last claim running out, its
    # "stepped down" log line (written once the release returned), the target's
    # "acquired lease" log line and its first claim seen by the recorder.
    timeline: dict[str, float | None] = field(default_factory=dict)


@dataclass
class Run:
    backend: str
    trials: list[Trial] = field(default_factory=list)
    overlaps: int = 0
    claims: int = 0


def handover_cli(leader: SidecarProcess, target: str, lease: str = "handover") -> int:
    """``lease-sidecar handover --to`` against the leader's endpoint; its exit code."""
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "handover", "--name", lease,
         "--http-addr", f"127.0.0.1:{leader.port}", "--to", target],
        cwd=REPO, capture_output=True, timeout=30).returncode


def run_trials(backend: str, dsn: str, workdir: Path, trials: int, seed: int = 21,
               cli_every: int = 2, procs: list[SidecarProcess] | None = None,
               lease: str = "handover", lease_duration: float = LEASE_DURATION) -> Run:
    """``trials`` hand-overs on one backend; every ``cli_every``-th one through the CLI.
    ``procs``: sidecars made (not started) by the caller, where they need more than a DSN
    (the kubernetes backend's pods and credentials)."""
    rng = random.Random(seed)
    if procs is None:
        args = backend_args(backend, dsn)
        procs = [SidecarProcess(workdir, f"{backend}-{i}", args=list(args))
                 for i in range(3)]
    for proc in procs:
        proc.start()
    run = Run(backend)
    try:
        for proc in procs:
            proc.wait_http()
        with ClaimRecorder(procs) as recorder:
            for number in range(trials):
                leader = wait_until(lambda: one_leader(procs, timeout=0.5), timeout=30)
                # Both standbys campaign again (the previous leader's sit-out is over),
                # and each has reached its steady wait.
                time.sleep(lease_duration + 0.5)
                target = rng.choice([p for p in procs if p is not leader])
                via = "cli" if cli_every and number % cli_every == 1 else "http"
                sent, sent_wall = time.monotonic(), time.time()
                if via == "cli":
                    code = handover_cli(leader, target.identity, lease)
                    assert code == 0, f"handover CLI exited {code}:\n{leader.logs()[-3000:]}"
                else:
                    status = post_json(f"{leader.url}/handover/{lease}?to={target.identity}")[0]
                    assert status == 202, f"POST /handover answered {status}"
                wait_until(lambda t=target: t.leader(timeout=0.5) == 200, timeout=30,
                           interval=0.002)
                run.trials.append(Trial(leader.identity, target.identity,
                                        time.monotonic() - sent, via, sent_wall))
            time.sleep(0.3)
        run.overlaps = len(recorder.overlaps())
        run.claims = len(recorder.claims)
        by_identity = {p.identity: p for p in procs}
        for trial in run.trials:
            trial.gap = leaderless_gap(recorder.claims, trial)
            trial.timeline = timeline(recorder.claims, trial, by_identity[trial.leader],
                                      by_identity[trial.target])
    finally:
        for proc in procs:
            proc.stop()
    return run


def leaderless_gap(claims: list[tuple[str, float, float]], trial: Trial) -> float | None:
    """Seconds between the old leader's last claim running out and the target's first
    claim, both as the recorder saw them (wall clock of this one host)."""
    first = min((seen for who, seen, _ in claims
                 if who == trial.target and seen >= trial.sent_wall), default=None)
    if first is None:
        return None
    last = max((until for who, seen, until in claims
                if who == trial.leader and seen < first), default=None)
    return None if last is None else max(0.0, first - last)


def logged_at(proc: SidecarProcess, message: str, after: float) -> float | None:
    """Wall time of ``proc``'s first log line ``message`` at or after ``after``."""
    for line in proc.logs().splitlines():
        if f'"{message}"' in line:
            at = unix_time(json.loads(line)["ts"])
            # The log's stamp is rounded down to the millisecond.
            if at >= after - 0.001:
                return at
    return None


def timeline(claims: list[tuple[str, float, float]], trial: Trial, old: SidecarProcess,
             new: SidecarProcess) -> dict[str, float | None]:
    """Trial.timeline: each moment in seconds after the request was sent."""
    first = min((seen for who, seen, _ in claims
                 if who == trial.target and seen >= trial.sent_wall), default=None)
    last = max((until for who, seen, until in claims
                if who == trial.leader and (first is None or seen < first)), default=None)
    moments = {"old_last_claim_until": last,
               "old_stepped_down": logged_at(old, "stepped down", trial.sent_wall),
               "new_acquired": logged_at(new, "acquired lease", trial.sent_wall),
               "new_first_claim": first}
    return {name: None if at is None else round(at - trial.sent_wall, 4)
            for name, at in moments.items()}
