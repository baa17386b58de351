"""asyncpg errors in words, and the server's version, for both PostgreSQL backends (the
advisory lock and the row lease's asyncpg driver)."""

from __future__ import annotations

import asyncpg

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
