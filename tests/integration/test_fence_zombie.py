"""The zombie leader (testkit/fence_zombie.py) on real sidecars and a real PostgreSQL: a
leader paused between its claim check and its writes resumes after a newer leader has
written and fires writes with its old token. With the guard none of them commits and
every write of the new leader does; without it they land. The full run (10,000 writes,
every backend, PgBouncer) is bench/bench_fence.py; this one is short.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from sidecar import fence
from testkit.fence_zombie import NAME, Setup, zombie_run
from testkit.support import SidecarProcess
from testkit.testbed.postgres import PgServer
from tests.testbed.pgbouncer_fixtures import StartBouncer

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
LEASE = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
         "--safety-margin", "500ms"]
ZOMBIE_WRITES = 300


def row_setup(lease_dsn: str, app_dsn: str, pooled: bool = False) -> Setup:
    def make(workdir: Path, identity: str) -> SidecarProcess:
        return SidecarProcess(workdir, identity, args=[
            "--backend", "postgres-row", "--dsn", lease_dsn, "--ensure-schema", "true",
            "--name", NAME, *LEASE])

    return Setup("postgres-row", app_dsn, make, lease_duration=2.0, pooled=pooled)


@pytest.fixture
def app_dsn(pg: PgServer) -> str:
    """The application's own database: not the lease's."""
    name = f"app_{uuid.uuid4().hex[:12]}"
    pg.create_database(name)
    return pg.dsn_for(name)


def test_with_the_guard_no_stale_write_commits(pg_dsn: str, app_dsn: str,
                                               tmp_path: Path) -> None:
    run = zombie_run(row_setup(pg_dsn, app_dsn), tmp_path, guard=True,
                     zombie_writes=ZOMBIE_WRITES)
    assert run["new_tokens"] and min(run["new_tokens"]) > run["old_token"], run
    assert run["zombie_committed"] == 0, run
    assert run["zombie_refused"] == {fence.STALE_SQLSTATE: ZOMBIE_WRITES}, run
    assert run["new_leader_committed"] == run["new_leader_writes"] > 0, run
    assert run["committed_out_of_token_order"] == 0, run


def test_without_the_guard_the_stale_writes_land(pg_dsn: str, app_dsn: str,
                                                 tmp_path: Path) -> None:
    run = zombie_run(row_setup(pg_dsn, app_dsn), tmp_path, guard=False,
                     zombie_writes=ZOMBIE_WRITES)
    assert run["zombie_committed"] == ZOMBIE_WRITES, run
    assert run["committed_out_of_token_order"] == ZOMBIE_WRITES, run


def test_through_transaction_pooling(pg: PgServer, pg_dsn: str, app_dsn: str,
                                     pgbouncer: StartBouncer, tmp_path: Path) -> None:
    bouncer = pgbouncer(pool_mode="transaction", pool_size=4)
    lease_db, app_db = pg_dsn.rsplit("/", 1)[1], app_dsn.rsplit("/", 1)[1]
    setup = row_setup(bouncer.dsn_for(lease_db), bouncer.dsn_for(app_db), pooled=True)
    run = zombie_run(setup, tmp_path, guard=True, zombie_writes=ZOMBIE_WRITES)
    assert run["zombie_committed"] == 0, run
    assert run["zombie_refused"] == {fence.STALE_SQLSTATE: ZOMBIE_WRITES}, run
    assert run["new_leader_committed"] == run["new_leader_writes"] > 0, run
    assert run["committed_out_of_token_order"] == 0, run
