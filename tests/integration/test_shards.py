"""A shard set (``LEASE_SHARDS``) on real ``lease-sidecar`` processes, on each backend that
holds shards (a real SQLite file, the real PostgreSQL test bed): spread evenly, moved on
joins and leaves without two claimants of any shard, each shard moved once straight to
the member the assignment names, and renewed with one round trip per member per renew
interval whatever the number of shards."""

from __future__ import annotations

import contextlib
import json
import signal
import struct
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncpg
import pytest

from sidecar.shards.assign import assign
from testkit.pgcount import CountingProxy
from testkit.shards import ShardRecorder, moves, overlaps, token_problems
from testkit.support import REPO, SidecarProcess, get_json, serving, wait_until

FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]
HORIZON = 0.1
INTERVAL = 0.3
SHARDS = 12
BACKENDS = [pytest.param("sqlite", id="sqlite"),
            pytest.param("postgres-row", id="postgres-row", marks=pytest.mark.postgres),
            pytest.param("postgres", id="postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> list[str]:
    """The flags that point a sidecar (and ``status``) at this test's store."""
    backend = request.param
    if backend == "sqlite":
        return ["--dsn", str(tmp_path / "leases.db")]
    dsn = request.getfixturevalue("pg_dsn")
    if backend == "postgres-row":
        asyncpg_run(dsn, "select 1")  # the database is there
        subprocess.run([sys.executable, "-m", "sidecar", "schema", "--apply", "--backend",
                        backend, "--dsn", dsn], check=True, cwd=REPO, capture_output=True,
                       timeout=60)
    return ["--backend", backend, "--dsn", dsn]


def asyncpg_run(dsn: str, query: str) -> list[asyncpg.Record]:
    import asyncio

    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn)
        try:
            return list(await conn.fetch(query))
        finally:
            await conn.close()

    return asyncio.run(run())


def member(tmp_path: Path, store: list[str], name: str,
           shards: int = SHARDS) -> SidecarProcess:
    return SidecarProcess(tmp_path, name, args=[*store, "--name", "work", "--shards",
                                                 str(shards), *FAST])


def status(store: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "sidecar", "status", "--json", *store,
                           "--name", "work", "--shards", str(SHARDS)], capture_output=True,
                          text=True, timeout=30, cwd=REPO, check=True)
    return json.loads(done.stdout)["shards"]


def changes(before: list[str], after: list[str]) -> dict[str, list[tuple[str, str]]]:
    """What the assignment moves when the members change from ``before`` to ``after``."""
    shards = [f"work-{i}" for i in range(SHARDS)]
    old, new = assign(shards, before), assign(shards, after)
    return {s: [(old[s], new[s])] for s in shards if old[s] != new[s]}


def test_members_share_the_shards_and_move_them_without_two_claimants(
        tmp_path: Path, store: list[str]) -> None:
    first = [member(tmp_path, store, f"m{i}") for i in range(2)]
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
        third = member(tmp_path, store, "m2").start()
        try:
            third.wait_http()
            recorder.add("m2", third.url)
            wait_until(lambda: recorder.settled(["m0", "m1", "m2"], SHARDS), timeout=20)
            assert sorted(recorder.counts().values()) == [4, 4, 4]
            # Each shard the assignment moves moves once, straight to its new member;
            # no other shard moves.
            assert moves(recorder.spans, joined) == changes(["m0", "m1"], ["m0", "m1", "m2"])
            # lease-sidecar status lists the whole assignment, as the members hold it.
            listed = status(store)
            assert listed["members"] == ["m0", "m1", "m2"]
            assert len(listed["assignment"]) == SHARDS
            assert all(row["holder"] == row["assigned_to"] for row in listed["assignment"])

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


@contextlib.contextmanager
def counted(store: list[str]) -> Iterator[tuple[list[str], Callable[[], int]]]:
    """The store's flags and a count of its round trips: for SQLite the transactions that
    wrote the file, for PostgreSQL the client's round trips through a counting proxy."""
    if "--backend" not in store:
        db = Path(store[store.index("--dsn") + 1])
        yield store, lambda: file_change_counter(db)
        return
    dsn = store[store.index("--dsn") + 1]
    parts = urllib.parse.urlsplit(dsn)
    with CountingProxy((parts.hostname or "127.0.0.1", parts.port or 5432)) as proxy:
        flags = list(store)
        flags[store.index("--dsn") + 1] = proxy.dsn(dsn)
        yield flags, lambda: proxy.round_trips


def test_one_round_trip_a_renew_interval_renews_every_shard(
        tmp_path: Path, store: list[str]) -> None:
    """One member holding 64 shards: about two round trips per renew interval reach the
    store — its group's (all 64 shards and its member record) and the renew of the lease
    ``work`` itself — not one per shard; all 64 stay led throughout."""
    with counted(store) as (flags, count), \
            serving([member(tmp_path, flags, "solo", shards=64)]) as (proc,), \
            ShardRecorder({"solo": proc.url}, HORIZON) as recorder:
        wait_until(lambda: recorder.settled(["solo"], 64), timeout=30)
        time.sleep(2 * INTERVAL)  # the first claims' acquires are behind us
        before, started = count(), time.monotonic()
        time.sleep(6.0)
        seen = count() - before
        intervals = (time.monotonic() - started) / INTERVAL
        assert recorder.settled(["solo"], 64)
        metrics = get_json(proc.url + "/metrics")[1]
    # 20 renew intervals: about 20 round trips (±5 % period) and 20 renews of ``work``
    # (±10 %), where 64 shards renewed one by one would take 65 a renew interval.
    assert intervals * 1.7 <= seen <= intervals * 2.3, (seen, intervals)
    assert "lease_sidecar_shards_led 64.0" in metrics
    assert overlaps(recorder.spans) == {}


def test_a_killed_members_shards_are_taken_within_the_takeover_bound(
        tmp_path: Path, store: list[str]) -> None:
    """SIGKILL: no hand-over, no goodbye. Its record runs out with its shards' leases (TTL
    backends: one lease duration after its last round trip) or goes with its session at
    once (postgres); the next members then campaign at their next round trip."""
    with serving([member(tmp_path, store, f"k{i}") for i in range(2)]) as procs, \
            ShardRecorder({p.identity: p.url for p in procs}, HORIZON) as recorder:
        wait_until(lambda: recorder.settled(["k0", "k1"], SHARDS), timeout=20)
        killed = time.time()
        procs[0].signal(signal.SIGKILL)
        recorder.remove("k0")
        wait_until(lambda: recorder.settled(["k1"], SHARDS), timeout=20)
        taken = time.time() - killed
    ttl = 0.0 if "postgres" in store else 2.0  # the lease duration of FAST
    # The record's expiry (TTL backends), a round trip to see it, one to campaign in, the
    # new term's first claim (one horizon), and slack for a loaded machine.
    assert taken <= ttl + 2 * INTERVAL * 1.05 + HORIZON + 1.5, taken
    assert overlaps(recorder.spans) == {}
    assert token_problems(recorder.spans) == []
