"""Commits the lease depends on, on real PostgreSQL servers: a crash right after a grant
when the role commits asynchronously, a renew that commits while a synchronous standby
stalls and the driver gives up, and a SIGTERM that lands while such a renew waits. Each
test failed on the code before its fix (issue 29, holes 5 and 6; the last one since); the
simulator's scripted and random runs (tests/sim, ``python -m testkit.sim``) cover the
first two with the server's model.

Library-level (the sidecar's own backends, ``create_backend``) but for the SIGTERM, which
goes to a real sidecar process; each server a throw-away cluster of the test bed
(``fsync = off``: a crash here is the server's processes dying, which loses what was
never written out of the WAL buffers — what an asynchronous commit risks)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar import config
from sidecar.base.clock import SystemClock
from sidecar.base.errors import BackendError
from sidecar.lease import Backend, Grant, create_backend
from testkit.support import SidecarProcess, wait_until
from testkit.testbed.postgres import TEST_DB, TEST_ROLE, PgServer, PgStandby
from tests.testbed.pg_fixtures import serve

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture
def async_commit_server() -> Iterator[PgServer]:
    """A server whose test role commits asynchronously and whose WAL writer flushes only
    every 10 s: a commit is lost by a crash within that window unless the client asked
    for a synchronous one."""
    server = PgServer().init()
    try:
        server.psql(f"alter role {TEST_ROLE} set synchronous_commit = off")
        server.psql("alter system set wal_writer_delay = '10s'")
        server.psql("select pg_reload_conf()")
        yield server
    finally:
        server.destroy()


def backend_for(backend: str, dsn: str, identity: str) -> Backend:
    settings = config.load(env={"LEASE_BACKEND": backend, "LEASE_DSN": dsn,
                                "LEASE_IDENTITY": identity, "LEASE_ENSURE_SCHEMA": "1"}
                           if backend == "postgres-row" else
                           {"LEASE_BACKEND": backend, "LEASE_DSN": dsn,
                            "LEASE_IDENTITY": identity})
    return create_backend(settings, SystemClock())


async def acquire(backend: Backend) -> Grant:
    grant = await backend.lease("jobs").try_acquire()
    assert grant.held, grant
    return grant


async def crash(server: PgServer) -> None:
    await asyncio.to_thread(server.stop, "immediate")
    await asyncio.to_thread(server.start)


async def test_advisory_tokens_do_not_repeat_after_a_crash_with_async_commit(
        async_commit_server: PgServer) -> None:
    """The token's counter is a transaction id committed after the grant. With the
    role's synchronous_commit = off that commit stayed in the WAL buffers; a crash lost it,
    the transaction id was handed out again, and the next holder got the same token."""
    first = backend_for("postgres", async_commit_server.dsn, "pod-a")
    try:
        token = (await acquire(first)).fencing_token
    finally:
        await crash(async_commit_server)
        await first.close()
    second = backend_for("postgres", async_commit_server.dsn, "pod-b")
    try:
        again = (await acquire(second)).fencing_token
        assert token is not None and again is not None
        assert again > token, "the fencing token repeated after the crash"
    finally:
        await second.close()


async def test_a_row_takeover_survives_a_crash_with_async_commit(
        async_commit_server: PgServer) -> None:
    """A row lease's acquire committed asynchronously: a crash lost the row, and a second
    contender took the lease at once beside the holder (with the same version)."""
    first = backend_for("postgres-row", async_commit_server.dsn, "pod-a")
    try:
        await acquire(first)
    finally:
        await crash(async_commit_server)
        await first.close()
    second = backend_for("postgres-row", async_commit_server.dsn, "pod-b")
    try:
        grant = await second.lease("jobs").try_acquire()
        assert not grant.held and grant.holder == "pod-a", grant
    finally:
        await second.close()


@pytest.fixture
def sync_standby() -> Iterator[tuple[PgServer, PgStandby]]:
    """A primary whose commits wait for its one streaming standby."""
    primary = PgServer().init()
    standby = None
    try:
        standby = PgStandby(primary).init()
        primary.psql("alter system set synchronous_standby_names = '*'")
        primary.psql("select pg_reload_conf()")
        yield primary, standby
    finally:
        if standby is not None:
            standby.destroy()
        primary.destroy()


async def test_a_row_renew_that_committed_during_a_standby_stall_keeps_the_term(
        sync_standby: tuple[PgServer, PgStandby]) -> None:
    """The synchronous standby stalls; the holder's renew commits on the primary and waits
    for it; the driver times out and gives up. The renew did change the row: the holder's
    next renew, asking for the version it last knew, was refused, and the term ended with
    the row blocking everyone for a whole lease."""
    primary, standby = sync_standby
    backend = backend_for("postgres-row", primary.dsn, "pod-a")
    lease = backend.lease("jobs")
    try:
        grant = await lease.try_acquire()
        assert grant.held, grant
        token = grant.fencing_token
        await asyncio.to_thread(standby.stop_receiving)
        with pytest.raises(BackendError):  # timed out waiting for the standby
            await lease.try_renew()
        await asyncio.to_thread(standby.resume_receiving)
        renewed = await lease.try_renew()
        assert renewed.held, renewed
        assert renewed.fencing_token == token  # the same term
    finally:
        await asyncio.to_thread(standby.resume_receiving)
        await backend.close()


@pytest.fixture
def primary() -> Iterator[PgServer]:
    yield from serve(PgServer(), "postgres test bed: a throw-away primary")


def stall_commits(server: PgServer, stalled: bool) -> None:
    """Make every commit that wrote something wait for a synchronous standby that never
    comes (the name of none), as a stalled one does: the commit is done on the primary,
    its reply waits. Unstalled (no synchronous standby), the waiting commits return."""
    names = "nobody" if stalled else ""
    server.psql(f"alter system set synchronous_standby_names = '{names}'")
    server.psql("select pg_reload_conf()")


def test_a_sigterm_during_a_renew_that_waits_for_a_standby_still_hands_over(
        primary: PgServer, tmp_path: Path) -> None:
    """SIGTERM lands while the leader's renew waits for its synchronous standby: the
    renew has committed on the primary (a new version of the row), its reply has not
    come. The runtime cancelled the renew; the commit stood, and the step-down's release,
    which names the version it last knew, matched nothing: the row stayed live, and
    nobody could lead for a whole lease. Now the renew may end first (within a renew
    interval), the release finds its row and records the release."""
    leader = SidecarProcess(tmp_path, "pod-a", [
        "--backend", "postgres-row", "--dsn", primary.dsn, "--name", "jobs",
        "--ensure-schema", "true", "--lease-duration", "20s", "--renew-interval", "2s",
        "--renew-deadline", "10s"]).start()
    try:
        wait_until(lambda: leader.leader() == 200, timeout=20)
        stall_commits(primary, True)
        wait_until(lambda: primary.psql(
            "select count(*) from pg_stat_activity where wait_event = 'SyncRep'") != "0",
            timeout=10)
        leader.signal(signal.SIGTERM)
        time.sleep(0.5)  # the runtime has stopped the elector, its renew still waits
        stall_commits(primary, False)
        assert leader.proc is not None and leader.proc.wait(20) == 0, leader.logs()
        row = primary.psql(
            "select metadata = 'released:' || version, expires_at <= now() "
            "from lease.leases where lease_name = 'lease-sidecar.jobs'", dbname=TEST_DB)
        assert row == "t|t", f"the lease was not released (recorded|expired: {row}):\n" \
            + leader.logs()
        assert "release failed" not in leader.logs()
    finally:
        stall_commits(primary, False)
        leader.stop()
