"""``LEASE_ENSURE_SCHEMA`` on ``sqlserver``: provisioning before the first acquire.

SQL Server cannot run here, so its driver is a recording fake (the PostgreSQL side of
the same code runs against a real server in tests/integration/test_pg_operations.py):
these tests pin what the store sends and how it reports a role that may not create the
table.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

import pytest

from sidecar.base.errors import BackendError, NotFound
from sidecar.lease.sql.dialect import Statement, TsqlDialect
from sidecar.lease.sql.store import SqlRowStore

DIALECT = TsqlDialect()
ROW = ("me", datetime(2026, 1, 1, tzinfo=UTC), (7).to_bytes(8, "big"), True)


class FakeDriver:
    """Records scripts and statements; ``script_error`` / ``table`` script the server."""

    def __init__(self, *, script_error: str | None = None, table: bool = True) -> None:
        self.script_error = script_error
        self.table = table
        self.calls: list[str] = []

    async def script(self, sql: str) -> None:
        self.calls.append("script")
        assert sql == DIALECT.provision_script()
        if self.script_error:
            raise BackendError(f"sqlserver db: {self.script_error}")
        self.table = True

    async def fetch(self, statement: Statement, params: Mapping[str, object]) -> list[tuple]:
        self.calls.append("acquire" if statement is DIALECT.acquire else "other")
        if not self.table:
            raise NotFound("sqlserver db: Invalid object name 'lease.Leases'; run "
                           "`lease-sidecar schema --apply` to create the lease table")
        return [ROW]

    async def wait_for_notify(self, channel: str, timeout: float, since: float,
                              payload: str | None = None) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_provisions_once_before_the_first_acquire() -> None:
    driver = FakeDriver(table=False)
    store = SqlRowStore(DIALECT, driver, ensure_schema=True)
    assert (await store.acquire("n", "me", 3.0)).version == 7
    await store.acquire("n", "me", 3.0)
    assert driver.calls == ["script", "acquire", "acquire"]


async def test_without_the_setting_nothing_is_created() -> None:
    driver = FakeDriver(table=False)
    with pytest.raises(NotFound):
        await SqlRowStore(DIALECT, driver).acquire("n", "me", 3.0)
    assert driver.calls == ["acquire"]


async def test_a_role_that_may_not_create_uses_an_existing_table() -> None:
    driver = FakeDriver(script_error="CREATE SCHEMA permission denied", table=True)
    store = SqlRowStore(DIALECT, driver, ensure_schema=True)
    await store.acquire("n", "me", 3.0)
    await store.acquire("n", "me", 3.0)
    assert driver.calls == ["script", "acquire", "acquire"]  # known to exist: no retry


async def test_a_missing_table_it_may_not_create_names_both_causes_and_retries() -> None:
    driver = FakeDriver(script_error="CREATE SCHEMA permission denied", table=False)
    store = SqlRowStore(DIALECT, driver, ensure_schema=True)
    with pytest.raises(NotFound) as caught:
        await store.acquire("n", "me", 3.0)
    assert str(caught.value) == (
        "sqlserver db: Invalid object name 'lease.Leases'; run `lease-sidecar schema "
        "--apply` to create the lease table; LEASE_ENSURE_SCHEMA could not create it: "
        "sqlserver db: CREATE SCHEMA permission denied")
    driver.script_error = None  # an administrator granted the right
    assert (await store.acquire("n", "me", 3.0)).version == 7
    assert driver.calls == ["script", "acquire", "script", "acquire"]
