"""The row-lease contract every SQL store must meet, run against real servers.

A test module subclasses :class:`RowStoreContract` and provides a ``make_store`` fixture:
a callable returning a fresh :class:`~sidecar.lease.sql.store.SqlRowStore` on the same
database, with the schema already applied. The same tests then run over asyncpg on
PostgreSQL, over pyodbc (psqlODBC) on PostgreSQL, and over pyodbc on a live SQL Server.
Lease names are random, so a shared database (the live SQL Server) needs no cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from sidecar.lease.rowlease import RowLease
from sidecar.lease.sql.store import SqlRowStore

MakeStore = Callable[..., SqlRowStore]
SHORT = 0.6  # seconds: a lease that expires within the test
LONG = 30.0


@contextlib.asynccontextmanager
async def store_factory(
    build: Callable[[bool, str | None], SqlRowStore],
) -> AsyncIterator[MakeStore]:
    """The ``make_store`` of a test module: ``build(replica, dsn)`` makes one store; the
    schema is applied once, and every store made is closed at the end."""
    stores: list[SqlRowStore] = []

    def make(replica: bool = False, dsn: str | None = None) -> SqlRowStore:
        store = build(replica, dsn)
        stores.append(store)
        return store

    await make().apply_schema()
    try:
        yield make
    finally:
        for store in stores:
            await store.close()


def fresh() -> str:
    return f"contract.{uuid.uuid4().hex[:12]}"


class RowStoreContract:
    @pytest.fixture
    def store(self, make_store: MakeStore) -> SqlRowStore:
        return make_store()

    async def test_first_acquire_wins_and_a_rival_learns_the_holder(
            self, store: SqlRowStore) -> None:
        name = fresh()
        mine = await store.acquire(name, "a", LONG)
        assert mine is not None and mine.owner == "a" and mine.version > 0
        theirs = await store.acquire(name, "b", LONG)
        assert theirs is not None and theirs.owner == "a"
        assert theirs.version == mine.version  # the loser changed nothing
        assert (await store.read(name)).owner == "a"

    async def test_acquire_never_refreshes_a_live_row_even_one_naming_us(
            self, store: SqlRowStore) -> None:
        """A second process with our identity must not extend (and share) our term."""
        name = fresh()
        first = await store.acquire(name, "a", SHORT)
        assert first is not None and first.won
        again = await store.acquire(name, "a", LONG)
        assert again is not None and again.owner == "a" and not again.won
        assert again.version == first.version and again.expires_at == first.expires_at
        await asyncio.sleep(SHORT + 0.4)
        taken = await store.acquire(name, "a", LONG)  # expired: a new term
        assert taken is not None and taken.won and taken.version > first.version

    async def test_row_lease_refuses_a_live_row_under_its_own_identity(
            self, make_store: MakeStore) -> None:
        name = fresh()
        holder = RowLease(make_store(), "n", name, "twin", duration=SHORT, safety_margin=0.1)
        twin = RowLease(make_store(), "n", name, "twin", duration=SHORT, safety_margin=0.1)
        held = await holder.try_acquire()
        assert held.held
        refused = await twin.try_acquire()
        assert not refused.held and refused.reason == "held by another process with our identity"
        assert (await holder.try_acquire()).fencing_token == held.fencing_token  # re-entrant
        await asyncio.sleep(SHORT + 0.4)
        taken = await twin.try_acquire()
        assert taken.held and taken.fencing_token > held.fencing_token

    async def test_renew_only_by_the_owner_and_only_while_live(self, store: SqlRowStore) -> None:
        name = fresh()
        first = await store.acquire(name, "a", SHORT)
        assert await store.renew(name, "b", LONG, first.version) is None
        renewed = await store.renew(name, "a", SHORT, first.version)
        assert renewed is not None and renewed.owner == "a"
        assert renewed.expires_at >= first.expires_at and renewed.version > first.version
        await asyncio.sleep(SHORT + 0.4)
        assert await store.renew(name, "a", LONG, renewed.version) is None, \
            "renewed an expired row"

    async def test_release_only_by_the_owner_of_that_term(self, store: SqlRowStore) -> None:
        name = fresh()
        held = await store.acquire(name, "a", LONG)
        await store.release(name, "b", held.version)
        await store.release(name, "a", held.version - 1)  # an older term of ours
        assert (await store.read(name)).owner == "a"
        await store.release(name, "a", held.version)
        assert await store.read(name) is None
        assert (await store.acquire(name, "b", LONG)).owner == "b"

    async def test_only_the_acquire_right_after_a_release_finds_its_record(
            self, store: SqlRowStore) -> None:
        """The release record (Grant.previous_claims_ended) counts for the term it was
        written on only: not after an expiry, nor once another term came between."""
        if not store.dialect.acquire_reports_release:
            pytest.skip(f"{type(store.dialect).__name__} keeps no release record")
        name = fresh()
        first = await store.acquire(name, "a", LONG)
        assert first.won and not first.previous_claims_ended  # nothing was there
        await store.release(name, "a", first.version, record=True)
        after = await store.acquire(name, "b", SHORT)
        assert after.won and after.owner == "b" and after.previous_claims_ended
        await store.release(name, "b", after.version)  # released, but without a record
        unrecorded = await store.acquire(name, "b", SHORT)
        assert unrecorded.won and not unrecorded.previous_claims_ended
        await asyncio.sleep(SHORT + 0.4)  # b's term runs out, unreleased
        expired = await store.acquire(name, "c", LONG)
        assert expired.won and not expired.previous_claims_ended
        await store.release(name, "c", expired.version - 1, record=True)  # not c's last write
        assert (await store.acquire(name, "d", LONG)).owner == "c"
        await store.release(name, "c", expired.version, record=True)
        again = await store.acquire(name, "d", LONG)
        assert again.won and again.previous_claims_ended

    async def test_an_expired_row_is_taken_over_with_a_larger_version(
            self, store: SqlRowStore) -> None:
        name = fresh()
        old = await store.acquire(name, "a", SHORT)
        assert (await store.acquire(name, "b", LONG)).owner == "a"
        await asyncio.sleep(SHORT + 0.4)
        assert await store.read(name) is None  # expired rows do not count as held
        new = await store.acquire(name, "b", LONG)
        assert new is not None and new.owner == "b" and new.version > old.version
        assert await store.renew(name, "a", LONG, old.version) is None

    async def test_the_token_grows_across_holders_and_releases(
            self, store: SqlRowStore) -> None:
        name = fresh()
        versions = []
        for owner in ("a", "b", "a", "c"):
            row = await store.acquire(name, owner, LONG)
            assert row is not None and row.owner == owner
            versions.append(row.version)
            await store.release(name, owner, row.version)
        assert versions == sorted(set(versions))

    async def test_acquire_sweeps_other_expired_rows(self, make_store: MakeStore) -> None:
        store, replica_view = make_store(), make_store(replica=True)
        abandoned, other = fresh(), fresh()
        await store.acquire(abandoned, "crashed", SHORT)
        await asyncio.sleep(SHORT + 0.4)
        assert await replica_view.read(abandoned) is not None  # still there, just expired
        await store.acquire(other, "b", LONG)
        assert await replica_view.read(abandoned) is None

    async def test_list_all_shows_expired_rows_as_not_live(self, store: SqlRowStore) -> None:
        """``status`` lists without sweeping: an expired row is there, flagged not live by
        the server's clock. (Acquire sweeps other expired rows, so the live one first.)"""
        live, expired = fresh(), fresh()
        await store.acquire(live, "a", LONG)
        await store.acquire(expired, "gone", SHORT)
        await asyncio.sleep(SHORT + 0.4)
        rows = {name: (row, flag) for name, row, flag in await store.list_all()}
        assert rows[live][0].owner == "a" and rows[live][1] is True
        assert rows[expired][0].owner == "gone" and rows[expired][1] is False
        assert rows[expired][0].expires_at < rows[live][0].expires_at
        assert await store.read(expired) is None  # the same verdict as the lease path

    async def test_concurrent_contenders_have_exactly_one_winner(
            self, make_store: MakeStore) -> None:
        name = fresh()
        stores = [make_store() for _ in range(8)]
        rows = await asyncio.gather(*(s.acquire(name, f"c{i}", LONG)
                                      for i, s in enumerate(stores)))
        owners = {row.owner for row in rows if row is not None}
        winners = [i for i, row in enumerate(rows)
                   if row is not None and row.won and row.owner == f"c{i}"]
        assert len(winners) == 1 and owners <= {f"c{winners[0]}"}

    async def test_concurrent_takeover_of_an_expired_row_has_one_winner(
            self, make_store: MakeStore) -> None:
        name = fresh()
        stores = [make_store() for _ in range(8)]
        await stores[0].acquire(name, "old", SHORT)
        await asyncio.sleep(SHORT + 0.4)
        rows = await asyncio.gather(*(s.acquire(name, f"c{i}", LONG)
                                      for i, s in enumerate(stores)))
        winners = [i for i, row in enumerate(rows)
                   if row is not None and row.won and row.owner == f"c{i}"]
        assert len(winners) == 1

    async def test_row_lease_grants_tokens_and_names_the_holder(
            self, make_store: MakeStore) -> None:
        name = fresh()
        a = RowLease(make_store(), "n", name, "a", duration=LONG, safety_margin=1.0)
        b = RowLease(make_store(), "n", name, "b", duration=LONG, safety_margin=1.0)
        held = await a.try_acquire()
        assert held.held and held.valid_for == LONG - 1.0 and held.fencing_token is not None
        lost = await b.try_acquire()
        assert not lost.held and lost.holder == "a"
        assert (await a.try_renew()).fencing_token == held.fencing_token  # one term, one token
        assert (await b.describe()).holder == "a"
        await a.release()
        taken = await b.try_acquire()
        assert taken.held and taken.fencing_token > held.fencing_token

    async def test_the_named_successor_ends_the_hint_once_it_holds_the_lease(
            self, make_store: MakeStore) -> None:
        """Seen in real pods (postgres-row): the hint of a hand-over lived out its bound (a
        lease duration) after the named standby had won, and the other standbys, who
        stand aside while a hint names someone else, did so through that term, deaf to
        wake-ups; a leader deleted within that time was replaced only at their next retry
        (a renew interval late, 6 of 10 times). The winner now ends the hint."""
        name = fresh()
        holder, other, named = (
            RowLease(make_store(), "n", name, owner, duration=LONG, safety_margin=1.0)
            for owner in ("a", "b", "c"))
        assert (await holder.try_acquire()).held
        await holder.hand_to("c", LONG)
        await holder.release(record=True)
        assert await other.handing_to_other() == "c"  # b stands aside
        assert await named.handing_to_other() is None  # c, not holding yet, leaves it
        assert await other.handing_to_other() == "c"
        assert (await named.try_acquire()).held
        assert await named.handing_to_other() is None  # the elector's look after the win
        assert await other.handing_to_other() is None  # gone: nobody stands aside now
        assert not (await other.try_acquire()).held  # held by c, as usual
        assert (await named.try_renew()).held
