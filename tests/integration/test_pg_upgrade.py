"""``pg_upgrade`` of a cluster that failed over, on real servers (issue 29, hole 7).

The upgraded cluster starts at timeline 1 again while its transaction ids and sequences
go on. Fencing tokens carry the timeline in their high bits, so on a cluster that ever
failed over every token after the upgrade was smaller than every token before. The token
era (sidecar.lease.pg_timeline: a one-row table pg_upgrade carries over, created by
``lease-sidecar schema --apply``) keeps them growing. Library-level, both PostgreSQL
backends; the simulator's model covers upgrades under every other fault
(``python -m testkit.sim``)."""

from __future__ import annotations

import asyncio

import pytest

from sidecar import config
from sidecar.base.clock import SystemClock
from sidecar.lease import backend_entry, create_backend
from sidecar.lease.pg_timeline import timeline_of
from sidecar.settings import Settings
from testkit.testbed.postgres import PgServer, PgStandby, pg_upgrade

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

BACKENDS = ("postgres", "postgres-row")


def settings_for(backend: str, dsn: str) -> Settings:
    return config.load(env={"LEASE_BACKEND": backend, "LEASE_DSN": dsn,
                            "LEASE_IDENTITY": "pod-a"})


async def token(backend: str, dsn: str) -> int:
    lease_backend = create_backend(settings_for(backend, dsn), SystemClock())
    lease = lease_backend.lease("jobs")
    try:
        grant = await lease.try_acquire()
        assert grant.held and grant.fencing_token is not None, grant
        await lease.release()
        return grant.fencing_token
    finally:
        await lease_backend.close()


async def test_tokens_keep_growing_across_pg_upgrade_of_a_cluster_that_failed_over() -> None:
    primary = await asyncio.to_thread(lambda: PgServer().init())
    servers: list[PgServer] = [primary]
    try:
        for backend in BACKENDS:  # `lease-sidecar schema --apply`
            apply = backend_entry(backend).apply_schema
            if apply is not None:  # (the advisory lock had nothing to create before)
                await apply(settings_for(backend, primary.dsn))
        standby = await asyncio.to_thread(lambda: PgStandby(primary).init())
        servers.append(standby)
        await asyncio.to_thread(standby.wait_replayed)
        await asyncio.to_thread(primary.stop, "fast")
        await asyncio.to_thread(standby.promote)
        before = {b: await token(b, standby.dsn) for b in BACKENDS}
        assert {timeline_of(t) for t in before.values()} == {2}
        upgraded = await asyncio.to_thread(pg_upgrade, standby)
        servers.append(upgraded)
        assert upgraded.psql("select timeline_id from pg_control_checkpoint()") == "1"
        after = {b: await token(b, upgraded.dsn) for b in BACKENDS}
        for backend in BACKENDS:
            assert after[backend] > before[backend], (backend, before, after)
    finally:
        for server in servers:
            await asyncio.to_thread(server.destroy)
