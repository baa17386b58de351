"""The work watchdog of real ``lease-sidecar`` processes on one SQLite file.

Heartbeats (``POST /heartbeat``) keep a leader leading across several stall periods;
when they stop, the leader steps down one period after the last beat, says why in
``/status`` and ``/metrics``, sits out, and the other sidecar takes over — and, as a
fresh leader whose application never beats, gets the full period from its first claim
before it steps down too. All waits are bounded.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.support import (
    SidecarProcess,
    get_json,
    one_leader,
    post_json,
    serving,
    unix_time,
    wait_until,
)

STALL = 1.5
FAST = ["--lease-duration", "2s", "--renew-interval", "200ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]


def metric(proc: SidecarProcess, name: str, labels: str = 'lease="default"') -> float:
    text = get_json(proc.url + "/metrics")[1]
    found = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.M)
    assert found, f"{name}{{{labels}}} not in /metrics"
    return float(found.group(1))


def lease_status(proc: SidecarProcess) -> dict[str, Any]:
    return get_json(proc.url + "/status")[1]["leases"][0]


def stepped_down_status(proc: SidecarProcess) -> dict[str, Any] | None:
    """The lease's ``/status`` once it no longer holds the lease, else None."""
    status = lease_status(proc)
    return None if status["holding"] else status


def first_claim(body: dict[str, Any]) -> float:
    """Wall time of the term's first claim, for a term that took over a recorded
    release: the acquire (``since``) itself, with no horizon wait."""
    return unix_time(body["since"])


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    db = str(tmp_path / "leases.db")
    procs = [
        # One by flag, one by environment variable: both spellings reach the watchdog.
        SidecarProcess(tmp_path, "worker-a",
                       args=["--dsn", db, *FAST, "--work-stall-after", f"{STALL:g}s"]),
        SidecarProcess(tmp_path, "worker-b", args=["--dsn", db, *FAST],
                       env={"LEASE_WORK_STALL_AFTER": f"{int(STALL * 1000)}ms"}),
    ]
    with serving(procs):
        yield procs


def test_a_leader_whose_work_stops_beating_steps_down_and_the_other_takes_over(pair):
    leader = wait_until(lambda: one_leader(pair), timeout=10)
    other = next(p for p in pair if p is not leader)
    token = get_json(leader.url + "/leader")[1]["fencing_token"]
    assert lease_status(leader)["work"]["stall_after"] == STALL
    assert get_json(leader.url + "/status")[1]["settings"]["work_stall_after"] == STALL

    # A standby has no work to vouch for.
    status, body, _ = post_json(other.url + "/heartbeat")
    assert status == 409 and body["ok"] is False
    evil = {"Origin": "http://evil.example"}
    assert post_json(leader.url + "/heartbeat", headers=evil)[0] == 403

    # Beats every 300 ms for three stall periods: still leading, the same term.
    until = time.monotonic() + 3 * STALL
    last_beat = 0.0
    while time.monotonic() < until:
        status, body, _ = post_json(leader.url + "/heartbeat")
        assert status == 200 and body["ok"] is True, body
        last_beat = time.time()
        assert body["stall_after"] == STALL
        time.sleep(0.3)
    status, body, _ = get_json(leader.url + "/leader")
    assert status == 200 and body["fencing_token"] == token
    assert lease_status(leader)["work"]["stalls"] == 0
    assert metric(leader, "lease_sidecar_work_stalls_total") == 0

    # No more beats: the leader steps down one period after the last one.
    wait_until(lambda: leader.leader() == 503, timeout=STALL + 3)
    stepped_down = time.time()
    assert stepped_down - last_beat >= STALL - 0.05
    assert stepped_down - last_beat < STALL + 1.5
    # Claims stop first; the "released" transition follows once the lease is given back.
    mine = wait_until(lambda: stepped_down_status(leader), timeout=2)
    assert mine["reason"].startswith("work stalled: no POST /heartbeat for ")
    assert "since its last heartbeat" in mine["reason"]
    assert mine["work"]["stalls"] == 1
    assert mine["work"]["last_stall"]["reason"] == mine["reason"]
    assert mine["work"]["last_stall"]["fencing_token"] == token
    released = [t for t in mine["transitions"] if t["event"] == "released"]
    assert released and released[-1]["reason"] == mine["reason"]
    assert metric(leader, "lease_sidecar_work_stalls_total") == 1
    assert metric(leader, "lease_sidecar_transitions_total",
                  'event="released",lease="default"') == 1
    beat_metric = metric(leader, "lease_sidecar_last_work_heartbeat_timestamp_seconds")
    assert abs(beat_metric - last_beat) < 0.5
    assert not (leader.state_dir / "leader").exists()  # unpublished

    # The other sidecar takes over at once (the lease was released, not left to expire).
    wait_until(lambda: other.leader() == 200, timeout=2)
    body = get_json(other.url + "/leader")[1]
    assert body["fencing_token"] > token
    assert time.time() - stepped_down < 2
    # It sits out: the stalled one does not take the lease back meanwhile.
    assert leader.leader() == 503

    # A fresh leader whose work never beats gets the full period from its first claim
    # (at its acquire: the stalled one's release was on record).
    claimed = first_claim(body)
    wait_until(lambda: other.leader() == 503, timeout=STALL + 3)
    assert time.time() - claimed >= STALL - 0.05
    theirs = lease_status(other)
    assert "no heartbeat yet" in theirs["reason"], theirs["reason"]
    assert theirs["work"]["stalls"] == 1
    assert metric(other, "lease_sidecar_last_work_heartbeat_timestamp_seconds") == 0


def test_without_the_setting_heartbeats_are_taken_and_nothing_steps_down(tmp_path: Path):
    proc = SidecarProcess(tmp_path, "plain", args=["--dsn", str(tmp_path / "l.db"), *FAST])
    proc.start()
    try:
        proc.wait_http()
        wait_until(lambda: proc.leader() == 200, timeout=10)
        token = get_json(proc.url + "/leader")[1]["fencing_token"]
        status, body, _ = post_json(proc.url + "/heartbeat")
        assert status == 200 and body["stall_after"] is None and body["stalls_at"] is None
        time.sleep(2 * STALL)  # no beats: nothing watches them
        assert get_json(proc.url + "/leader")[1]["fencing_token"] == token
        assert lease_status(proc)["work"]["stall_after"] is None
        assert post_json(proc.url + "/heartbeat/nosuch")[0] == 404
    finally:
        proc.stop()
