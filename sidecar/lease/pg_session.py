"""A PostgreSQL session as both PostgreSQL backends use it: asyncpg errors in words, the
server's version, and the role, database and server settings that would end the
sidecar's statements or sessions.

A role or database may carry timeouts meant for application queries (``ALTER ROLE app SET
statement_timeout = '50ms'``). Applied to the sidecar they cancel its in-server lock waits
and end its idle sessions (the row lease's pool, its LISTEN connection), and every such
ending is a reconnect: hundreds of new sessions a minute, all leadership-neutral, none of
them telling the user why. All four settings are user-settable, so each sidecar session
sets them itself when it connects (:func:`overrides`), and the first session of a process
names once, in the log, the ones the role, database or server had set (:func:`report`).

Behind a transaction pooler a session setting would land on a server session shared with
other clients (and our next statement may run on another one), so the row lease does not
set them there: the log line then names the setting and the fix, and an error caused by
one names it too (:func:`describe`).
"""

from __future__ import annotations

import logging

import asyncpg

log = logging.getLogger("sidecar.lease.postgres")

# asyncpg's errors for a named prepared statement missing on, or already defined in, the
# server session: what a transaction pooler does to a client's prepared statements (every
# asyncpg process names its statements ``__asyncpg_stmt_1__`` and up).
PREPARED_STATEMENT_ERRORS = (asyncpg.exceptions.InvalidSQLStatementNameError,
                             asyncpg.exceptions.DuplicatePreparedStatementError)


def first_line(text: str) -> str:
    """The first line of ``text`` (a server message can span several), or ``""``."""
    return text.strip().splitlines()[0] if text.strip() else ""


def error_line(exc: BaseException) -> str:
    """One line for ``exc``: its message's first line, else its type's name."""
    return first_line(str(exc)) or type(exc).__name__


def version_num(conn: asyncpg.Connection) -> int:
    """``server_version_num`` of the server behind ``conn`` (major * 10000 + minor)."""
    v = conn.get_server_version()
    return int(v.major) * 10000 + int(v.minor)


# Server setting -> what it does to the sidecar.
TIMEOUTS = {
    "statement_timeout": ("cancels the sidecar's statements (and the advisory lock's "
                          "in-server waits)"),
    "lock_timeout": "cancels the sidecar's statements that wait for a row lock",
    "idle_in_transaction_session_timeout": "ends the sidecar's sessions",
    "idle_session_timeout": "ends the sidecar's idle sessions (and with them its locks)",
}

# Each setting's value as the session started, and where it came from (asked before our
# own SET). Settings the server lacks (idle_session_timeout before PostgreSQL 14) are
# simply absent.
ROLE_VALUES = ("select current_user::text, current_database()::text, name, reset_val, "
               "coalesce(unit, ''), source from pg_settings "
               "where name = any($1::text[]) and reset_val <> '0'")
# Session settings ($1 names, $2 values) in one statement.
SET_SESSION = ("select count(set_config(name, value, false)) "
               "from unnest($1::text[], $2::text[]) s(name, value)")

# (setting, value) pairs already named by this process: once each, not per connection.
_named: set[tuple[str, str]] = set()


def overrides(server_version: int) -> dict[str, str]:
    """The session values that keep every timeout from ending our statements or sessions
    (``0``: off). The client's own timeouts bound every call instead; the advisory lock
    sets its in-server wait's ``lock_timeout`` per statement and its own
    ``idle_session_timeout`` on top of these. ``server_version``: ``server_version_num``."""
    values = dict.fromkeys(TIMEOUTS, "0")
    if server_version < 140000:
        del values["idle_session_timeout"]
    return values


async def apply(conn: asyncpg.Connection, values: dict[str, str]) -> None:
    """Set ``values`` on ``conn``'s session."""
    await conn.fetchval(SET_SESSION, list(values), list(values.values()))


async def report(conn: asyncpg.Connection, *, backend: str, overridden: bool) -> None:
    """Name once each timeout the role, database or server sets for this session; call it
    before :func:`apply`, so the setting's source is still the original one.

    Best effort: the lease statements report real trouble, so a failure here is quiet.
    """
    try:
        rows = await conn.fetch(ROLE_VALUES, list(TIMEOUTS))
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
        return
    for role, database, name, value, unit, source in rows:
        shown = f"{value}{unit}"
        if (name, shown) in _named:
            continue
        _named.add((name, shown))
        fields = {"backend": backend, "setting": name, "value": shown, "source": source}
        where = SOURCES.get(source, "by the server").format(role=role, database=database)
        if overridden:
            log.info(f"{name} = {shown} is set {where} and {TIMEOUTS[name]}; the sidecar's "
                     "own sessions set it to 0", extra=fields)
        else:
            log.warning(f"{name} = {shown} is set {where} and {TIMEOUTS[name]}; through a "
                        "transaction pooler the sidecar cannot override it: "
                        f"{fix(name, source, role, database)}", extra=fields)


# pg_settings.source -> where the value was set (for the log line).
SOURCES = {
    "user": "for role {role}",
    "database": "for database {database}",
    "database user": "for role {role} in database {database}",
    "configuration file": "in the server's configuration",
    "client": "by the connection (PGOPTIONS or the DSN's options)",
}


def fix(name: str, source: str = "user", role: str = "<role>",
        database: str = "<database>") -> str:
    """The statement (or step) that removes the setting for the sidecar."""
    undo = {
        "user": f"ALTER ROLE {role} RESET {name}",
        "database": f"ALTER DATABASE {database} RESET {name}",
        "database user": f"ALTER ROLE {role} IN DATABASE {database} RESET {name}",
        "client": f"remove {name} from the connection's options",
    }.get(source, f"set {name} = 0 for the sidecar's role (ALTER ROLE {role} SET {name} = 0)")
    return f"{undo}, or connect the sidecar directly"


def setting_of(exc: BaseException) -> str | None:
    """The timeout setting that ended a statement or session, if one did."""
    text = str(exc)
    if isinstance(exc, asyncpg.QueryCanceledError) and "statement timeout" in text:
        return "statement_timeout"
    if isinstance(exc, asyncpg.LockNotAvailableError) and "lock timeout" in text:
        return "lock_timeout"
    if isinstance(exc, asyncpg.IdleSessionTimeoutError):
        return "idle_session_timeout"
    if isinstance(exc, asyncpg.IdleInTransactionSessionTimeoutError):
        return "idle_in_transaction_session_timeout"
    return None


def describe(exc: BaseException) -> str | None:
    """One line for an error a timeout setting caused, naming it and the fix; else None."""
    name = setting_of(exc)
    if name is None:
        return None
    return f"the server's {name} ended the sidecar's statement or session: {fix(name)}"
