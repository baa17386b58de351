"""pytest fixtures for the real PostgreSQL test bed (see :mod:`testkit.testbed.postgres`).

Registered in tests/conftest.py (``pytest_plugins``). Fixtures:

* ``pg`` (session): one primary for the whole run.
* ``pg_standby`` (session): a streaming hot standby of ``pg``.
* ``pg_database`` / ``pg_dsn`` (function): a fresh database per test, owned by the
  password-protected role ``lease``, so tests never see each other's leases or locks.
* ``pg_standby_dsn`` (function): the same database on the standby, once replayed there.

If PostgreSQL cannot be installed or started, the fixtures FAIL instead of skipping: a
silently skipped suite would let CI go green without ever touching a real server.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from testkit.testbed.postgres import PgError, PgServer, PgStandby, start_standby


@pytest.fixture(scope="session")
def pg() -> Iterator[PgServer]:
    try:
        server = PgServer()
    except PgError as exc:
        pytest.fail(f"postgres test bed: cannot install PostgreSQL (run "
                    f"scripts/ensure-postgres as root):\n{exc}", pytrace=False)
    yield from serve(server, "postgres test bed: primary")


def serve(server: PgServer, what: str) -> Iterator[PgServer]:
    """Start ``server`` for a fixture (``yield from serve(...)``) and destroy it after; a
    failed start fails the test, naming ``what``, instead of skipping it."""
    try:
        server.init()
    except PgError as exc:
        server.destroy()
        pytest.fail(f"{what} did not start:\n{exc}", pytrace=False)
    try:
        yield server
    finally:
        server.destroy()


@pytest.fixture(scope="session")
def pg_standby(pg: PgServer) -> Iterator[PgStandby]:
    try:
        standby = start_standby(pg)
    except PgError as exc:
        pytest.fail(f"postgres test bed: standby did not start:\n{exc}", pytrace=False)
    try:
        yield standby
    finally:
        standby.destroy()


@pytest.fixture
def pg_database(pg: PgServer) -> str:
    """Name of a fresh database for this test (not dropped: the cluster is thrown away)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        pg.create_database(name)
    except PgError as exc:
        pytest.fail(f"postgres test bed: cannot create a database:\n{exc}", pytrace=False)
    return name


@pytest.fixture
def pg_dsn(pg: PgServer, pg_database: str) -> str:
    """postgresql:// URL (role ``lease`` with its password) of this test's database."""
    return pg.dsn_for(pg_database)


@pytest.fixture
def pg_standby_dsn(pg_standby: PgStandby, pg_database: str) -> str:
    """This test's database on the standby, after the standby has replayed its creation."""
    pg_standby.wait_replayed()
    return pg_standby.dsn_for(pg_database)
