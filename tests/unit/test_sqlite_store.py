"""The row-lease rules on a real SQLite file."""

import asyncio
import sqlite3
from collections.abc import AsyncIterator

import pytest

from sidecar.base.errors import BackendError
from sidecar.lease.rowlease import RowLease
from sidecar.lease.sqlite import schema_sql, sqlite_path
from sidecar.lease.sqlite.store import SqliteStore
from sidecar.settings import Settings


def lease(store: SqliteStore, owner: str, duration: float = 5.0) -> RowLease:
    return RowLease(store, name="job", key="p.job", owner=owner, duration=duration,
                    safety_margin=0.5)


@pytest.fixture
async def contenders(tmp_path) -> AsyncIterator[tuple[RowLease, RowLease]]:
    """Owners "a" and "b" of lease "job" (5 s), each through its own store on one
    database file, as two sidecar processes are; the stores are closed after."""
    path = str(tmp_path / "l.db")
    a_store, b_store = SqliteStore(path, "leases"), SqliteStore(path, "leases")
    try:
        yield lease(a_store, "a"), lease(b_store, "b")
    finally:
        await a_store.close()
        await b_store.close()


async def test_one_holder_reentrant_and_owner_filtered(contenders):
    a, b = contenders
    first = await a.try_acquire()
    assert first.held and first.valid_for == 4.5
    lost = await b.try_acquire()
    assert not lost.held and lost.holder == "a"
    again = await a.try_acquire()  # re-entrant: same term, same token
    assert again.held and again.fencing_token == first.fencing_token
    assert not (await b.try_renew()).held  # renew only touches one's own row
    await b.release()  # release only ends one's own row
    assert (await a.describe()).holder == "a"
    assert (await a.try_renew()).held
    await a.release()
    assert (await a.describe()).holder is None
    taken = await b.try_acquire()
    assert taken.held and taken.fencing_token > first.fencing_token


@pytest.mark.parametrize("edit", [
    None,
    "unrecorded",  # a release asked to write no record (a term ended before its claims)
    "DELETE FROM leases WHERE name = 'p.job'",
    "UPDATE leases SET expires_at = 0 WHERE name = 'p.job'",
    "UPDATE leases SET expires_at = 0, metadata = 'released:' || (version - 1) "
    "WHERE name = 'p.job'",
])
async def test_only_a_release_of_the_term_taken_over_is_reported(tmp_path, edit):
    """The release record lets the next holder skip its claim horizon
    (``previous_claims_ended``); a term ended by hand leaves none, even right after a
    recorded release of the term before."""
    path = str(tmp_path / "l.db")
    store = SqliteStore(path, "leases")
    try:
        a, b, c = lease(store, "a"), lease(store, "b"), lease(store, "c")
        assert not (await a.try_acquire()).previous_claims_ended
        await a.release(record=True)
        after = await b.try_acquire()
        assert after.held and after.previous_claims_ended
        if edit is None:
            await b.release(record=True)
        elif edit == "unrecorded":
            await b.release()
        else:
            with sqlite3.connect(path) as conn:
                conn.execute(edit)
        third = await c.try_acquire()
        assert third.held and third.previous_claims_ended == (edit is None)
    finally:
        await store.close()


async def test_another_names_acquire_leaves_a_release_record_in_place(tmp_path):
    """A shard group moves many leases at once: the acquire of one must not sweep the
    release record of another, or that one's next holder waits a claim horizon it
    need not (nearly every shard moved in a burst did)."""
    store = SqliteStore(str(tmp_path / "l.db"), "leases")
    try:
        def named(name: str, owner: str) -> RowLease:
            return RowLease(store, name=name, key=f"p.{name}", owner=owner, duration=5.0,
                            safety_margin=0.5)

        held = named("x", "a")
        assert (await held.try_acquire()).held
        await held.release(record=True)
        assert (await named("y", "b").try_acquire()).held  # sweeps, but not p.x
        after = await named("x", "c").try_acquire()
        assert after.held and after.previous_claims_ended
    finally:
        await store.close()


async def test_a_release_wakes_its_standby_after_another_names_acquire(tmp_path):
    """Standbys of several leases share one store (a shard group). A release that
    another lease's acquire saw before the standby of the released lease began its
    wait must still wake that standby: before, it slept out its retry interval."""
    path = str(tmp_path / "l.db")
    mine, theirs = SqliteStore(path, "leases"), SqliteStore(path, "leases")
    try:
        holder = RowLease(theirs, name="x", key="p.x", owner="b", duration=5.0,
                          safety_margin=0.5)
        standby = RowLease(mine, name="x", key="p.x", owner="a", duration=5.0,
                           safety_margin=0.5)
        other = RowLease(mine, name="y", key="p.y", owner="a", duration=5.0,
                         safety_margin=0.5)
        assert (await holder.try_acquire()).held
        assert not (await standby.try_acquire()).held
        await holder.release()
        assert (await other.try_acquire()).held  # saw the release's commit
        loop = asyncio.get_running_loop()
        started = loop.time()
        await standby.wait_for_change(3.0)
        assert loop.time() - started < 1.0
        assert (await standby.try_acquire()).held
    finally:
        await mine.close()
        await theirs.close()


async def test_more_standbys_than_inotify_instances_all_wake_on_a_commit(tmp_path):
    """A shard group's standbys wait at once on one store, more of them than a user's
    inotify instances (128 by default) across a host's members. Each wait must give its
    instance back, and a wait that polls must judge the files by its own last look:
    before, leaked instances sent the store to polling, where one waiter's look hid the
    commit from the rest, and they slept out their retry interval."""
    path = str(tmp_path / "l.db")
    mine, theirs = SqliteStore(path, "leases"), SqliteStore(path, "leases")
    try:
        def named(store: SqliteStore, i: int, owner: str) -> RowLease:
            return RowLease(store, name=f"n{i}", key=f"p.n{i}", owner=owner, duration=5.0,
                            safety_margin=0.5)

        holders = [named(theirs, i, "b") for i in range(150)]
        standbys = [named(mine, i, "a") for i in range(150)]
        assert all(g.held for g in await asyncio.gather(*(h.try_acquire() for h in holders)))
        assert not any(g.held for g in await asyncio.gather(
            *(s.try_acquire() for s in standbys)))
        loop = asyncio.get_running_loop()
        for _ in range(2):  # the instances of the first round came back for the second
            started = loop.time()
            waits = asyncio.gather(*(s.wait_for_change(5.0) for s in standbys))
            await asyncio.sleep(0.3)
            await holders[0].release()
            await asyncio.wait_for(waits, 3.0)
            assert loop.time() - started < 2.0
            assert not mine._watch._open_watches
            assert not any(g.held for g in await asyncio.gather(
                *(s.try_acquire() for s in standbys[1:])))
            assert (await standbys[0].try_acquire()).held
            await standbys[0].release()
            assert (await holders[0].try_acquire()).held
            assert not (await standbys[0].try_acquire()).held
    finally:
        await mine.close()
        await theirs.close()


async def test_acquires_and_releases_in_flight_together_share_one_commit(tmp_path):
    """A member that takes or gives back dozens of shards at once commits them in one
    transaction (one disk sync, one turn at the file's lock), each with its own
    outcome: the file's change counter moves once."""
    path = tmp_path / "l.db"
    store = SqliteStore(str(path), "leases")

    def changes() -> int:
        return int.from_bytes(path.read_bytes()[24:28], "big")

    try:
        leases = [RowLease(store, name=f"n{i}", key=f"p.n{i}", owner="a", duration=5,
                           safety_margin=0.5) for i in range(20)]
        assert (await leases[0].try_acquire()).held  # creates the file
        before = changes()
        grants = await asyncio.gather(*(one.try_acquire() for one in leases[1:]))
        assert all(g.held for g in grants) and changes() == before + 1
        tokens = [g.fencing_token for g in grants]
        assert len(set(tokens)) == len(tokens)
        rival = RowLease(store, name="n1", key="p.n1", owner="b", duration=5,
                         safety_margin=0.5)
        assert not (await rival.try_acquire()).held  # each acquire kept its own rules
        await asyncio.gather(*(one.release(record=True) for one in leases))
        assert changes() == before + 2
        assert (await rival.try_acquire()).previous_claims_ended
    finally:
        await store.close()


async def test_expired_row_is_taken_over_with_a_larger_token(tmp_path):
    a_store = SqliteStore(str(tmp_path / "l.db"), "leases")
    try:
        a = lease(a_store, "a", duration=0.2)
        b = lease(a_store, "b", duration=0.2)
        first = await a.try_acquire()
        assert first.held
        assert not (await b.try_acquire()).held
        await asyncio.sleep(0.3)
        assert not (await a.try_renew()).held  # expired rows cannot be renewed
        second = await b.try_acquire()
        assert second.held and second.fencing_token > first.fencing_token
    finally:
        await a_store.close()


async def test_many_names_share_one_table(tmp_path):
    store = SqliteStore(str(tmp_path / "l.db"), "leases")
    try:
        grants = [await RowLease(store, name=f"n{i}", key=f"p.n{i}", owner="a",
                                 duration=5, safety_margin=0.5).try_acquire()
                  for i in range(5)]
        assert all(g.held for g in grants)
        tokens = [g.fencing_token for g in grants]
        assert tokens == sorted(set(tokens))
    finally:
        await store.close()


async def test_release_wakes_a_waiting_standby(contenders):
    a, b = contenders
    await a.try_acquire()
    assert not (await b.try_acquire()).held  # a standby waits after a refused acquire
    loop = asyncio.get_running_loop()
    started = loop.time()
    waiter = asyncio.ensure_future(b.wait_for_change(5.0))
    await asyncio.sleep(0.1)
    await a.release()
    await asyncio.wait_for(waiter, 2.0)
    assert loop.time() - started < 1.0
    assert (await b.try_acquire()).held


async def test_a_release_before_the_wait_begins_is_not_missed(contenders):
    """The release lands between the standby's refused acquire and its wait (a busy
    host: the hand-over's hint woke it just before). Before, the standby took the files
    as they were after its acquire's reply as \"seen\", the release with them, and slept
    out its retry delay (the sqlite p99 of the hand-over benchmark)."""
    a, b = contenders
    assert (await a.try_acquire()).held
    assert not (await b.try_acquire()).held
    await a.release()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await b.wait_for_change(3.0)
    assert loop.time() - started < 1.0
    assert (await b.try_acquire()).held
    # Nothing new since b's acquire: its wait runs to the end.
    started = loop.time()
    assert not (await a.try_acquire()).held
    await a.wait_for_change(0.3)
    assert loop.time() - started >= 0.29


async def test_a_standby_that_looked_before_the_hand_over_does_not_take_the_lease(tmp_path):
    """The race behind the late sqlite hand-overs: a standby that is not named reads
    "no hint" just before the holder's release (hint and release in one commit) and
    acquires just after it, queued on the write lock behind that commit. It took the
    lease handed to another, and the named one led only after two more commits (that
    insert, and the lease given back) and its busy retries. The acquire now looks at the
    hint in its own transaction."""
    path = str(tmp_path / "l.db")
    stores = [SqliteStore(path, "leases") for _ in range(3)]
    try:
        holder, other, named = (lease(store, owner)
                                for store, owner in zip(stores, ("a", "b", "c"), strict=True))
        assert (await holder.try_acquire()).held
        assert await other.handing_to_other() is None  # the elector's look, before
        await holder.hand_to("c", 5.0)
        await holder.release()  # the hint and the free lease in one commit
        refused = await other.try_acquire()
        assert not refused.held and refused.reason is not None and "c" in refused.reason
        assert (await other.describe()).holder is None  # it wrote no row of its own
        taken = await named.try_acquire()
        assert taken.held
        assert await other.handing_to_other() == "c"
        assert await named.handing_to_other() is None  # the elector's look after the win
        assert await other.handing_to_other() is None  # it ended the hint
        assert not (await other.try_acquire()).held  # held now, as usual
        # The hint never stands in the way of its own successor's renew and release.
        assert (await named.try_renew()).held
        await named.release()
        assert (await named.try_acquire()).held
    finally:
        for store in stores:
            await store.close()


async def test_an_acquire_that_finds_the_lease_held_writes_nothing(contenders, tmp_path):
    """Standbys acquire on every commit they see; each one wrote (and synced) the
    version counter, slowing the holder's renews on a busy disk."""
    a, b = contenders
    assert (await a.try_acquire()).held
    assert not (await b.try_acquire()).held  # b's first connect sets the file up
    watcher = sqlite3.connect(tmp_path / "l.db")
    before = watcher.execute("PRAGMA data_version").fetchone()
    for _ in range(3):
        assert not (await b.try_acquire()).held
    assert watcher.execute("PRAGMA data_version").fetchone() == before
    watcher.close()


def test_schema_is_idempotent_and_printable(tmp_path):
    ddl = schema_sql(Settings())
    assert "CREATE TABLE IF NOT EXISTS leases" in ddl
    conn = sqlite3.connect(tmp_path / "x.db")
    conn.executescript(ddl)
    conn.executescript(ddl)
    assert conn.execute("SELECT value FROM leases_version").fetchone() == (0,)


def test_sqlite_dsn_forms():
    assert sqlite_path("/var/tmp/x.db") == "/var/tmp/x.db"
    assert sqlite_path("sqlite:////var/tmp/x.db") == "/var/tmp/x.db"
    assert sqlite_path("sqlite:///rel.db") == "rel.db"


async def test_a_second_process_with_our_identity_is_refused_and_counted(tmp_path):
    first = SqliteStore(str(tmp_path / "l.db"), "leases")
    second = SqliteStore(str(tmp_path / "l.db"), "leases")  # the twin "process"
    try:
        holder = RowLease(first, name="twins", key="p.twins", owner="same",
                          duration=0.6, safety_margin=0.1)
        twin = RowLease(second, name="twins", key="p.twins", owner="same",
                        duration=0.6, safety_margin=0.1)
        held = await holder.try_acquire()
        assert held.held
        refused = await twin.try_acquire()
        assert not refused.held and refused.holder == "same"
        assert refused.duplicate_identity
        assert (await holder.try_renew()).held  # the twin did not touch the row
        await asyncio.sleep(0.8)
        taken = await twin.try_acquire()  # expired: now it is a new term
        assert taken.held and taken.fencing_token > held.fencing_token
    finally:
        await first.close()
        await second.close()


async def test_our_own_unreleased_row_is_not_a_duplicate(tmp_path):
    store = SqliteStore(str(tmp_path / "l.db"), "leases")
    try:
        mine = RowLease(store, name="solo", key="p.solo", owner="me", duration=0.6,
                        safety_margin=0.1)
        assert (await mine.try_acquire()).held
        mine._token = None  # as after a step-down whose release failed
        again = await mine.try_acquire()
        assert not again.held and "previous term" in again.reason
        assert not again.duplicate_identity
    finally:
        await store.close()


async def test_a_deleted_database_makes_the_holder_step_down_and_holds_off(tmp_path):
    path = tmp_path / "l.db"
    a_store = SqliteStore(str(path), "leases", holdoff=0.5)
    b_store = SqliteStore(str(path), "leases", holdoff=0.5)
    try:
        a = RowLease(a_store, name="job", key="p.job", owner="a", duration=5,
                     safety_margin=0.5)
        b = RowLease(b_store, name="job", key="p.job", owner="b", duration=5,
                     safety_margin=0.5)
        first = await a.try_acquire()
        assert first.held and not (await b.try_acquire()).held
        path.unlink()
        lost = await a.try_renew()
        assert not lost.held and "deleted or replaced" in lost.reason
        # b notices too, reopens on a new file, and holds off for the hold-off time.
        assert "deleted or replaced" in (await b.try_acquire()).reason
        held_off = await b.try_acquire()
        assert not held_off.held and "no acquisition before" in held_off.reason
        await asyncio.sleep(0.6)
        taken = await b.try_acquire()
        assert taken.held and taken.fencing_token > first.fencing_token
    finally:
        await a_store.close()
        await b_store.close()


def test_a_new_database_seeds_its_counter_above_the_wall_clock(tmp_path):
    import time

    before = time.time_ns() // 1000

    async def first_token() -> int:
        store = SqliteStore(str(tmp_path / "l.db"), "leases")
        try:
            grant = await lease(store, "a").try_acquire()
            return int(grant.fencing_token)
        finally:
            await store.close()

    token = asyncio.run(first_token())
    assert token > before


async def test_a_wal_database_of_an_older_version_is_switched_to_a_rollback_journal(tmp_path):
    """In WAL mode, closing the last connection deletes ``-wal``/``-shm`` by name: after a
    replacement those would be the new database's files."""
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.execute("PRAGMA journal_mode=WAL")
    old.executescript(schema_sql(Settings()))
    store = SqliteStore(str(path), "leases")
    # While the older version has it open, the switch is refused with a clear reason.
    with pytest.raises(BackendError, match="cannot leave WAL mode"):
        await lease(store, "a").try_acquire()
    old.close()
    try:
        assert (await lease(store, "a").try_acquire()).held
    finally:
        await store.close()
    with sqlite3.connect(path) as check:
        assert check.execute("PRAGMA journal_mode").fetchone() == ("delete",)
