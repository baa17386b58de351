"""Statements over pyodbc: a connection per call (ODBC pooling), in worker threads.

pyodbc blocks, so every call runs in a small thread pool and the event loop never waits
on the network. Each call opens a connection, runs one batch and closes it; with the
driver manager's pooling on (unixODBC: ``Pooling = Yes`` in odbcinst.ini's ``[ODBC]``
section and ``CPTimeout`` on the driver) "open" takes a pooled connection, so this is
cheap, and a connection broken by a failover is never reused by the next call.

Timeouts: the login timeout goes to the driver (``SQL_ATTR_LOGIN_TIMEOUT``); the query
timeout goes to the driver where it supports ``SQL_ATTR_QUERY_TIMEOUT`` (Microsoft's
driver, FreeTDS) and is also enforced by a watchdog that cancels the statement
(``SQLCancel``), because some drivers (psqlODBC) refuse the attribute. An outer asyncio
deadline bounds the wait even if a driver ignores both.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import struct
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

import pyodbc

from sidecar.base.errors import BackendError, NotFound
from sidecar.base.redact import redact
from sidecar.lease.sql.dialect import Statement

DEFAULT_DRIVER = "FreeTDS"
# SQL_SS_TIMESTAMPOFFSET: pyodbc has no built-in conversion for DATETIMEOFFSET.
SQL_DATETIMEOFFSET = -155

_LOGIN_FAILED = re.compile(r"login failed|password authentication failed|"
                           r"authentication failed|role .* does not exist", re.I)
_NO_DRIVER = re.compile(r"can't open lib|data source name not found|"
                        r"driver.*not (found|installed)", re.I)
_UNREACHABLE = re.compile(r"connection refused|could not connect|timeout expired|"
                          r"tcp provider|network|unreachable|no route|"
                          r"could not translate host|name or service not known|"
                          r"server is not found|communication link", re.I)


def odbc_connection_string(dsn: str, driver: str | None) -> str:
    """Add ``DRIVER={…}`` unless the string names a driver or a configured DSN."""
    keys = {part.split("=", 1)[0].strip().upper() for part in dsn.split(";") if "=" in part}
    if keys & {"DRIVER", "DSN", "FILEDSN"}:
        return dsn
    return f"DRIVER={{{driver or DEFAULT_DRIVER}}};{dsn}"


def _attribute(conn_str: str, *keys: str) -> str | None:
    for part in conn_str.split(";"):
        key, sep, value = part.partition("=")
        if sep and key.strip().upper() in keys:
            return value.strip().strip("{}")
    return None


def _datetimeoffset(raw: bytes) -> datetime:
    year, month, day, hour, minute, second, nanos, tz_hour, tz_minute = struct.unpack(
        "<6hI2h", raw)
    return datetime(year, month, day, hour, minute, second, nanos // 1000,
                    tzinfo=timezone(timedelta(hours=tz_hour, minutes=tz_minute)))


class PyodbcDriver:
    def __init__(self, dsn: str, *, odbc_driver: str | None, login_timeout: float,
                 query_timeout: float, label: str = "sqlserver", workers: int = 4) -> None:
        # Must be set before the first connection of the process to take effect.
        pyodbc.pooling = True
        self._conn_str = odbc_connection_string(dsn, odbc_driver)
        self._label = label
        self._login_timeout = max(1, round(login_timeout))
        self._query_timeout = max(1, round(query_timeout))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="odbc-lease")
        self._password = _attribute(self._conn_str, "PWD", "PASSWORD")

    # -- statements ----------------------------------------------------------------------
    async def fetch(self, statement: Statement,
                    params: Mapping[str, object]) -> list[tuple[Any, ...]]:
        text, names = statement.qmark()
        return await self._run(text, tuple(params[n] for n in names))

    async def script(self, sql: str) -> None:
        await self._run(sql, ())

    async def wait_for_notify(self, channel: str, timeout: float, since: float,
                              payload: str | None = None) -> None:
        # ODBC has no notification channel; the caller's retry interval applies.
        await asyncio.sleep(timeout)

    async def _run(self, sql: str, values: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._call, sql, values)
        # Login, then the query, then a little slack for the watchdog's cancel.
        bound = self._login_timeout + self._query_timeout + 2
        try:
            return await asyncio.wait_for(future, bound)
        except TimeoutError:
            raise BackendError(f"{self._where()}: no answer within {bound}s") from None

    def _call(self, sql: str, values: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        try:
            conn = pyodbc.connect(self._conn_str, autocommit=True,
                                  timeout=self._login_timeout)
        except pyodbc.Error as exc:
            raise self._error(exc, connecting=True) from None
        cancelled = threading.Event()
        try:
            conn.add_output_converter(SQL_DATETIMEOFFSET, _datetimeoffset)
            with contextlib.suppress(pyodbc.Error):
                conn.timeout = self._query_timeout  # refused by some drivers; see above
            cursor = conn.cursor()

            def cancel() -> None:
                cancelled.set()
                with contextlib.suppress(pyodbc.Error):
                    cursor.cancel()

            watchdog = threading.Timer(self._query_timeout, cancel)
            watchdog.start()
            try:
                cursor.execute(sql, values)
                return [tuple(row) for row in cursor.fetchall()] if cursor.description else []
            finally:
                watchdog.cancel()
        except pyodbc.Error as exc:
            if cancelled.is_set() or _sqlstate(exc) in ("HYT00", "HYT01"):
                raise BackendError(
                    f"{self._where()}: query timed out after {self._query_timeout}s") from None
            raise self._error(exc, connecting=False) from None
        finally:
            with contextlib.suppress(pyodbc.Error):
                conn.close()

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- errors --------------------------------------------------------------------------
    def _where(self) -> str:
        server = _attribute(self._conn_str, "SERVER", "HOST", "ADDRESS", "DSN") or "?"
        port = _attribute(self._conn_str, "PORT")
        return f"{self._label} {server}{':' + port if port else ''}"

    def _error(self, exc: pyodbc.Error, connecting: bool) -> BackendError:
        message = self._scrub(_message(exc))
        if connecting and _NO_DRIVER.search(message):
            driver = _attribute(self._conn_str, "DRIVER") or "?"
            installed = ", ".join(pyodbc.drivers()) or "none"
            return BackendError(f"{self._where()}: ODBC driver not installed: {driver} "
                                f"(installed: {installed}; set LEASE_ODBC_DRIVER)")
        if _sqlstate(exc) in ("28000", "28P01") or _LOGIN_FAILED.search(message):
            user = _attribute(self._conn_str, "UID", "USER", "USERNAME") or "?"
            return BackendError(f"{self._where()}: login failed for user {user}")
        if _sqlstate(exc) in ("42S02", "42P01"):  # no such table (SQL Server, PostgreSQL)
            return NotFound(f"{self._where()}: {message}; run `lease-sidecar schema --apply` "
                            "to create the lease table")
        if connecting and (_sqlstate(exc) in ("08001", "08S01", "HYT00")
                           or _UNREACHABLE.search(message)):
            return BackendError(f"{self._where()}: network unreachable ({message})")
        return BackendError(f"{self._where()}: {message}")

    def _scrub(self, text: str) -> str:
        text = redact(text) or ""
        return text.replace(self._password, "***") if self._password else text


def _sqlstate(exc: pyodbc.Error) -> str:
    return str(exc.args[0]) if len(exc.args) > 1 else ""


def _message(exc: pyodbc.Error) -> str:
    """The driver's words on one line, without the ``[vendor][driver]`` prefixes."""
    text = str(exc.args[-1]) if exc.args else str(exc)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\s*\(\d+\)\s*\(SQL\w+\)\s*$", "", text.strip())
    return " ".join(text.split())
