"""A shard set (``LEASE_SHARDS``) on real ``lease-sidecar`` processes sharing one SQLite
file: spread evenly, moved on joins and leaves without two claimants of any shard, and
renewed with one transaction per member per renew interval."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from sidecar.shards.assign import assign
from testkit.shards import ShardRecorder, moves, overlaps, token_problems
from testkit.support import REPO, SidecarProcess, get_json, serving, wait_until

FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--safety-margin", "300ms",
        "--claim-horizon", "100ms"]
HORIZON = 0.1
SHARDS = 12


def member(tmp_path: Path, name: str, shards: str = str(SHARDS),
           extra: tuple[str, ...] = ()) -> SidecarProcess:
    return SidecarProcess(tmp_path, name, args=["--dsn", str(tmp_path / "leases.db"),
                                                 "--name", "work", "--shards", shards,
                                                 *FAST, *extra])


def status(tmp_path: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "sidecar", "status", "--json", "--dsn",
                           str(tmp_path / "leases.db"), "--name", "work", "--shards",
                           str(SHARDS)], capture_output=True, text=True, timeout=30,
                          cwd=REPO, check=True)
    return json.loads(done.stdout)["shards"]


def changes(before: list[str], after: list[str]) -> dict[str, list[tuple[str, str]]]:
    """What the assignment moves when the members change from ``before`` to ``after``."""
    shards = [f"work-{i}" for i in range(SHARDS)]
    old, new = assign(shards, before), assign(shards, after)
    return {s: [(old[s], new[s])] for s in shards if old[s] != new[s]}


def test_members_share_the_shards_and_move_them_without_two_claimants(tmp_path: Path) -> None:
    first = [member(tmp_path, f"m{i}") for i in range(2)]
    with serving(first) as procs, ShardRecorder(
            {p.identity: p.url for p in procs}, HORIZON) as recorder:
        wait_until(lambda: recorder.settled(["m0", "m1"], SHARDS), timeout=20)
        assert sorted(recorder.counts().values()) == [6, 6]
        # Each shard has a file of its own, and /leader/{shard} answers for it.
        holder = procs[0]
        shard = sorted(recorder.led_now("m0"))[0]
        assert get_json(f"{holder.url}/leader/{shard}")[0] == 200
        assert json.loads((holder.state_dir / shard).read_text())["lease"] == shard
        listed = json.loads((holder.state_dir / "shards").read_text())
        assert {s["shard"] for s in listed["shards"]} <= recorder.led_now("m0") | {shard}

        joined = time.time()
        third = member(tmp_path, "m2").start()
        try:
            third.wait_http()
            recorder.add("m2", third.url)
            wait_until(lambda: recorder.settled(["m0", "m1", "m2"], SHARDS), timeout=20)
            assert sorted(recorder.counts().values()) == [4, 4, 4]
            # Each shard the assignment moves moves once, straight to its new member;
            # no other shard moves.
            assert moves(recorder.spans, joined) == changes(["m0", "m1"], ["m0", "m1", "m2"])
            # lease-sidecar status lists the whole assignment, as the members hold it.
            listed = status(tmp_path)
            assert listed["members"] == ["m0", "m1", "m2"]
            assert len(listed["assignment"]) == SHARDS
            assert all(row["holder"] == row["assigned_to"] and row["fencing_token"]
                       for row in listed["assignment"])

            left = time.time()
            procs[0].signal(signal.SIGTERM)
            assert procs[0].proc is not None and procs[0].proc.wait(15) == 0
            recorder.remove("m0")
            wait_until(lambda: recorder.settled(["m1", "m2"], SHARDS), timeout=20)
            moved = moves(recorder.spans, left)
            assert moved == changes(["m0", "m1", "m2"], ["m1", "m2"])
            assert all(frm == "m0" for steps in moved.values() for frm, _ in steps)
        finally:
            third.stop()
    assert overlaps(recorder.spans) == {}
    assert token_problems(recorder.spans) == []
    assert recorder.polls > 100 and len(recorder.spans) == SHARDS


def file_change_counter(path: Path) -> int:
    """The SQLite header's file change counter: one more for every transaction that
    wrote the file (rollback-journal mode), whoever ran it."""
    return struct.unpack(">I", path.read_bytes()[24:28])[0]


def test_one_transaction_a_renew_interval_renews_every_shard(tmp_path: Path) -> None:
    """One member holding 64 shards writes the file about twice per renew interval: its
    group's round trip (all 64 shards and its member record) and the renew of the lease
    ``work`` itself, not once per shard; all 64 stay led throughout."""
    alone = member(tmp_path, "solo", shards="64")
    with serving([alone]) as (proc,), ShardRecorder({"solo": proc.url}, HORIZON) as recorder:
        wait_until(lambda: recorder.settled(["solo"], 64), timeout=30)
        db = tmp_path / "leases.db"
        before, started = file_change_counter(db), time.monotonic()
        time.sleep(6.0)
        writes = file_change_counter(db) - before
        intervals = (time.monotonic() - started) / 0.3
        assert recorder.settled(["solo"], 64)
        metrics = get_json(proc.url + "/metrics")[1]
    # 20 renew intervals: about 20 round trips (±5 % period) and 20 renews of ``work``
    # (±10 %), where 64 shards renewed one by one would write 65 times a renew interval.
    assert intervals * 1.6 <= writes <= intervals * 2.5, (writes, intervals)
    assert "lease_sidecar_shards_led 64.0" in metrics
    assert overlaps(recorder.spans) == {}
