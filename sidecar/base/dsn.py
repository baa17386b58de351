"""DSN checks that run before anything connects: a DSN that cannot work is exit 2.

Each check raises :class:`DsnError` with one line that never contains a secret: it
names keywords, hosts and file paths, but never quotes the user-info part of a URL, a
port that might be a password fragment, or an attribute the parser could not place.
No driver is imported here (running on SQLite must not import asyncpg or pyodbc); the
rules follow what asyncpg and the ODBC driver manager accept, and tests hold asyncpg's
own parser to the same verdicts.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import urllib.parse
from pathlib import Path


class DsnError(ValueError):
    """One line saying what is wrong with a DSN, without any secret."""


# -- PostgreSQL URLs (asyncpg) ------------------------------------------------------------

SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
# Query parameters asyncpg understands, with their allowed values where they are a set.
_PG_CHOICES: dict[str, tuple[str, ...]] = {
    "sslmode": SSLMODES,
    "target_session_attrs": ("any", "primary", "standby", "prefer-standby", "read-write",
                             "read-only"),
    "ssl_min_protocol_version": ("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"),
    "ssl_max_protocol_version": ("TLSv1", "TLSv1.1", "TLSv1.2", "TLSv1.3"),
    "sslnegotiation": ("postgres", "direct"),
    "gsslib": ("gssapi", "sspi"),
}
_PG_FILES = ("sslcert", "sslkey", "sslrootcert", "sslcrl", "passfile")
_PG_KNOWN = {"host", "port", "dbname", "database", "user", "password", "sslpassword",
             "krbsrvname", "service", *_PG_CHOICES, *_PG_FILES}
# libpq options asyncpg does not implement: it would pass them to the server as run-time
# settings, and the server refuses the connection ("unrecognized configuration
# parameter"), so the sidecar could never connect.
_PG_UNSUPPORTED = ("connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval",
                   "keepalives_count", "hostaddr", "requiressl", "sslcompression", "sslsni",
                   "requirepeer", "channel_binding", "gssencmode", "gssdelegation",
                   "load_balance_hosts", "sslcertmode", "fallback_application_name",
                   "servicefile", "sslkeylogfile", "require_auth",
                   "min_protocol_version", "max_protocol_version")
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")
_WORD = re.compile(r"^[\w.-]{0,40}$")


def _shown(value: str) -> str:
    """A value fit to quote in an error (a keyword-like word), else a placeholder."""
    return repr(value) if _WORD.match(value) else "(a value)"


def check_postgres_url(dsn: str) -> None:
    """Refuse a ``postgresql://`` URL that asyncpg would reject or could never use."""
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", dsn)
    if not match:
        raise DsnError("must be a postgresql:// URL (libpq key=value strings are not "
                       "supported by the asyncpg driver)")
    scheme = match.group(1).lower()
    if scheme not in ("postgresql", "postgres"):
        raise DsnError(f"scheme {_shown(scheme)} is not postgresql:// or postgres://")
    rest = dsn[match.end():]
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    tail = rest[len(authority):]
    path, _, after = tail.partition("?")
    query_text = after.partition("#")[0] if after else ""
    userinfo, at, hostlist = authority.rpartition("@")
    if "@" in userinfo:
        raise DsnError("more than one '@' before the host: percent-encode '@' in the user "
                       "name or password as %40")
    if not at and "@" in tail.partition("#")[0]:
        after_colon = authority.rpartition(":")[2] if ":" in authority else ""
        if "@" in path or (after_colon and not after_colon.isdigit()):
            raise DsnError("a '@' after the host part: percent-encode '/', '?', '#' and '@' "
                           "in the user name, password or database name")
    if re.search(r"[\s\x00-\x1f\x7f]", authority):
        raise DsnError("whitespace or a control character in the user, password or host "
                       "part: percent-encode it (a space is %20)")
    query = _pg_query(query_text)
    if hostlist:
        _check_hostlist(hostlist, from_query=False)
    if "host" in query:
        _check_hostlist(query["host"], from_query=True)
    if "port" in query and hostlist:
        raise DsnError("asyncpg ignores the port parameter when the URL names a host (it "
                       "would use 5432): write postgresql://host:port/db")
    if "port" in query:
        for port in query["port"].split(","):
            _check_port(port, "the port parameter")
    for key, allowed in _PG_CHOICES.items():
        value = query.get(key)
        if value is not None and value not in allowed:
            raise DsnError(f"{key} {_shown(value)} is not one of {', '.join(allowed)}")
    for key in _PG_FILES:
        value = query.get(key)
        if key == "sslrootcert" and value == "system":
            continue
        if value and key != "passfile" and not Path(value).expanduser().is_file():
            raise DsnError(f"{key} names {value!r}, which is not a readable file")
    for key in query:
        if key in _PG_UNSUPPORTED:
            raise DsnError(f"parameter {key!r} is a libpq option the asyncpg driver does not "
                           "support; the server would refuse the connection")
        if key not in _PG_KNOWN:
            close = difflib.get_close_matches(key, [*_PG_KNOWN, *_PG_UNSUPPORTED], 1, 0.8)
            if close or key.startswith("ssl"):
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise DsnError(f"unknown parameter {_shown(key)}{hint}")
            # Anything else is a server setting (application_name, search_path, ...),
            # as asyncpg passes it; the server checks it.


def _pg_query(text: str) -> dict[str, str]:
    if not text:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise DsnError("the query string is malformed (key=value pairs joined by '&')") from None
    return dict(pairs)  # the last value wins, as in asyncpg


def _check_hostlist(hostlist: str, from_query: bool) -> None:
    """Check ``host[:port],…`` as asyncpg splits it."""
    specs = hostlist.split(",")
    for spec in specs:
        if not spec:
            if len(specs) > 1:
                raise DsnError("an empty host in the host list")
            continue
        if spec.startswith("/"):
            continue  # a Unix-socket directory
        if spec.startswith("["):
            m = re.fullmatch(r"\[([^\]]*)\](?::(.*))?", spec)
            if not m:
                raise DsnError(f"bad IPv6 host {spec!r}: write it as [address] or "
                               "[address]:port")
            try:
                ipaddress.IPv6Address(urllib.parse.unquote(m.group(1)))
            except ValueError:
                raise DsnError(f"{m.group(1)!r} in brackets is not an IPv6 address") from None
            if m.group(2):
                _check_port(m.group(2), f"host [{m.group(1)}]")
            continue
        if spec.count(":") > 1 or "]" in spec:
            raise DsnError("an IPv6 address must be in brackets: postgresql://[::1]:5432/db")
        host, _, port = spec.partition(":")
        host = host if from_query else urllib.parse.unquote(host)
        if not host:
            raise DsnError("a port without a host before it")
        if not host.startswith("/"):  # else a percent-encoded Unix-socket directory
            _check_hostname(host)
        if port:  # "host:" is the default port, as in asyncpg
            _check_port(port, f"host {host!r}")


def _check_hostname(host: str) -> None:
    try:
        ipaddress.IPv4Address(host)
        return
    except ValueError:
        pass
    if re.fullmatch(r"[\d.]+", host):
        raise DsnError(f"{host!r} is not a valid IPv4 address")
    try:
        ascii_host = host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        raise DsnError(f"{host!r} is not a valid host name") from None
    labels = ascii_host.rstrip(".").split(".")
    if len(ascii_host) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        raise DsnError(f"{host!r} is not a valid host name")


def _check_port(text: str, where: str) -> None:
    # The value is not quoted: with a raw '/' in a password the "port" is password text.
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise DsnError(f"the port of {where} is not a number from 1 to 65535")


# -- ODBC connection strings (pyodbc) -----------------------------------------------------

_ODBC_SERVER_KEYS = ("SERVER", "SERVERNAME", "ADDRESS", "ADDR", "HOST", "DSN", "FILEDSN")
# Keywords that may be named in an error (never a value, never an unknown key: with an
# unbraced ';' in a password, the "key" the parser sees is password text).
_ODBC_KNOWN = {*_ODBC_SERVER_KEYS, "DRIVER", "PORT", "DATABASE", "UID", "USER", "USERNAME",
               "PWD", "PASSWORD", "TRUSTED_CONNECTION", "ENCRYPT", "TRUSTSERVERCERTIFICATE",
               "APP", "WSID", "LANGUAGE", "AUTHENTICATION", "APPLICATIONINTENT",
               "MULTISUBNETFAILOVER", "SSLMODE", "TDS_VERSION", "CLIENTCHARSET"}


def parse_odbc(text: str) -> dict[str, str]:
    """``KEY=value;KEY={va;lue}}x};…`` → ``{"KEY": "value", …}`` (keys upper-cased)."""
    result: dict[str, str] = {}
    i, n, index = 0, len(text), 0
    while i < n:
        if text[i] in " \t;":
            i += 1
            continue
        index += 1
        eq, semi = text.find("=", i), text.find(";", i)
        if eq < 0 or 0 <= semi < eq:
            raise DsnError(f"attribute {index} has no '=' (ODBC strings are KEY=value;…, and "
                           "a value containing ';' goes in braces: PWD={a;b})")
        key = text[i:eq].strip().upper()
        name = key if key in _ODBC_KNOWN else f"attribute {index}"
        j = eq + 1
        while j < n and text[j] in " \t":
            j += 1
        if j < n and text[j] == "{":
            value, j = _braced(text, j, name)
            while j < n and text[j] in " \t":
                j += 1
            if j < n and text[j] != ";":
                raise DsnError(f"text after the closing '}}' of {name} (write '}}}}' for a "
                               "'}' inside braces)")
        else:
            end = text.find(";", j)
            end = n if end < 0 else end
            value, j = text[j:end].strip(), end
        if not key:
            raise DsnError(f"attribute {index} has no name before '='")
        if key in result:
            raise DsnError(f"{name} is given twice")
        result[key] = value
        i = j
    return result


def _braced(text: str, start: int, name: str) -> tuple[str, int]:
    out, i = [], start + 1
    while i < len(text):
        if text[i] == "}":
            if text[i + 1:i + 2] == "}":
                out.append("}")
                i += 2
                continue
            return "".join(out), i + 1
        out.append(text[i])
        i += 1
    raise DsnError(f"the value of {name} opens '{{' but never closes it (write '}}}}' "
                   "for a '}' inside braces)")


def check_odbc(dsn: str) -> None:
    """Refuse an ODBC connection string the driver manager could not parse or use."""
    if re.match(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://", dsn):
        raise DsnError("a URL is not an ODBC connection string; the sqlserver backend takes "
                       "DRIVER={…};SERVER=host,1433;DATABASE=…;UID=…;PWD=…")
    attributes = parse_odbc(dsn)
    if not attributes:
        raise DsnError("is empty; the sqlserver backend takes "
                       "DRIVER={…};SERVER=host,1433;DATABASE=…;UID=…;PWD=…")
    servers = [key for key in _ODBC_SERVER_KEYS if attributes.get(key)]
    if not servers:
        raise DsnError("names no SERVER= (or DSN=)")
    if "PORT" in attributes:
        _check_port(attributes["PORT"], "PORT=")
    server = attributes.get("SERVER", "")
    if "," in server:  # SQL Server's host,port form
        _check_port(server.rpartition(",")[2].strip(), "SERVER=")


# -- SQLite files ---------------------------------------------------------------------------

def sqlite_file(dsn: str) -> str:
    """``/path``, ``sqlite:///relative`` or ``sqlite:////absolute`` → a file path."""
    if dsn.startswith("sqlite:///"):
        return dsn[len("sqlite:///"):]
    return dsn


def check_sqlite(dsn: str) -> None:
    """Refuse a SQLite DSN that is not one file shared by every contender on this host."""
    lowered = dsn.lower()
    path = sqlite_file(dsn)
    if not path:
        raise DsnError("names no file (sqlite:/// needs a path after it)")
    if path == ":memory:" or lowered.startswith("file::memory:") or "mode=memory" in lowered:
        raise DsnError(f"{dsn!r} is an in-memory database: every sidecar would lead alone; "
                       "give a file path")
    if lowered.startswith("file:"):
        raise DsnError(f"{dsn!r}: file: URIs are not supported; give a plain path, "
                       "sqlite:////absolute/path or sqlite:///relative/path")
    if "://" in dsn and not dsn.startswith("sqlite:///"):
        scheme = dsn.split("://", 1)[0]
        hint = (" (sqlite:// needs a third slash: sqlite:///relative or sqlite:////absolute)"
                if scheme.lower() == "sqlite" else
                "; set LEASE_BACKEND for a server" if scheme.lower().startswith("postgres")
                else "")
        raise DsnError(f"a {_shown(scheme)} URL is not a SQLite file path{hint}")
    if dsn.startswith("sqlite:///") and "?" in path:
        raise DsnError(f"{dsn!r}: query parameters are not supported after sqlite:///")
    if "\x00" in path:
        raise DsnError("contains a NUL character")
    if path.endswith("/"):
        raise DsnError(f"{path!r} ends with '/': give the database file, e.g. "
                       f"{path}leases.sqlite3")
    target = Path(path)
    if target.is_dir():
        raise DsnError(f"{path!r} is a directory: give the database file inside it, e.g. "
                       f"{path.rstrip('/')}/leases.sqlite3")
    if target.exists() and not target.is_file():
        raise DsnError(f"{path!r} exists and is not a regular file")
    ancestor = target.absolute().parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise DsnError(f"{str(ancestor)!r} (on the way to {path!r}) is not a directory")
