"""The row-lease rules on a real SQLite file."""

import asyncio
import sqlite3

from sidecar.lease.rowlease import RowLease
from sidecar.lease.sqlite import SqliteStore, schema_sql, sqlite_path


def lease(store: SqliteStore, owner: str, duration: float = 5.0) -> RowLease:
    return RowLease(store, name="job", row_name="p.job", owner=owner, duration=duration,
                    safety_margin=0.5)


async def test_one_holder_reentrant_and_owner_filtered(tmp_path):
    a_store = SqliteStore(str(tmp_path / "l.db"), "leases")
    b_store = SqliteStore(str(tmp_path / "l.db"), "leases")  # a second "process"
    try:
        a, b = lease(a_store, "a"), lease(b_store, "b")
        first = await a.try_acquire()
        assert first.held and first.valid_for == 4.5
        lost = await b.try_acquire()
        assert not lost.held and lost.holder == "a"
        again = await a.try_acquire()  # re-entrant: same term, same token
        assert again.held and again.fencing_token == first.fencing_token
        assert not (await b.try_renew()).held  # renew only touches one's own row
        await b.release()  # release only deletes one's own row
        assert (await a.describe()).holder == "a"
        assert (await a.try_renew()).held
        await a.release()
        assert (await a.describe()).holder is None
        taken = await b.try_acquire()
        assert taken.held and taken.fencing_token > first.fencing_token
    finally:
        await a_store.close()
        await b_store.close()


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
        grants = [await RowLease(store, name=f"n{i}", row_name=f"p.n{i}", owner="a",
                                 duration=5, safety_margin=0.5).try_acquire()
                  for i in range(5)]
        assert all(g.held for g in grants)
        tokens = [g.fencing_token for g in grants]
        assert tokens == sorted(set(tokens))
    finally:
        await store.close()


async def test_release_wakes_a_waiting_standby(tmp_path):
    a_store = SqliteStore(str(tmp_path / "l.db"), "leases")
    b_store = SqliteStore(str(tmp_path / "l.db"), "leases")
    try:
        a, b = lease(a_store, "a"), lease(b_store, "b")
        await a.try_acquire()
        await b.wait_for_change(0.05)  # primes the watcher
        loop = asyncio.get_running_loop()
        started = loop.time()
        waiter = asyncio.ensure_future(b.wait_for_change(5.0))
        await asyncio.sleep(0.1)
        await a.release()
        await asyncio.wait_for(waiter, 2.0)
        assert loop.time() - started < 1.0
        assert (await b.try_acquire()).held
    finally:
        await a_store.close()
        await b_store.close()


def test_schema_is_idempotent_and_printable(tmp_path):
    class S:
        table_name = "leases"

    ddl = schema_sql(S())  # type: ignore[arg-type]
    assert "CREATE TABLE IF NOT EXISTS leases" in ddl
    conn = sqlite3.connect(tmp_path / "x.db")
    conn.executescript(ddl)
    conn.executescript(ddl)
    assert conn.execute("SELECT value FROM leases_version").fetchone() == (0,)


def test_sqlite_dsn_forms():
    assert sqlite_path("/var/tmp/x.db") == "/var/tmp/x.db"
    assert sqlite_path("sqlite:////var/tmp/x.db") == "/var/tmp/x.db"
    assert sqlite_path("sqlite:///rel.db") == "rel.db"
