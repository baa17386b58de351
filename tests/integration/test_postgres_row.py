"""``postgres-row`` against the real PostgreSQL test bed (primary and streaming standby)."""

from __future__ import annotations

import asyncio
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest

from sidecar.base.clock import SystemClock
from sidecar.base.errors import BackendError, NotFound
from sidecar.config import load
from sidecar.lease import postgres_row
from sidecar.lease.rowlease import RowLease
from sidecar.lease.sql.asyncpg_driver import AsyncpgDriver
from sidecar.lease.sql.dialect import PostgresDialect
from sidecar.lease.sql.store import SqlRowStore
from testkit.support import SidecarProcess, free_port, wait_until
from tests.integration.row_contract import LONG, RowStoreContract, fresh, store_factory

pytestmark = pytest.mark.postgres


@pytest.fixture
async def make_store(pg_dsn: str):
    async with store_factory(lambda replica, dsn: SqlRowStore(
            PostgresDialect(), AsyncpgDriver(dsn or pg_dsn, timeout=5.0),
            replica=replica)) as make:
        yield make


class TestAsyncpgContract(RowStoreContract):
    """The shared row-lease contract over asyncpg."""


def settings_for(dsn: str, identity: str = "a", **extra: str):
    return load({"backend": "postgres-row", "dsn": dsn, "identity": identity, **extra}, env={})


# The statements' token-era parameters when no era table is read: the era is the timeline.
NO_ERA = {"era_tl": -1, "era_base": 0, "era_start": 0}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True,
                          text=True, timeout=60)


async def takeover_in_open_transaction(pg_dsn: str, name: str) -> tuple:
    """Rival ``b`` takes ``name`` over inside a transaction left open (the row stays locked)."""
    text, names = PostgresDialect().acquire.numeric()
    params = {"name": name, "owner": "b", "duration": LONG, **NO_ERA}
    conn = await asyncpg.connect(pg_dsn)
    transaction = conn.transaction()
    await transaction.start()
    rows = await conn.fetch(text, *(params[n] for n in names))
    assert rows[0][0] == "b" and rows[0]["won"]
    return conn, transaction


@pytest.mark.parametrize("raw", [True, False], ids=["statement", "store"])
async def test_a_takeover_committed_during_our_acquire_is_never_read_as_ours(
        pg_dsn: str, make_store, raw: bool) -> None:
    """Our acquire takes its snapshot, waits on the rival's row lock, then loses; the
    fallback read still sees the snapshot (our own expired row). Found by the stress
    test. Only ``won`` decides, and the fallback read skips expired rows, so that stale
    row is neither taken for ours nor for a second live holder with our identity."""
    store = make_store()
    name = fresh()
    await store.acquire(name, "a", 0.3)
    await asyncio.sleep(0.6)
    conn, transaction = await takeover_in_open_transaction(pg_dsn, name)
    try:
        params = {"name": name, "owner": "a", "duration": LONG, **NO_ERA}
        pending = asyncio.ensure_future(
            store.driver.fetch(store.dialect.acquire, params) if raw
            else store.acquire(name, "a", LONG))
        await asyncio.sleep(0.5)
        assert not pending.done()  # blocked on b's row lock, snapshot taken
        await transaction.commit()
        result = await asyncio.wait_for(pending, 5.0)
    finally:
        await conn.close()
    if raw:
        # The hazard itself was a read row naming us (expired, from the snapshot).
        assert [(r[0], r[-1]) for r in result if r[0] == "a"] == []
    else:
        assert result is None or (result.owner == "b" and not result.won)
    assert (await store.read(name)).owner == "b"


async def test_the_sweep_neither_waits_nor_holds_a_row_while_we_wait(
        pg_dsn: str, make_store) -> None:
    """Contenders of two names that swept each other's expired rows and then waited on
    their own row deadlocked (the stress test, under load). The sweep now runs only after
    our upsert has settled, and skips rows other transactions hold."""
    store = make_store()
    ours, expired, held_expired = fresh(), fresh(), fresh()
    conn, transaction = await takeover_in_open_transaction(pg_dsn, ours)
    await store.acquire(expired, "gone", 0.3)  # after b's sweep, which would take it
    await asyncio.sleep(0.6)
    probe = await asyncpg.connect(pg_dsn)
    try:
        pending = asyncio.ensure_future(store.acquire(ours, "a", LONG))
        await asyncio.sleep(0.5)
        assert not pending.done()  # waits on b's row lock ...
        async with probe.transaction():  # ... holding no other row meanwhile
            locked = await probe.fetch(
                'SELECT lease_name FROM "lease"."leases" WHERE lease_name = $1 '
                "FOR UPDATE NOWAIT", expired)
            assert [r[0] for r in locked] == [expired]
        await transaction.commit()
        lost = await asyncio.wait_for(pending, 5.0)
        assert lost is None or not lost.won

        await store.acquire(held_expired, "gone", 0.3)
        await asyncio.sleep(0.6)

        async with probe.transaction():  # someone else holds an expired row: skipped
            await probe.execute('SELECT 1 FROM "lease"."leases" WHERE lease_name = $1 '
                                "FOR UPDATE", held_expired)
            won = await asyncio.wait_for(store.acquire(fresh(), "a", LONG), 5.0)
            assert won is not None and won.won
        replica_view = make_store(replica=True)
        assert await replica_view.read(expired) is None  # swept by the first acquire
        assert (await replica_view.read(held_expired)).owner == "gone"  # skipped, still there
    finally:
        await probe.close()
        await conn.close()


# -- schema -------------------------------------------------------------------------------
async def test_schema_cli_applies_idempotently_and_prints_ddl(pg, pg_dsn: str) -> None:
    for _ in range(2):
        result = cli("schema", "--backend", "postgres-row", "--dsn", pg_dsn, "--apply")
        assert result.returncode == 0, result.stderr
        assert pg.password not in result.stdout + result.stderr
    conn = await asyncpg.connect(pg_dsn)
    try:
        columns = dict(await conn.fetch(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = 'lease' AND table_name = 'leases'"))
        indexes = await conn.fetchval(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'lease' AND tablename = 'leases'")
        sequence = await conn.fetchval("SELECT to_regclass('lease.leases_version_seq')")
    finally:
        await conn.close()
    assert columns == {
        "lease_name": "character varying", "owner_instance_id": "character varying",
        "acquired_at": "timestamp with time zone", "renewed_at": "timestamp with time zone",
        "expires_at": "timestamp with time zone", "metadata": "character varying",
        "version": "bigint"}
    assert indexes == 2 and sequence is not None  # primary key + expiry index

    printed = cli("schema", "--backend", "postgres-row", "--dsn", pg_dsn, "--print")
    assert printed.returncode == 0
    assert printed.stdout.strip() == PostgresDialect().schema_script()
    assert "CREATE TABLE IF NOT EXISTS" in printed.stdout


async def test_concurrent_schema_apply_does_not_race(pg_dsn: str) -> None:
    settings = settings_for(pg_dsn, schema="racy", table="t")
    await asyncio.gather(*(postgres_row.ENTRY.apply_schema(settings) for _ in range(4)))


def test_bad_table_name_is_a_setting_error() -> None:
    result = cli("schema", "--backend", "postgres-row", "--dsn", "postgresql://x@127.0.0.1/x",
                 "--table", "leases; drop table x", "--print")
    assert result.returncode == 2 and "LEASE_TABLE / --table" in result.stderr


async def test_custom_schema_and_table_through_the_backend(pg_dsn: str) -> None:
    settings = settings_for(pg_dsn, schema="ops", table="job_leases")
    await postgres_row.ENTRY.apply_schema(settings)
    backend = postgres_row.ENTRY.create(settings, SystemClock())
    try:
        grant = await backend.lease("jobs").try_acquire()
        assert grant.held
        holders = await postgres_row.ENTRY.list_leases(settings, None)
        assert holders[0].lease == "jobs" and holders[0].holder == "a"
    finally:
        await backend.close()
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("SELECT owner_instance_id FROM ops.job_leases") == "a"
    finally:
        await conn.close()


# -- errors -------------------------------------------------------------------------------
async def test_errors_are_one_clear_line_without_the_password(pg, pg_dsn: str) -> None:
    missing = SqlRowStore(PostgresDialect("nowhere"), AsyncpgDriver(pg_dsn, timeout=5.0))
    wrong_pw = SqlRowStore(PostgresDialect(), AsyncpgDriver(
        pg_dsn.replace(pg.password, "not-the-password"), timeout=5.0))
    closed = SqlRowStore(PostgresDialect(), AsyncpgDriver(
        f"postgresql://lease:{pg.password}@127.0.0.1:{free_port()}/x", timeout=5.0))
    cases = [(missing, "schema --apply"), (wrong_pw, "login failed"),
             (closed, "network unreachable")]
    for store, expected in cases:
        with pytest.raises(BackendError) as caught:
            await store.acquire(fresh(), "a", LONG)
        # Only the missing table is "not found" (status exits 3, not 1).
        assert isinstance(caught.value, NotFound) == (store is missing)
        message = str(caught.value)
        assert expected in message and "\n" not in message
        assert pg.password not in message and "not-the-password" not in message
        await store.close()


# -- wake-ups -----------------------------------------------------------------------------
async def until_listening(store: SqlRowStore) -> None:
    """The LISTEN connection is set up in the background by the first waits."""
    for _ in range(200):
        await store.wait_for_release(0.05)
        if store.driver.is_listening(store.dialect.channel):
            return
    raise AssertionError("LISTEN never came up")


async def test_release_and_sweep_wake_a_listening_standby(make_store) -> None:
    holder, standby = make_store(), make_store()
    name = fresh()
    held = await holder.acquire(name, "a", LONG)
    await standby.acquire(name, "b", LONG)
    await until_listening(standby)

    waiting = asyncio.ensure_future(standby.wait_for_release(30.0))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await holder.release(name, "a", held.version)
    await asyncio.wait_for(waiting, 5.0)  # woken by NOTIFY, not by its 30 s timeout

    # An expired row swept by someone's acquire also wakes standbys.
    abandoned = fresh()
    await holder.acquire(abandoned, "crashed", 0.3)
    await asyncio.sleep(0.6)
    await standby.acquire(fresh(), "b", LONG)
    waiting = asyncio.ensure_future(standby.wait_for_release(30.0))
    await asyncio.sleep(0.1)
    await holder.acquire(fresh(), "a", LONG)  # sweeps `abandoned`, notifies
    await asyncio.wait_for(waiting, 5.0)


async def test_a_standby_of_one_name_sleeps_through_another_names_release(make_store) -> None:
    """A shard group's member waits for hundreds of names on one channel: a release wakes
    the standby of its own name only (each woken standby sends an acquire, and the one
    that could win queued behind the rest)."""
    holder, standby = make_store(), make_store()
    mine, other = fresh(), fresh()
    held_mine = await holder.acquire(mine, "a", LONG)
    held_other = await holder.acquire(other, "a", LONG)
    await standby.acquire(mine, "b", LONG)
    await until_listening(standby)

    waiting = asyncio.ensure_future(standby.wait_for_release(30.0, mine))
    await holder.release(other, "a", held_other.version)
    await asyncio.sleep(0.5)
    assert not waiting.done()  # another name's NOTIFY came and went
    await holder.release(mine, "a", held_mine.version)
    await asyncio.wait_for(waiting, 5.0)


async def test_a_notify_between_acquire_and_wait_is_not_lost(make_store) -> None:
    holder, standby = make_store(), make_store()
    name = fresh()
    held = await holder.acquire(name, "a", LONG)
    await until_listening(standby)
    await standby.acquire(name, "b", LONG)
    await holder.release(name, "a", held.version)
    await asyncio.sleep(0.2)  # the NOTIFY arrives before the standby starts waiting
    await asyncio.wait_for(standby.wait_for_release(30.0), 5.0)


@pytest.mark.parametrize("edit", [
    "DELETE FROM lease.leases WHERE lease_name = $1",
    "UPDATE lease.leases SET expires_at = now() WHERE lease_name = $1",
    # A record that does not name the row's own version (written by hand) is none.
    "UPDATE lease.leases SET expires_at = now(), metadata = 'released:' || (version - 1) "
    "WHERE lease_name = $1",
])
async def test_a_lease_ended_by_hand_carries_no_release_record(
        make_store, pg_dsn: str, edit: str) -> None:
    """Deleted or expired by hand (after an earlier recorded release, whose record
    the term in between replaced): the next holder must wait one claim horizon."""
    store = make_store()
    name = fresh()
    first = await store.acquire(name, "a", LONG)
    await store.release(name, "a", first.version, record=True)
    second = await store.acquire(name, "b", LONG)
    assert second.won and second.previous_claims_ended
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(edit, name)
    finally:
        await conn.close()
    third = await store.acquire(name, "c", LONG)
    assert third.won and third.owner == "c" and not third.previous_claims_ended


async def test_the_listener_reconnects_quietly(pg, pg_dsn: str, make_store) -> None:
    holder, standby = make_store(), make_store()
    name = fresh()
    await until_listening(standby)
    database = pg_dsn.rsplit("/", 1)[1]
    killed = pg.psql("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                     f"WHERE datname = '{database}' AND query LIKE 'LISTEN%'")
    assert killed == "1"
    await asyncio.sleep(0.3)
    assert not standby.driver.is_listening(standby.dialect.channel)
    await until_listening(standby)  # reconnects quietly
    held = await holder.acquire(name, "a", LONG)
    await standby.acquire(name, "b", LONG)
    waiting = asyncio.ensure_future(standby.wait_for_release(30.0))
    await asyncio.sleep(0.2)
    await holder.release(name, "a", held.version)
    await asyncio.wait_for(waiting, 5.0)


# -- replica confirmation -------------------------------------------------------------------
async def test_replica_confirmation_against_a_real_standby(
        pg_standby, pg_dsn: str, pg_standby_dsn: str) -> None:
    settings = settings_for(pg_dsn, replica_dsn=pg_standby_dsn, replica_timeout="1s")
    await postgres_row.ENTRY.apply_schema(settings)
    pg_standby.wait_replayed()
    backend = postgres_row.ENTRY.create(settings, SystemClock())
    lease = backend.lease("replicated")
    primary = SqlRowStore(PostgresDialect(), AsyncpgDriver(pg_dsn, timeout=5.0))
    row_name = settings.store.key("replicated")
    try:
        pg_standby.pause_replay()
        try:
            started = time.monotonic()
            grant = await lease.try_acquire()
            assert not grant.held and "replica" in grant.reason
            assert time.monotonic() - started >= 1.0  # it waited the whole timeout
            assert await primary.read(row_name) is None  # and gave the row back
        finally:
            pg_standby.resume_replay()
        grant = await lease.try_acquire()
        assert grant.held and grant.fencing_token is not None
        assert (await primary.read(row_name)).owner == "a"
    finally:
        await backend.close()
        await primary.close()


# -- processes ----------------------------------------------------------------------------
def run_args(dsn: str, name: str) -> list[str]:
    return ["--backend", "postgres-row", "--dsn", dsn, "--name", name,
            "--lease-duration", "4s", "--renew-interval", "0.5s", "--renew-deadline", "2s"]


async def test_three_processes_one_leader_and_sigterm_hands_over(
        pg, pg_dsn: str, tmp_path: Path) -> None:
    assert cli("schema", "--backend", "postgres-row", "--dsn", pg_dsn,
               "--apply").returncode == 0
    procs = [SidecarProcess(tmp_path, f"p{i}", run_args(pg_dsn, "proc")).start()
             for i in range(3)]
    try:
        for proc in procs:
            proc.wait_http()

        def leaders() -> list[SidecarProcess]:
            return [p for p in procs if p.proc.poll() is None and p.leader() == 200]

        leader = wait_until(lambda: leaders(), timeout=10)[0]
        time.sleep(1.0)  # let standbys settle into their retry loop
        assert leaders() == [leader]

        leader.signal(signal.SIGTERM)
        sent = time.monotonic()
        successor = wait_until(lambda: [p for p in leaders() if p is not leader], timeout=5)
        took = time.monotonic() - sent
        assert took <= 1.0, f"handover took {took:.2f}s"
        assert len(successor) == 1
        assert leader.proc.wait(10) == 0
        for proc in procs:
            assert pg.password not in proc.logs()
    finally:
        for proc in procs:
            proc.stop()


# -- stress -------------------------------------------------------------------------------
@dataclass
class Recorder:
    """Claim intervals per lease name, on this process's one monotonic clock.

    A term's claim starts when the grant *arrives* (no one can act on it earlier) and ends
    at the earliest of: last grant's send time + valid_for, or the moment the contender
    stopped claiming before it released (the elector's unpublish-then-release order).
    """

    terms: dict[str, list[tuple[float, float, str]]] = field(
        default_factory=lambda: defaultdict(list))

    def record(self, name: str, start: float, end: float, owner: str) -> None:
        if end > start:
            self.terms[name].append((start, end, owner))

    def overlaps(self) -> list[tuple]:
        found = []
        for name, terms in self.terms.items():
            terms.sort()
            for i, (start, end, owner) in enumerate(terms):
                for other_start, other_end, other in terms[i + 1:]:
                    if other_start >= end:
                        break
                    if other != owner:
                        found.append((name, (start, end, owner), (other_start, other_end, other)))
        return found


async def contend(lease: RowLease, owner: str, name: str, recorder: Recorder,
                  stop_at: float) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(f"{owner}/{name}")
    term_start: float | None = None
    claim_end = 0.0
    while loop.time() < stop_at:
        if term_start is None:
            sent = loop.time()
            grant = await lease.try_acquire()
            if grant.held:
                term_start, claim_end = loop.time(), sent + grant.valid_for
            else:
                await lease.wait_for_change(rng.uniform(0.05, 0.3))
            continue
        await asyncio.sleep(rng.uniform(0.05, 0.25))
        action = rng.random()
        if action < 0.8:
            sent = loop.time()
            grant = await lease.try_renew()
            if grant.held:
                claim_end = sent + grant.valid_for
            else:  # lost: the claims already made stay valid until they run out
                recorder.record(name, term_start, claim_end, owner)
                term_start = None
        elif action < 0.9:  # step down: stop claiming, then release
            recorder.record(name, term_start, min(claim_end, loop.time()), owner)
            term_start = None
            await lease.release()
        else:  # crash: walk away without releasing; the row expires on the server
            recorder.record(name, term_start, claim_end, owner)
            term_start = None
            # The same identity comes back only after its old claims ran out: a
            # re-entrant acquire followed by a release would otherwise end them early.
            # (The elector caps a claim at one claim horizon; a restart takes longer.)
            await asyncio.sleep(max(0.0, claim_end - loop.time()) + rng.uniform(0.05, 1.0))
    if term_start is not None:
        recorder.record(name, term_start, min(claim_end, loop.time()), owner)


@pytest.mark.slow
async def test_stress_no_two_holders_ever_overlap(pg_dsn: str) -> None:
    """20 contenders x 5 names for 60 s; a 1 s TTL makes expiry takeovers frequent."""
    settings = settings_for(pg_dsn)
    await postgres_row.ENTRY.apply_schema(settings)
    names = [fresh() for _ in range(5)]
    stores = [SqlRowStore(PostgresDialect(), AsyncpgDriver(pg_dsn, timeout=5.0, max_size=2))
              for _ in range(20)]
    recorder = Recorder()
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + 60.0
    try:
        tasks = [contend(RowLease(store, name, name, f"c{i}", duration=1.0, safety_margin=0.2),
                         f"c{i}", name, recorder, stop_at)
                 for i, store in enumerate(stores) for name in names]
        await asyncio.wait_for(asyncio.gather(*tasks), 120.0)
    finally:
        for store in stores:
            await store.close()
    terms = sum(len(t) for t in recorder.terms.values())
    owners = {owner for t in recorder.terms.values() for _, _, owner in t}
    assert recorder.overlaps() == []
    assert terms >= 100 and len(owners) >= 15, (terms, owners)  # real contention happened


def test_the_recorder_sees_an_overlap_when_there_is_one() -> None:
    recorder = Recorder()
    recorder.record("n", 0.0, 1.0, "a")
    recorder.record("n", 1.0, 2.0, "b")  # touching is fine
    recorder.record("n", 1.5, 2.5, "b")  # the same owner may overlap itself
    assert recorder.overlaps() == []
    recorder.record("n", 2.4, 3.0, "c")
    assert len(recorder.overlaps()) == 1
