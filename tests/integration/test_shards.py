"""A shard set (``LEASE_SHARDS``) on real ``lease-sidecar`` processes, on each backend that
holds shards (a real SQLite file, the real PostgreSQL test bed): spread evenly, moved on
joins and leaves without two claimants of any shard, each shard moved once straight to
the member the assignment names, and renewed with one round trip per member per renew
interval whatever the number of shards."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sidecar.shards.assign import assign
from testkit.kube_support import SERVICE_ACCOUNT, create_pods
from testkit.pgcount import CountingProxy
from testkit.shards import ShardRecorder, moves, overlaps, token_problems, unowned
from testkit.support import REPO, SidecarProcess, get_json, serving, wait_until
from testkit.testbed.kube import ControlPlane

FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]
# The kubernetes backend's least safety margin is 1 s, and its Leases count whole seconds.
KUBE_FAST = ["--lease-duration", "3s", "--renew-interval", "500ms", "--safety-margin", "1s",
             "--claim-horizon", "100ms"]
HORIZON = 0.1
SHARDS = 12
DATABASES = [pytest.param("sqlite", id="sqlite"),
             pytest.param("postgres-row", id="postgres-row", marks=pytest.mark.postgres),
             pytest.param("postgres", id="postgres", marks=pytest.mark.postgres)]
BACKENDS = [*DATABASES, pytest.param("kubernetes", id="kubernetes", marks=pytest.mark.kube)]


@dataclass
class Store:
    """Where this test's shards live: flags and environment for a sidecar and for
    ``status``, the timing the sidecars run with."""

    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)
    timing: list[str] = field(default_factory=lambda: FAST)
    lease_duration: float = 2.0
    renew_interval: float = 0.3

    @property
    def ttl(self) -> float:
        """How long a dead member's shards stay taken: 0 where they go with its session;
        on kubernetes its record's lease duration, then the shard's own Lease judged on
        the new member's clock from when it first reads it (client-go's rule), another."""
        if self.flags[:2] == ["--backend", "postgres"]:
            return 0.0
        if self.flags[:2] == ["--backend", "kubernetes"]:
            return 2 * self.lease_duration
        return self.lease_duration


def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    backend = request.param
    if backend == "sqlite":
        return Store(["--dsn", str(tmp_path / "leases.db")])
    if backend == "kubernetes":
        cp = request.getfixturevalue("control_plane")
        namespace = request.getfixturevalue("kube_namespace")
        return Store(["--backend", "kubernetes", "--pod-label", "off"],
                     {"KUBECONFIG": str(cp.kubeconfig), "POD_NAMESPACE": namespace},
                     KUBE_FAST, lease_duration=3.0, renew_interval=0.5)
    dsn = request.getfixturevalue("pg_dsn")
    if backend == "postgres-row":
        subprocess.run([sys.executable, "-m", "sidecar", "schema", "--apply", "--backend",
                        backend, "--dsn", dsn], check=True, cwd=REPO, capture_output=True,
                       timeout=60)
    return Store(["--backend", backend, "--dsn", dsn])


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store(request, tmp_path)


@pytest.fixture(params=DATABASES)
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store(request, tmp_path)


def member(tmp_path: Path, store: Store, name: str, shards: int = SHARDS) -> SidecarProcess:
    return SidecarProcess(tmp_path, name, args=[*store.flags, "--name", "work", "--shards",
                                                 str(shards), *store.timing], env=store.env)


def status(store: Store) -> dict:
    flags = [f for f in store.flags if f not in ("--pod-label", "off")]
    done = subprocess.run([sys.executable, "-m", "sidecar", "status", "--json", *flags,
                           "--name", "work", "--shards", str(SHARDS)], capture_output=True,
                          text=True, timeout=30, cwd=REPO, check=True,
                          env={**os.environ, **store.env})
    return json.loads(done.stdout)["shards"]


def changes(before: list[str], after: list[str]) -> dict[str, list[tuple[str, str]]]:
    """What the assignment moves when the members change from ``before`` to ``after``."""
    shards = [f"work-{i}" for i in range(SHARDS)]
    old, new = assign(shards, before), assign(shards, after)
    return {s: [(old[s], new[s])] for s in shards if old[s] != new[s]}


def test_members_share_the_shards_and_move_them_without_two_claimants(
        tmp_path: Path, store: Store) -> None:
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
def counted(store: Store) -> Iterator[tuple[Store, Callable[[], int]]]:
    """The store and a count of its round trips: for SQLite the transactions that wrote
    the file, for PostgreSQL the client's round trips through a counting proxy."""
    flags = store.flags
    if "--backend" not in flags:
        db = Path(flags[flags.index("--dsn") + 1])
        yield store, lambda: file_change_counter(db)
        return
    dsn = flags[flags.index("--dsn") + 1]
    parts = urllib.parse.urlsplit(dsn)
    with CountingProxy((parts.hostname or "127.0.0.1", parts.port or 5432)) as proxy:
        proxied = list(flags)
        proxied[flags.index("--dsn") + 1] = proxy.dsn(dsn)
        yield Store(proxied), lambda: proxy.round_trips


def test_one_round_trip_a_renew_interval_renews_every_shard(
        tmp_path: Path, database: Store) -> None:
    """One member holding 64 shards: about two round trips per renew interval reach the
    store — its group's (all 64 shards and its member record) and the renew of the lease
    ``work`` itself — not one per shard; all 64 stay led throughout."""
    with counted(database) as (store, count), \
            serving([member(tmp_path, store, "solo", shards=64)]) as (proc,), \
            ShardRecorder({"solo": proc.url}, HORIZON) as recorder:
        wait_until(lambda: recorder.settled(["solo"], 64), timeout=30)
        time.sleep(2 * store.renew_interval)  # the first claims' acquires are behind us
        first_tokens = recorder.tokens("solo")
        before, started = count(), time.monotonic()
        time.sleep(6.0)
        seen = count() - before
        intervals = (time.monotonic() - started) / store.renew_interval
        # Led throughout: every shard still in the term it had (a shard that lost its
        # lease would lead again only under a new token). Judged on the tokens, not on
        # one instant's claims: with a 100 ms claim horizon, one late poll of the
        # recorder on a loaded machine shows the claims as run out.
        wait_until(lambda: recorder.settled(["solo"], 64), timeout=5)
        assert recorder.tokens("solo") == first_tokens
        metrics = get_json(proc.url + "/metrics")[1]
    # 20 renew intervals: about 20 round trips (±5 % period) and 20 renews of ``work``
    # (±10 %), where 64 shards renewed one by one would take 65 a renew interval.
    assert intervals * 1.7 <= seen <= intervals * 2.3, (seen, intervals)
    assert "lease_sidecar_shards_led 64.0" in metrics
    assert overlaps(recorder.spans) == {}


def test_a_killed_members_shards_are_taken_within_the_takeover_bound(
        tmp_path: Path, store: Store) -> None:
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
    # The record's expiry (TTL backends), a round trip to see it, one to campaign in, the
    # new term's first claim (one horizon), and slack for a loaded machine.
    assert taken <= store.ttl + 2 * store.renew_interval * 1.05 + HORIZON + 1.5, taken
    assert overlaps(recorder.spans) == {}
    assert token_problems(recorder.spans) == []


@pytest.mark.kube
def test_each_pod_shows_how_many_shards_it_holds(
        tmp_path: Path, control_plane: ControlPlane, kube_namespace: str) -> None:
    """The annotation lease-sidecar/shards, read with the command docs/sharding.md gives
    (kubectl's custom columns), follows the spread as pods come and go."""
    control_plane.kubectl("-n", kube_namespace, "create", "serviceaccount", SERVICE_ACCOUNT)
    create_pods(control_plane, kube_namespace, "pod-0", "pod-1")
    env = {"KUBECONFIG": str(control_plane.kubeconfig), "POD_NAMESPACE": kube_namespace}
    procs = [SidecarProcess(tmp_path, pod, env={**env, "POD_NAME": pod}, args=[
        "--backend", "kubernetes", "--name", "work", "--shards", str(SHARDS), *KUBE_FAST])
        for pod in ("pod-0", "pod-1")]

    def shown() -> dict[str, str]:
        out = control_plane.kubectl(
            "-n", kube_namespace, "get", "pods", "--no-headers", "-o",
            "custom-columns=POD:.metadata.name,SHARDS:.metadata.annotations.lease-sidecar/shards"
        ).stdout
        return dict(line.split() for line in out.strip().splitlines())

    with serving(procs), ShardRecorder({p.identity: p.url for p in procs}, HORIZON) as rec:
        wait_until(lambda: rec.settled(["pod-0", "pod-1"], SHARDS), timeout=30)
        wait_until(lambda: shown() == {"pod-0": "6", "pod-1": "6"}, timeout=10)
        procs[0].signal(signal.SIGTERM)
        assert procs[0].proc is not None and procs[0].proc.wait(15) == 0
        rec.remove("pod-0")
        wait_until(lambda: rec.settled(["pod-1"], SHARDS), timeout=30)
        wait_until(lambda: shown() == {"pod-0": "0", "pod-1": "12"}, timeout=10)
    assert overlaps(rec.spans) == {}


def test_members_leaving_together_hand_their_shards_to_the_ones_that_stay(
        tmp_path: Path, store: Store) -> None:
    """Two of four members get SIGTERM at once: each drops its record, waits until its
    view holds still (the other leaver gone too), then hands every shard straight to its
    member among the two that stay: each shard moves once, with no unowned time beyond a
    hand-over's (a claim horizon and a few round trips)."""
    names = ["a", "b", "c", "d"]
    # A renew interval long against the claim horizon: a shard released before its next
    # member campaigns would wait for that member's next round trip, a second.
    store.timing = ["--lease-duration", "5s", "--renew-interval", "1s", "--renew-deadline",
                    "4s", "--safety-margin", "1s", "--claim-horizon", "100ms"]
    with serving([member(tmp_path, store, n) for n in names]) as procs, \
            ShardRecorder({p.identity: p.url for p in procs}, HORIZON) as recorder:
        wait_until(lambda: recorder.settled(names, SHARDS), timeout=30)
        left = time.time()
        for proc in procs[2:]:
            proc.signal(signal.SIGTERM)
        for proc in procs[2:]:
            assert proc.proc is not None and proc.proc.wait(30) == 0
            recorder.remove(proc.identity)
        wait_until(lambda: recorder.settled(names[:2], SHARDS), timeout=30)
        time.sleep(0.5)
        moved = moves(recorder.spans, left)
        gaps = unowned(recorder.spans, left)
    assert moved == changes(names, names[:2])
    assert max(gaps) <= 3 * HORIZON + 0.3, sorted(gaps)
    assert overlaps(recorder.spans) == {}
