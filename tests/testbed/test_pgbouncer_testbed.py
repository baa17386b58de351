"""The PgBouncer test bed itself: it routes to any database, pools as asked, stops."""

from __future__ import annotations

import socket

import asyncpg
import pytest

from testkit.testbed.pgbouncer import PgBouncer, version
from testkit.testbed.postgres import HOST, PgServer
from tests.testbed.pgbouncer_fixtures import StartBouncer

pytestmark = pytest.mark.postgres


def test_version_is_debians() -> None:
    assert version().split(".")[0] == "1"


@pytest.mark.parametrize(("mode", "size"), [("transaction", 1), ("session", 5)])
async def test_routes_pools_and_reports_its_mode(pg: PgServer, pg_database: str,
                                                 pgbouncer: StartBouncer, mode: str,
                                                 size: int) -> None:
    bouncer = pgbouncer(mode, size)
    conn = await asyncpg.connect(bouncer.dsn_for(pg_database))
    try:
        assert await conn.fetchval("select current_database()") == pg_database
        # A pooler answers the startup with key data of its own, not the session's pid.
        assert await conn.fetchval("select pg_backend_pid()") != conn.get_server_pid()
    finally:
        await conn.close()
    pools = [p for p in bouncer.admin("show pools") if p["database"] == pg_database]
    assert pools and pools[0]["pool_mode"] == mode
    config = {row["key"]: row["value"] for row in bouncer.admin("show config")}
    assert config["default_pool_size"] == str(size)
    assert pg.password not in bouncer.log_text()


def test_stops_cleanly(pg: PgServer) -> None:
    bouncer = PgBouncer(pg, "transaction", 1).start()
    port, proc = bouncer.port, bouncer.proc
    bouncer.destroy()
    assert proc is not None and proc.poll() is not None
    assert not bouncer.root.exists()
    with pytest.raises(OSError), socket.create_connection((HOST, port), timeout=1):
        pass
