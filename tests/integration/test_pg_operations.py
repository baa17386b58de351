"""Operating the PostgreSQL backends on a real server: what the logs say through an outage,
role settings that would end the sidecar's statements or sessions, and a sidecar that
creates its own table (``LEASE_ENSURE_SCHEMA``).

A server of this module's own (not the session's ``pg``): these tests stop it and change
role settings.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.support import SidecarProcess, get_json, wait_until
from testkit.testbed.pgbouncer import PgBouncer
from testkit.testbed.postgres import HOST, TEST_ROLE, PgServer
from tests.testbed.pg_fixtures import serve

BACKENDS = ("postgres", "postgres-row")


@pytest.fixture(scope="module")
def server() -> Iterator[PgServer]:
    yield from serve(PgServer(name="ops"), "postgres test bed: the operations server")


def fresh_role(pg: PgServer, *settings: str, createdb: bool = True) -> str:
    """A new login role (with ``ALTER ROLE … SET`` ``settings``) owning a new database;
    its DSN."""
    name = f"r_{uuid.uuid4().hex[:10]}"
    password = secrets.token_urlsafe(12)
    pg.psql(f"create role {name} login password '{password}'")
    for setting in settings:
        pg.psql(f"alter role {name} set {setting}")
    owner = name if createdb else "postgres"
    pg.psql(f'create database "{name}" owner {owner}')
    return f"postgresql://{name}:{password}@{HOST}:{pg.port}/{name}"


def sidecars(tmp_path: Path, backend: str, dsn: str, count: int,
             *extra: str) -> list[SidecarProcess]:
    args = ["--backend", backend, "--dsn", dsn, "--lease-duration", "3s",
            "--name", f"ops-{uuid.uuid4().hex[:6]}", *extra]
    if backend == "postgres-row":
        args += ["--ensure-schema", "true"]
    procs = [SidecarProcess(tmp_path, f"{backend}-{i}", args).start() for i in range(count)]
    for proc in procs:
        proc.wait_http()
    return procs


def leaders(procs: list[SidecarProcess]) -> list[SidecarProcess]:
    return [proc for proc in procs if proc.leader() == 200]


def log_lines(proc: SidecarProcess) -> list[dict]:
    """Every line the sidecar wrote, each parsed as JSON (a line that is not fails)."""
    parsed = []
    for line in proc.logs().splitlines():
        try:
            parsed.append(json.loads(line))
        except ValueError:
            pytest.fail(f"{proc.identity} wrote a line that is not JSON: {line!r}")
    return parsed


def stop_all(procs: list[SidecarProcess]) -> None:
    for proc in procs:
        proc.stop()


@pytest.mark.parametrize("mode", ["fast", "immediate"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_outage_logs_one_line_down_and_one_back_and_no_traceback(
        server: PgServer, tmp_path: Path, backend: str, mode: str) -> None:
    """The server stopped for 5 s (``fast``: sessions told; ``immediate``: a crash) and
    started again."""
    dsn = fresh_role(server)
    procs = sidecars(tmp_path, backend, dsn, 2)
    try:
        assert wait_until(lambda: len(leaders(procs)) == 1, 15), "no leader before the outage"
        server.stop(mode)
        time.sleep(5.0)
        assert leaders(procs) == [], "a sidecar claimed leadership with the server down"
        server.start()
        assert wait_until(lambda: len(leaders(procs)) == 1, 20), "no leader after the outage"
        # The standby's next try (backed off up to one lease duration) finds it back too.
        assert wait_until(lambda: all(get_json(proc.url + "/readyz")[0] == 200
                                      for proc in procs), 10), "a sidecar still unready"
    finally:
        if server.pid is None:
            server.start()
        stop_all(procs)
    for proc in procs:
        text = proc.logs()
        assert "Traceback" not in text, f"{proc.identity} logged a traceback:\n{text}"
        lines = log_lines(proc)
        down = [line for line in lines if line["msg"] == "backend unreachable"]
        back = [line for line in lines if line["msg"] == "backend reachable again"]
        assert len(down) == 1, f"{proc.identity}: {len(down)} 'unreachable' lines:\n{text}"
        assert len(back) == 1, f"{proc.identity}: {len(back)} 'reachable again' lines:\n{text}"
        # The cause is named: the connection failed (refused, or ended by the shutdown).
        assert down[0]["error"], down[0]
        # ... and the line saying it is back names it again, with how long it lasted.
        assert back[0]["cause"] == down[0]["error"], back[0]
        assert back[0]["unreachable_for_s"] >= 4.0, back[0]
        assert not [line for line in lines if line["logger"].startswith("asyncpg")], text


def new_sessions(pg: PgServer, dsn: str) -> int:
    """Sessions ever established to the DSN's database (pg_stat_database, PostgreSQL 14+)."""
    database = dsn.rsplit("/", 1)[1]
    pg.psql("select pg_stat_clear_snapshot()")
    return int(pg.psql(f"select sessions from pg_stat_database where datname = '{database}'"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_role_timeouts_are_overridden_and_named_without_a_reconnect_storm(
        server: PgServer, tmp_path: Path, backend: str) -> None:
    """``statement_timeout = 50ms`` and ``idle_session_timeout = 1s`` on the role: three
    idle sidecars open at most 5 new sessions a minute (the issue saw ~1,400), and each
    setting is named in the log. Measured over 30 s, after the sidecars settled."""
    dsn = fresh_role(server, "statement_timeout = '50ms'", "idle_session_timeout = '1s'")
    procs = sidecars(tmp_path, backend, dsn, 3)
    try:
        assert wait_until(lambda: len(leaders(procs)) == 1, 15), "no leader"
        time.sleep(3.0)  # standbys' LISTEN connections and waits set up
        before = new_sessions(server, dsn)
        window = 30.0
        time.sleep(window)
        opened = new_sessions(server, dsn) - before
        assert len(leaders(procs)) == 1
    finally:
        stop_all(procs)
    print(f"{backend}: {opened} new sessions in {window:.0f} s for three idle sidecars")
    assert opened <= 5 * window / 60, f"{opened} new sessions in {window:.0f} s"
    for proc in procs:
        assert "Traceback" not in proc.logs()
        named = {line.get("setting") for line in log_lines(proc)}
        assert {"statement_timeout", "idle_session_timeout"} <= named, proc.logs()
        # Overridden: nothing went wrong, so nothing says the backend was unreachable.
        assert "backend unreachable" not in proc.logs(), proc.logs()


def test_ensure_schema_creates_the_table_at_start(server: PgServer, tmp_path: Path) -> None:
    """Three sidecars on a fresh database, started together, provision it once between
    them (idempotent, no error) and one leads."""
    dsn = fresh_role(server)
    procs = sidecars(tmp_path, "postgres-row", dsn, 3)
    try:
        assert wait_until(lambda: len(leaders(procs)) == 1, 15), "no leader"
    finally:
        stop_all(procs)
    for proc in procs:
        text = proc.logs()
        assert "backend unreachable" not in text, text
        assert "lease table ready" in text, text
    # Released on stop: the row stays, expired, with the release record.
    assert server.psql("select count(*) from lease.leases where expires_at > now() "
                       "or metadata is distinct from 'released:' || version",
                       dbname=dsn.rsplit("/", 1)[1]) == "0"


def test_ensure_schema_without_the_right_to_create_says_so_and_stays_standby(
        server: PgServer, tmp_path: Path) -> None:
    """A role that may not create the schema: one line naming both causes, "not leader",
    no crash loop; once an administrator grants the right, it creates the table and leads
    without a restart."""
    dsn = fresh_role(server, createdb=False)
    database = dsn.rsplit("/", 1)[1]
    role = database
    server.psql(f"revoke create on database \"{database}\" from public", dbname=database)
    server.psql("revoke create on schema public from public", dbname=database)
    procs = sidecars(tmp_path, "postgres-row", dsn, 1)
    try:
        time.sleep(4.0)
        assert procs[0].proc is not None and procs[0].proc.poll() is None, "it exited"
        assert leaders(procs) == []
        lines = [line for line in log_lines(procs[0]) if line["msg"] == "backend unreachable"]
        assert len(lines) == 1, procs[0].logs()
        assert "does not exist" in lines[0]["error"], lines[0]
        assert "LEASE_ENSURE_SCHEMA could not create it" in lines[0]["error"], lines[0]
        assert "permission denied" in lines[0]["error"], lines[0]
        server.psql(f'grant create on database "{database}" to {role}')
        assert wait_until(lambda: len(leaders(procs)) == 1, 15), procs[0].logs()
    finally:
        stop_all(procs)
    assert "Traceback" not in procs[0].logs()


def test_through_a_transaction_pooler_the_setting_is_named_with_its_fix(
        server: PgServer, tmp_path: Path) -> None:
    """Behind PgBouncer (pool_mode=transaction) the row lease may not set session settings
    (the server sessions are shared): it names the role's setting once, as a warning with
    the statement that removes it, and leads as before."""
    database = f"t_{uuid.uuid4().hex[:12]}"
    server.create_database(database)
    server.psql(f"alter role {TEST_ROLE} in database {database} set statement_timeout = '5s'")
    with PgBouncer(server, pool_mode="transaction", pool_size=2) as bouncer:
        procs = sidecars(tmp_path, "postgres-row", bouncer.dsn_for(database), 1)
        try:
            assert wait_until(lambda: len(leaders(procs)) == 1, 15), procs[0].logs()
        finally:
            stop_all(procs)
    named = [line for line in log_lines(procs[0]) if line.get("setting") == "statement_timeout"]
    assert len(named) == 1, procs[0].logs()
    assert named[0]["level"] == "warning" and named[0]["value"] == "5000ms", named[0]
    assert (f"ALTER ROLE {TEST_ROLE} IN DATABASE {database} RESET statement_timeout"
            in named[0]["msg"]), named[0]
