"""The PostgreSQL test bed itself: a primary answers, a standby replays, replay pauses."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from testkit.testbed.postgres import PgError, PgServer, PgStandby

pytestmark = pytest.mark.postgres


def test_primary_answers_and_is_not_in_recovery(pg: PgServer) -> None:
    assert pg.psql("select pg_is_in_recovery()") == "f"
    assert pg.pid is not None
    assert pg.psql("show fsync") == "off"


async def test_test_role_needs_its_password(pg: PgServer, pg_dsn: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        assert await conn.fetchval("select current_user") == "lease"
    finally:
        await conn.close()
    wrong = pg_dsn.replace(pg.password, "wrong-password")
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(wrong)


def test_each_test_gets_its_own_database(pg: PgServer, pg_database: str) -> None:
    assert pg.psql(f"select count(*) from pg_database where datname = '{pg_database}'") == "1"
    assert pg_database != "lease"


def test_standby_is_in_recovery_and_replays_a_row(pg: PgServer, pg_standby: PgStandby) -> None:
    assert pg_standby.psql("select pg_is_in_recovery()") == "t"
    table = f"r_{uuid.uuid4().hex[:8]}"
    pg.psql(f"create table {table} (v text); insert into {table} values ('hello')")
    pg_standby.wait_replayed()
    assert pg_standby.psql(f"select v from {table}") == "hello"
    with pytest.raises(PgError, match="read-only"):
        pg_standby.psql(f"insert into {table} values ('no')")


def test_pause_and_resume_replay(pg: PgServer, pg_standby: PgStandby) -> None:
    table = f"p_{uuid.uuid4().hex[:8]}"
    pg.psql(f"create table {table} (v int)")
    pg_standby.wait_replayed()
    pg_standby.pause_replay()
    try:
        pg.psql(f"insert into {table} values (1)")
        with pytest.raises(PgError, match="did not replay"):
            pg_standby.wait_replayed(timeout=1.0)
        assert pg_standby.psql(f"select count(*) from {table}") == "0"
    finally:
        pg_standby.resume_replay()
    pg_standby.wait_replayed()
    assert pg_standby.psql(f"select count(*) from {table}") == "1"


def test_stop_immediate_and_start_again(pg: PgServer, pg_standby: PgStandby) -> None:
    pg.stop("immediate")
    assert pg.pid is None
    with pytest.raises(PgError):
        pg.psql("select 1")
    pg.start()
    assert pg.psql("select 1") == "1"
