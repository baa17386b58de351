"""A model of SQL Server's lease table, reached through a fake ``pyodbc``: the seam the
``sqlserver`` backend talks through (:mod:`sidecar.lease.sql.pyodbc_driver`). No SQL
Server runs here; this model is the only SQL Server the sidecar's code is run against
under faults (its statements' text is checked by tests/unit/test_tsql.py).

What it keeps: the rows of ``[lease].[Leases]`` with ``SYSDATETIMEOFFSET()`` from the
server's clock, a database-wide ``ROWVERSION`` that grows with every insert and update
(8 bytes, big-endian), each batch atomic, and the worker thread's view of a call: it
blocks until the answer comes, or until the query timeout when the network lost it — the
statement has run on the server all the same when only the reply was lost. Restarts keep
every commit (SQL Server's commits are durable). It leaves out availability groups (their
token across a failover: docs/sqlserver-failover.md) and locking beyond "one batch at a
time".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pyodbc

from sidecar.base.errors import BackendError
from sidecar.lease.sql.dialect import TsqlDialect
from testkit.sim.world import Blocked, Endpoint, Host, World


@dataclass
class MsRow:
    owner: str
    expires_at: float  # server wall seconds
    version: int


class SqlServer:
    def __init__(self, world: World) -> None:
        self.world = world
        self.host = Host("sqlserver-host", offset=world.rng.uniform(-2.0, 2.0))
        self.rows: dict[str, MsRow] = {}
        self.dbts = world.rng.randrange(2000, 100_000)  # @@DBTS: the last ROWVERSION
        self.up = True
        dialect = TsqlDialect()
        self._handlers: dict[str, Callable[[tuple[Any, ...]], list[tuple[Any, ...]]]] = {
            dialect.acquire.qmark()[0]: self._acquire,
            dialect.renew.qmark()[0]: self._renew,
            dialect.release.qmark()[0]: self._release,
            dialect.read.qmark()[0]: self._read(live_only=True),
            dialect.read_replica.qmark()[0]: self._read(live_only=False),
        }
        self._names = {text: names for text, names in (
            s.qmark() for s in (dialect.acquire, dialect.renew, dialect.release,
                                dialect.read, dialect.read_replica))}

    def now(self) -> float:
        return self.host.wall(self.world.now())

    def _stamp(self, wall: float) -> datetime:
        return datetime.fromtimestamp(wall, UTC)

    def _next_version(self) -> int:
        self.dbts += 1
        return self.dbts

    def execute(self, sql: str, values: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        handler = self._handlers.get(sql)
        if handler is None:
            raise AssertionError(f"the SQL Server model does not know this batch: "
                                 f"{' '.join(sql.split())[:160]}")
        named: dict[str, Any] = {}
        for name, value in zip(self._names[sql], values, strict=True):
            named.setdefault(name, value)
        return handler(tuple(named[n] for n in dict.fromkeys(self._names[sql])))

    # -- the batches of TsqlDialect --------------------------------------------------------
    def _acquire(self, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        name, owner, duration_ms = args[0], args[1], args[2]
        now = self.now()
        for key in [k for k, row in self.rows.items() if row.expires_at <= now]:
            del self.rows[key]  # the sweep (READPAST: no other batch runs meanwhile)
        row = self.rows.get(name)
        if row is None:
            row = self.rows[name] = MsRow(owner, now + duration_ms / 1000,
                                         self._next_version())
            return [(*self._out(row), True)]
        return [(*self._out(row), False)]

    def _renew(self, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        duration_ms, name, owner = args[0], args[1], args[2]
        row = self.rows.get(name)
        now = self.now()
        if row is None or row.owner != owner or row.expires_at <= now:
            return []
        row.expires_at = now + duration_ms / 1000
        row.version = self._next_version()
        return [self._out(row)]

    def _release(self, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        name, owner = args[0], args[1]
        row = self.rows.get(name)
        if row is None or row.owner != owner:
            return []
        if len(args) > 2 and int(args[2]) != row.version:
            return []  # the statement names our term's RowVersion: not this row
        del self.rows[name]
        return []

    def _read(self, live_only: bool) -> Callable[[tuple[Any, ...]], list[tuple[Any, ...]]]:
        def read(args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
            row = self.rows.get(args[0])
            if row is None or (live_only and row.expires_at <= self.now()):
                return []
            return [self._out(row)]
        return read

    def _out(self, row: MsRow) -> tuple[Any, ...]:
        return (row.owner, self._stamp(row.expires_at), row.version.to_bytes(8, "big"))

    # -- what the world tells the server -------------------------------------------------
    def client_gone(self, endpoint: Endpoint) -> None:
        pass  # a connection per call: nothing of the client's lives on

    def cut(self, endpoint: Endpoint) -> None:
        pass


class FakeCursor:
    def __init__(self, conn: FakeConnection) -> None:
        self._conn = conn
        self.description: list[Any] | None = None
        self._rows: list[tuple[Any, ...]] = []

    def execute(self, sql: str, values: tuple[Any, ...]) -> None:
        self._rows = self._conn.run(sql, values)
        self.description = [("col",)] if self._rows or "SELECT" in sql.upper() else None

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._rows

    def cancel(self) -> None:
        pass


class FakeConnection:
    def __init__(self, server: SqlServer, endpoint: Endpoint | None, login_timeout: float) -> None:
        self._server = server
        self._endpoint = endpoint
        self.timeout = 0

    def add_output_converter(self, sqltype: int, func: Any) -> None:
        pass

    def cursor(self) -> FakeCursor:
        return FakeCursor(self)

    def close(self) -> None:
        pass

    def run(self, sql: str, values: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """One batch in the worker thread: sent, run at the server, answered — or, where
        the network lost the request or the reply, the thread waits out its query
        timeout (the batch ran all the same when only the reply was lost)."""
        world, endpoint = self._server.world, self._endpoint
        timeout = float(self.timeout or 30)
        lost = BackendError(f"sqlserver sim: query timed out after {timeout:g}s")
        if endpoint is not None and endpoint.partitioned:
            raise Blocked(lost, timeout)
        if not self._server.up:
            raise pyodbc.OperationalError("08001", "[08001] TCP Provider: connection refused")
        rows = self._server.execute(sql, values)
        if endpoint is not None and endpoint.lose_replies and \
                world.rng.random() < endpoint.lose_replies:
            world.trace(f"reply to {endpoint.name} lost")
            raise Blocked(lost, timeout)
        return rows


def fake_pyodbc(server: SqlServer, endpoint_of: Callable[[], Endpoint | None]) -> Any:
    """Stands in for the ``pyodbc`` module inside the driver: ``connect`` reaches the
    model; errors and the rest are the real module's."""

    def connect(conn_str: str, autocommit: bool = True, timeout: float = 0) -> FakeConnection:
        if not server.up:
            raise pyodbc.OperationalError("08001", "[08001] TCP Provider: connection refused")
        return FakeConnection(server, endpoint_of(), timeout)

    return SimpleNamespace(connect=connect, Error=pyodbc.Error, drivers=lambda: ["FreeTDS"],
                           pooling=True, OperationalError=pyodbc.OperationalError)


class _NoTimer:
    """The driver's watchdog thread: the model answers within the query timeout or
    ``Blocked`` says how long the thread waited, so no thread is needed."""

    def __init__(self, interval: float, function: Callable[[], None]) -> None:
        pass

    def start(self) -> None:
        pass

    def cancel(self) -> None:
        pass


def fake_threading() -> Any:
    import threading

    return SimpleNamespace(Timer=_NoTimer, Event=threading.Event)
