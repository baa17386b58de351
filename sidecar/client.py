"""The application's side of lease-sidecar, for Python programs: standard library only.

Three things, one for each rule of docs/integration.md and docs/fencing.md:

- **Read the claim** from the leader file (``/run/lease/<name>``, ``$LEASE_LEADER_FILE``)
  or ``GET /leader/<name>`` (``$LEASE_LEADER_URL``), long-polling while standby::

      leadership = Leadership.from_env("jobs")
      claim = leadership.wait(timeout=30)          # a Claim; leader or not

- **Act only while the claim holds** (rule 1): ``with leadership.unit() as claim:`` runs
  its block only while ``now < valid_until_ms`` and raises :class:`NotLeader` (saying
  why) otherwise; ``@leadership.only_while_leading`` does the same for a function.
- **Hand the token to the database guard** (rule 2) inside the transaction it protects:
  :func:`fence_psycopg`, :func:`fence_asyncpg` and :func:`fence_pyodbc` call
  ``lease_fence(name, token)`` (``lease-sidecar fence-schema --apply`` creates it) and
  raise :class:`StaleToken` when the database refuses the token; the ``*_transaction``
  helpers do both rules around one transaction.

The drivers are the application's own: nothing here imports them. The async functions
run the blocking reads in a thread (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sidecar import fence

__all__ = ["Claim", "ClaimExpired", "Leadership", "NotLeader", "StaleToken",
           "asyncpg_transaction", "fence_asyncpg", "fence_psycopg", "fence_pyodbc",
           "psycopg_transaction", "pyodbc_transaction"]

DEFAULT_URL = "http://127.0.0.1:8099/leader"
DEFAULT_DIR = "/run/lease"
# The longest single long-poll; the sidecar caps ``wait`` itself too.
LONG_POLL = 30.0
# How often a file-based wait looks again (the sidecar rewrites the file every two
# thirds of a claim horizon, 167 ms by default).
FILE_POLL = 0.05

P = ParamSpec("P")
R = TypeVar("R")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class Claim:
    """One answer of the sidecar: the JSON body of ``/leader`` or the leader file."""

    leader: bool
    lease: str
    fencing_token: int | None = None
    valid_until_ms: int | None = None
    holder: str | None = None
    identity: str | None = None

    @classmethod
    def from_json(cls, body: dict[str, Any], lease: str = "") -> Claim:
        token, until = body.get("fencing_token"), body.get("valid_until_ms")
        return cls(leader=bool(body.get("leader")), lease=str(body.get("lease") or lease),
                   fencing_token=int(token) if token is not None else None,
                   valid_until_ms=int(until) if until is not None else None,
                   holder=body.get("holder"), identity=body.get("identity"))

    def holds(self, at_ms: int | None = None) -> bool:
        """A leader's claim that has not expired at ``at_ms`` (now)."""
        at = now_ms() if at_ms is None else at_ms
        return (self.leader and self.fencing_token is not None
                and self.valid_until_ms is not None and at < self.valid_until_ms)

    def check(self, at_ms: int | None = None) -> Claim:
        """This claim if it holds; :class:`NotLeader` saying why otherwise."""
        at = now_ms() if at_ms is None else at_ms
        if self.holds(at):
            return self
        if not self.leader:
            raise NotLeader(f"lease {self.lease!r}: not the leader"
                            + (f" (held by {self.holder})" if self.holder else ""), self)
        raise ClaimExpired(f"lease {self.lease!r}: the claim expired "
                           f"{at - (self.valid_until_ms or 0)} ms ago "
                           f"(valid_until_ms {self.valid_until_ms}); ask again", self)


class NotLeader(Exception):
    """No valid claim: this process must not start the work. ``claim`` is the answer it
    judged (None when the sidecar could not be asked)."""

    def __init__(self, message: str, claim: Claim | None = None) -> None:
        super().__init__(message)
        self.claim = claim


class ClaimExpired(NotLeader):
    """A leader's claim whose ``valid_until_ms`` has passed (a late answer, a pause)."""


class StaleToken(NotLeader):
    """The database guard refused the token: a newer leader has written. The transaction
    is rolled back (the database aborted it)."""

    def __init__(self, message: str, name: str, token: int, highest: int | None) -> None:
        super().__init__(message)
        self.name, self.token, self.highest = name, token, highest


# -- reading the claim ---------------------------------------------------------------------
class Leadership:
    """Where one lease's claim is read: the leader file, or the HTTP endpoint."""

    def __init__(self, lease: str = "leader", *, file: str | os.PathLike[str] | None = None,
                 url: str | None = None, timeout: float = 2.0) -> None:
        if (file is None) == (url is None):
            raise ValueError("Leadership: give file= or url=, one of them")
        self.lease = lease
        self.file = Path(file) if file is not None else None
        self.url = url
        self.timeout = timeout
        self._etag: str | None = None

    @classmethod
    def from_env(cls, lease: str | None = None) -> Leadership:
        """As the sidecar tells its application: under ``lease-sidecar exec`` and in the
        chart, ``$LEASE_LEADER_FILE`` (preferred: no network) or ``$LEASE_LEADER_URL``;
        otherwise ``/run/lease/<lease>`` when that directory exists, else the default URL.
        ``lease`` defaults to ``$LEASE_NAME``, else the primary lease (``leader``)."""
        name = lease or os.environ.get("LEASE_NAME") or "leader"
        if os.environ.get("LEASE_LEADER_FILE"):
            return cls(name, file=os.environ["LEASE_LEADER_FILE"])
        if os.environ.get("LEASE_LEADER_URL"):
            return cls(name, url=os.environ["LEASE_LEADER_URL"])
        if Path(DEFAULT_DIR).is_dir():
            return cls(name, file=Path(DEFAULT_DIR) / name)
        path = "" if name == "leader" else f"/{name}"
        return cls(name, url=DEFAULT_URL + path)

    def claim(self) -> Claim:
        """The claim now. No file, a ``503`` or no sidecar at all: a not-leader claim."""
        if self.file is not None:
            try:
                return Claim.from_json(json.loads(self.file.read_text()), self.lease)
            except (FileNotFoundError, ValueError):  # absent, or caught mid-rename
                return Claim(leader=False, lease=self.lease)
        return self._get(0.0)

    def wait(self, timeout: float = LONG_POLL) -> Claim:
        """The claim once this process leads, or the last answer after ``timeout``:
        a long-poll with the answer's ETag (HTTP), or a look every 50 ms (file)."""
        deadline = time.monotonic() + timeout
        claim = self.claim()
        while not claim.holds():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self.file is not None:
                time.sleep(min(FILE_POLL, left))
                claim = self.claim()
            elif claim.leader or self._etag is None:
                # A "yes" that came too late to use: ask again at once, not long-poll
                # (the ETag follows leadership, so the poll would sleep through it).
                # No sidecar: retry within a second.
                if self._etag is None:
                    time.sleep(min(1.0, left))
                claim = self._get(0.0)
            else:
                claim = self._get(min(LONG_POLL, left))
        return claim

    def _get(self, wait: float) -> Claim:
        assert self.url is not None
        headers = {"If-None-Match": self._etag} if self._etag and wait > 0 else {}
        request = urllib.request.Request(f"{self.url}?wait={wait:g}", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=wait + self.timeout) as response:
                self._etag = response.headers.get("ETag")
                return Claim.from_json(json.load(response), self.lease)
        except urllib.error.HTTPError as err:  # 503: not the leader, with the same body
            self._etag = err.headers.get("ETag")
            try:
                return Claim.from_json(json.load(err), self.lease)
            except ValueError:
                return Claim(leader=False, lease=self.lease)
        except (OSError, ValueError):  # no sidecar: not the leader either
            self._etag = None
            return Claim(leader=False, lease=self.lease)

    async def aclaim(self) -> Claim:
        return await asyncio.to_thread(self.claim)

    async def await_leader(self, timeout: float = LONG_POLL) -> Claim:
        return await asyncio.to_thread(self.wait, timeout)

    # -- rule 1: act only while the claim holds --------------------------------------------
    @contextlib.contextmanager
    def unit(self) -> Iterator[Claim]:
        """Run the block only while this process holds a valid claim; raise
        :class:`NotLeader` (or :class:`ClaimExpired`) before it otherwise. One unit of
        work per block: ask again for the next one."""
        yield self.claim().check()

    @contextlib.asynccontextmanager
    async def aunit(self) -> AsyncIterator[Claim]:
        yield (await self.aclaim()).check()

    def only_while_leading(self, work: Callable[P, R]) -> Callable[P, R]:
        """Decorator: each call runs only under a valid claim, else :class:`NotLeader`."""

        @functools.wraps(work)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.unit():
                return work(*args, **kwargs)

        return guarded


# -- rule 2: the token to the database guard ------------------------------------------------
_STALE = re.compile(re.escape(fence.STALE_MESSAGE)
                    + r" (?P<token>\d+) for lease '(?P<name>.*)': the highest seen is "
                      r"(?P<highest>\d+)")


def _stale(error: BaseException, name: str, token: int) -> StaleToken | None:
    """The guard's refusal as :class:`StaleToken`; None for any other error.

    psycopg and asyncpg name the SQLSTATE (``sqlstate``); ODBC drivers carry the server's
    message (and SQL Server's error number) in the text.
    """
    text = str(error)
    refused = (getattr(error, "sqlstate", None) == fence.STALE_SQLSTATE
               or (error.args[:1] == (fence.STALE_SQLSTATE,))
               or f"({fence.SQLSERVER_STALE_ERROR})" in text
               or fence.STALE_MESSAGE in text)
    if not refused:
        return None
    found = _STALE.search(text)
    highest = int(found.group("highest")) if found else None
    return StaleToken(f"lease {name!r}: the database refused fencing token {token}"
                      + (f" (a newer leader wrote with {highest})" if highest else ""),
                      name, token, highest)


def _token_of(token: int | Claim, name: str | None) -> tuple[int, str]:
    if isinstance(token, Claim):
        claim = token.check()
        assert claim.fencing_token is not None  # check() passed: a leader's claim
        return claim.fencing_token, name or claim.lease
    if name is None:
        raise ValueError("lease_fence: a bare token needs its lease name (name=)")
    return int(token), name


def fence_psycopg(conn: Any, token: int | Claim, name: str | None = None, *,
                  schema: str = "lease") -> int:
    """``lease_fence(name, token)`` on a psycopg 3 connection, inside its transaction.

    ``token`` is a :class:`Claim` (checked first: rule 1) or a bare token with ``name``.
    Returns the token recorded; raises :class:`StaleToken` when the database refuses it.
    Refuses an autocommit connection outside ``conn.transaction()``: the guard would
    protect nothing.
    """
    value, lease = _token_of(token, name)
    if conn.autocommit and conn.info.transaction_status == 0:  # TransactionStatus.IDLE
        raise ValueError("fence_psycopg: call it inside the transaction it guards "
                         "(with conn.transaction(): ...)")
    try:
        row = conn.execute(fence.call("postgres", schema, "%s"), (lease, value)).fetchone()
    except Exception as exc:
        stale = _stale(exc, lease, value)
        if stale is None:
            raise
        raise stale from exc
    return int(row[0])


async def fence_asyncpg(conn: Any, token: int | Claim, name: str | None = None, *,
                        schema: str = "lease") -> int:
    """:func:`fence_psycopg` for an asyncpg connection (inside ``conn.transaction()``)."""
    value, lease = _token_of(token, name)
    if not conn.is_in_transaction():
        raise ValueError("fence_asyncpg: call it inside the transaction it guards "
                         "(async with conn.transaction(): ...)")
    try:
        return int(await conn.fetchval(fence.call("postgres", schema, "$"), lease, value))
    except Exception as exc:
        stale = _stale(exc, lease, value)
        if stale is None:
            raise
        raise stale from exc


def fence_pyodbc(cursor: Any, token: int | Claim, name: str | None = None, *,
                 schema: str = "lease", dialect: str = "sqlserver") -> int:
    """:func:`fence_psycopg` over ODBC: ``EXEC [lease].[lease_fence]`` on SQL Server
    (``dialect="sqlserver"``), ``SELECT lease.lease_fence(…)`` on PostgreSQL. The
    connection must not be in autocommit mode (``pyodbc.connect(…, autocommit=False)``,
    pyodbc's default). Returns the token passed once the guard accepts it."""
    value, lease = _token_of(token, name)
    if cursor.connection.autocommit:
        raise ValueError("fence_pyodbc: the connection is in autocommit mode; the guard "
                         "must run inside the transaction it guards")
    try:
        cursor.execute(fence.call(dialect, schema, "?"), lease, value)
        if dialect == "postgres":
            cursor.fetchall()
    except Exception as exc:
        stale = _stale(exc, lease, value)
        if stale is None:
            raise
        raise stale from exc
    return value


@contextlib.contextmanager
def psycopg_transaction(conn: Any, leadership: Leadership, name: str | None = None, *,
                        schema: str = "lease") -> Iterator[Claim]:
    """One unit of work in one guarded transaction: the claim checked (rule 1), the
    transaction opened, the token fenced (rule 2); the block's writes commit at its end
    unless it raises or the database refused the token."""
    with leadership.unit() as claim, conn.transaction():
        fence_psycopg(conn, claim, name, schema=schema)
        yield claim


@contextlib.asynccontextmanager
async def asyncpg_transaction(conn: Any, leadership: Leadership, name: str | None = None,
                              *, schema: str = "lease") -> AsyncIterator[Claim]:
    """:func:`psycopg_transaction` for asyncpg."""
    async with leadership.aunit() as claim, conn.transaction():
        await fence_asyncpg(conn, claim, name, schema=schema)
        yield claim


@contextlib.contextmanager
def pyodbc_transaction(conn: Any, leadership: Leadership, name: str | None = None, *,
                       schema: str = "lease",
                       dialect: str = "sqlserver") -> Iterator[tuple[Any, Claim]]:
    """:func:`psycopg_transaction` for a pyodbc connection (autocommit off); yields a
    cursor and the claim; commits at the end of the block, rolls back if it raises."""
    with leadership.unit() as claim:
        cursor = conn.cursor()
        try:
            fence_pyodbc(cursor, claim, name, schema=schema, dialect=dialect)
            yield cursor, claim
        except BaseException:
            conn.rollback()
            raise
        else:
            conn.commit()
        finally:
            cursor.close()
