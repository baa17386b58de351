"""The fencing guard on a real PostgreSQL, directly and through real PgBouncer transaction
pooling: ``lease-sidecar fence-schema --apply`` creates it (idempotently, next to the
application's own tables), and ``lease_fence(name, token)`` run inside the application's
transactions lets a transaction's writes commit only if no newer leader wrote first.

Sessions are psycopg connections (autocommit off: each block is one transaction), as an
application's would be; waits are bounded with ``lock_timeout``.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import psycopg
import pytest

from sidecar import fence
from testkit.testbed.pgbouncer import PgBouncer
from testkit.testbed.postgres import PgServer
from tests.testbed.pgbouncer_fixtures import StartBouncer

pytestmark = pytest.mark.postgres

CALL = fence.call("postgres")
LOCK_WAITED = "55P03"  # lock_not_available: lock_timeout ran out


def apply(dsn: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", "fence-schema", "--apply",
                           "--dsn", dsn, *extra], capture_output=True, text=True, timeout=60)


@pytest.fixture
def app_dsn(pg_dsn: str) -> str:
    """This test's database with the guard applied and an application table."""
    result = apply(pg_dsn)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE writes (id bigserial PRIMARY KEY, writer text, "
                     "token bigint)")
    return pg_dsn


def connect(dsn: str, **kw: object) -> psycopg.Connection:
    # prepare_threshold=None: no server-side prepared statements (transaction pooling).
    return psycopg.connect(dsn, prepare_threshold=None, **kw)


def guarded_write(conn: psycopg.Connection, token: int, writer: str = "app",
                  name: str = "jobs") -> None:
    """One transaction: the guard, then the application's write."""
    with conn.transaction():
        conn.execute(CALL, (name, token))
        conn.execute("INSERT INTO writes (writer, token) VALUES (%s, %s)", (writer, token))


def rows(dsn: str) -> list[tuple[int, str, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT id, writer, token FROM writes ORDER BY id").fetchall()


def refused(call: Callable[[], object]) -> str:
    with pytest.raises(psycopg.Error) as caught:
        call()
    assert caught.value.sqlstate is not None
    return caught.value.sqlstate


# -- the schema ----------------------------------------------------------------------------
def test_apply_is_idempotent_and_lives_beside_the_apps_tables(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    for _ in range(2):
        result = apply(pg_dsn, "--schema", "app_guard")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == (
            'fence schema applied (postgres, "app_guard".lease_fence)')
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        objects = conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'app_guard' AND c.relkind = 'r'").fetchall()
        assert objects == [("lease_fence",)]
        functions = conn.execute(
            "SELECT p.proname, pg_get_function_identity_arguments(p.oid) FROM pg_proc p "
            "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'app_guard'"
        ).fetchall()
        assert functions == [("lease_fence", "lease_name text, fencing_token bigint")]
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (0,)


def test_applies_at_once_from_several_processes(pg_dsn: str) -> None:
    procs = [subprocess.Popen([sys.executable, "-m", "sidecar", "fence-schema", "--apply",
                               "--dsn", pg_dsn], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for proc in procs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err


# -- the rule ------------------------------------------------------------------------------
def test_equal_passes_higher_is_recorded_lower_is_refused(app_dsn: str) -> None:
    with connect(app_dsn) as conn:
        guarded_write(conn, 5)
        guarded_write(conn, 5)  # the same leader, many writes, one token
        guarded_write(conn, 2**53 - 1)  # every backend's tokens stay below 2^53
        assert refused(lambda: guarded_write(conn, 6)) == fence.STALE_SQLSTATE
        assert refused(lambda: guarded_write(conn, 2**53 - 2, name="jobs")) == "LF001"
        guarded_write(conn, 1, name="other")  # names are independent
        for bad in ((None, 5), ("", 5), ("jobs", None), ("jobs", -1)):
            with pytest.raises(psycopg.Error) as caught, conn.transaction():
                conn.execute(CALL, bad)
            assert caught.value.sqlstate == fence.BAD_CALL_SQLSTATE
    assert [(w, t) for _, w, t in rows(app_dsn)] == [
        ("app", 5), ("app", 5), ("app", 2**53 - 1), ("app", 1)]


def test_a_refused_transaction_keeps_none_of_its_writes(app_dsn: str) -> None:
    with connect(app_dsn) as conn:
        guarded_write(conn, 9)
        with pytest.raises(psycopg.Error) as caught, conn.transaction():
            conn.execute("INSERT INTO writes (writer, token) VALUES ('stale', 8)")
            conn.execute(CALL, ("jobs", 8))
            conn.execute("INSERT INTO writes (writer, token) VALUES ('stale', 8)")
        assert caught.value.sqlstate == fence.STALE_SQLSTATE
        assert "stale fencing token 8 for lease 'jobs': the highest seen is 9" in str(
            caught.value)
    assert [w for _, w, _ in rows(app_dsn)] == ["app"]


def lock_timeout(conn: psycopg.Connection, ms: int) -> None:
    conn.execute(f"SET lock_timeout = {ms}")
    conn.commit()


def test_one_token_shares_the_row_and_a_newer_one_waits_for_it(app_dsn: str) -> None:
    with connect(app_dsn) as first, connect(app_dsn) as second, connect(app_dsn) as newer:
        for conn in (first, second, newer):
            lock_timeout(conn, 300)
        guarded_write(first, 5)
        # The old leader has a transaction open, guard passed, a write done.
        first.execute(CALL, ("jobs", 5))
        first.execute("INSERT INTO writes (writer, token) VALUES ('old-open', 5)")
        # The same leader's other transactions do not wait for it...
        guarded_write(second, 5, "old")
        # ...but the newer leader's guard does: it may not write before that ends.
        assert refused(lambda: guarded_write(newer, 6, "new")) == LOCK_WAITED
        first.commit()
        guarded_write(newer, 6, "new")
        # From then on the old token fails, however it comes.
        assert refused(lambda: guarded_write(second, 5, "old")) == fence.STALE_SQLSTATE
    assert [w for _, w, _ in rows(app_dsn)] == ["app", "old-open", "old", "new"]


def test_an_old_transaction_that_waits_for_the_newer_one_is_refused(app_dsn: str) -> None:
    with connect(app_dsn) as old, connect(app_dsn) as newer:
        guarded_write(old, 5)
        newer.execute(CALL, ("jobs", 6))  # open: holds the row exclusively
        outcome: list[str] = []

        def stale() -> None:
            try:
                guarded_write(old, 5, "old")
                outcome.append("committed")
            except psycopg.Error as exc:
                outcome.append(exc.sqlstate or "")

        waiter = threading.Thread(target=stale)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "the old token did not wait for the newer holder"
        newer.execute("INSERT INTO writes (writer, token) VALUES ('new', 6)")
        newer.commit()
        waiter.join(10)
        assert outcome == [fence.STALE_SQLSTATE]
    assert [w for _, w, _ in rows(app_dsn)] == ["app", "new"]


def test_under_repeatable_read_a_stale_leader_is_refused_too(app_dsn: str) -> None:
    with connect(app_dsn) as old, connect(app_dsn) as newer:
        guarded_write(old, 5)
        old.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        old.execute("SELECT count(*) FROM writes")  # its snapshot predates the new leader
        guarded_write(newer, 6, "new")
        with pytest.raises(psycopg.Error) as caught:
            old.execute(CALL, ("jobs", 5))
        # 40001: could not serialize; a retry then gets LF001.
        assert caught.value.sqlstate in ("40001", fence.STALE_SQLSTATE)
        old.rollback()
        assert refused(lambda: guarded_write(old, 5, "old")) == fence.STALE_SQLSTATE


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_newer_leader_waits_for_the_old_ones_whatever_their_isolation(
        app_dsn: str, level: str) -> None:
    with connect(app_dsn) as old, connect(app_dsn) as newer:
        guarded_write(old, 5)
        old.execute(CALL, ("jobs", 5))  # READ COMMITTED, open
        newer.execute(f"BEGIN ISOLATION LEVEL {level}")
        newer.execute("SET LOCAL lock_timeout = 300")
        with pytest.raises(psycopg.Error) as caught:
            newer.execute(CALL, ("jobs", 6))
        assert caught.value.sqlstate == LOCK_WAITED
        newer.rollback()
        old.commit()
        newer.execute(f"BEGIN ISOLATION LEVEL {level}")
        newer.execute(CALL, ("jobs", 6))
        newer.commit()
        assert refused(lambda: guarded_write(old, 5)) == fence.STALE_SQLSTATE


def test_a_leader_that_waited_out_one_token_waits_out_the_next_one_too(
        app_dsn: str) -> None:
    """Leader 7 reads token 5 and waits for its transactions; meanwhile leader 6 records
    its token (here by hand, as a leader-6 guard that got the lock first would) and a
    leader-6 transaction opens. Leader 7 must wait for that one too before it records."""
    with connect(app_dsn) as old, connect(app_dsn) as six, connect(app_dsn) as seven:
        guarded_write(old, 5)
        old.execute(CALL, ("jobs", 5))  # open, holds token 5's lock
        outcome: list[str] = []

        def newest() -> None:
            try:
                guarded_write(seven, 7, "seven")
                outcome.append("committed")
            except psycopg.Error as exc:
                outcome.append(exc.sqlstate or "")

        waiter = threading.Thread(target=newest)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "token 7 did not wait for token 5's open transaction"
        with psycopg.connect(app_dsn, autocommit=True) as by_hand:
            by_hand.execute("""UPDATE "lease".lease_fence SET token = 6 WHERE name = 'jobs'""")
        six.execute(CALL, ("jobs", 6))  # open, holds token 6's lock
        six.execute("INSERT INTO writes (writer, token) VALUES ('six', 6)")
        old.commit()
        waiter.join(0.5)
        assert waiter.is_alive(), "token 7 did not wait for token 6's open transaction"
        six.commit()
        waiter.join(10)
        assert outcome == ["committed"]
        assert refused(lambda: guarded_write(six, 6)) == fence.STALE_SQLSTATE
    assert [w for _, w, _ in rows(app_dsn)] == ["app", "six", "seven"]


def writers_race(dsn: str, seconds: float = 3.0, writers: int = 6) -> list[tuple[int, str, int]]:
    """Writers hold tokens 1..n; every so often the newest token goes up by one and some
    writers keep using the one they had (paused leaders). Commit order of the writes is
    their id order: the bigserial is drawn after the guard, under its row lock."""
    newest = [1]
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        rng = random.Random(index)
        try:
            with connect(dsn) as conn:
                token = newest[0]
                while not stop.is_set():
                    if rng.random() < 0.3:
                        token = newest[0]
                    try:
                        guarded_write(conn, token, f"w{index}")
                    except psycopg.Error as exc:
                        if exc.sqlstate != fence.STALE_SQLSTATE:
                            raise
                        token = newest[0]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    deadline = threading.Event()
    for _ in range(int(seconds / 0.1)):
        deadline.wait(0.1)
        newest[0] += 1
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    return rows(dsn)


def assert_token_order(found: list[tuple[int, str, int]]) -> None:
    highest = 0
    for _, _, token in found:
        assert token >= highest, f"a write with token {token} after one with {highest}"
        highest = token


def test_committed_writes_are_in_token_order_under_a_race(app_dsn: str) -> None:
    found = writers_race(app_dsn)
    assert len({token for _, _, token in found}) > 5  # many terms wrote
    assert_token_order(found)


def test_without_the_guard_the_same_race_commits_out_of_order(app_dsn: str) -> None:
    """The control: the race above does produce stale writes when nothing fences them."""
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        # The guard's body replaced by a no-op with the same signature.
        conn.execute('CREATE OR REPLACE FUNCTION "lease".lease_fence(lease_name text, '
                     "fencing_token bigint) RETURNS bigint LANGUAGE sql AS 'SELECT $2'")
    found = writers_race(app_dsn, seconds=2.0)
    with pytest.raises(AssertionError, match="a write with token"):
        assert_token_order(found)


# -- through PgBouncer transaction pooling ---------------------------------------------------
@pytest.fixture
def pooled(pgbouncer: StartBouncer, app_dsn: str, pg: PgServer) -> Iterator[str]:
    bouncer: PgBouncer = pgbouncer(pool_mode="transaction", pool_size=2)
    yield bouncer.dsn_for(app_dsn.rsplit("/", 1)[1])


def test_behind_transaction_pooling_the_rule_holds(pooled: str, app_dsn: str) -> None:
    with connect(pooled) as conn:
        guarded_write(conn, 5)
        guarded_write(conn, 6)
        assert refused(lambda: guarded_write(conn, 5)) == fence.STALE_SQLSTATE
    with connect(pooled) as first, connect(pooled) as newer:
        # Settings last one transaction here (SET LOCAL): the pooler moves sessions.
        first.execute("SET LOCAL lock_timeout = 300")
        first.execute(CALL, ("jobs", 6))
        with pytest.raises(psycopg.Error) as caught, newer.transaction():
            newer.execute("SET LOCAL lock_timeout = 300")
            newer.execute(CALL, ("jobs", 7))
        assert caught.value.sqlstate == LOCK_WAITED
        first.commit()
        guarded_write(newer, 7)
    assert [t for _, _, t in rows(app_dsn)] == [5, 6, 7]


def test_behind_transaction_pooling_a_race_commits_in_token_order(pooled: str) -> None:
    found = writers_race(pooled, seconds=2.0, writers=4)
    assert len({token for _, _, token in found}) > 5
    assert_token_order(found)
