"""``lease-sidecar status``: who holds which lease, read from the backend, changing nothing.

Which leases: the names given (``--name`` / ``LEASE_NAME``), else every lease under the
key prefix that the backend can list (a ``postgres`` advisory lock id is a hash and
cannot be listed: there, the configured name). A lease "exists" while the backend has
something for it: a row (sqlite, postgres-row, sqlserver; release deletes it), a Lease
object (kubernetes), a session holding or awaiting its lock (postgres). An existing lease
nobody holds (released, expired) is shown with holder ``-``.

Output: a table for people, or with ``--json`` one JSON document for programs
(``{"backend", "key_prefix", "leases": [...], "unknown": [...]}``). Times are written as
``/leader`` writes them (:func:`sidecar.base.clock.rfc3339`: UTC, milliseconds, ``Z``).

With a shard set (``LEASE_SHARDS``), the whole assignment follows: the group's live
members as the backend shows them, and for every shard its holder, the member the
assignment gives it to (:func:`sidecar.shards.assign.assign` over those members: what
each member's sidecar computes) and its token and expiry where the backend stores them.
A shard nobody has held yet is listed with holder ``-``; it is no unknown lease.

Exit codes: 0 every lease asked for exists (held or free); 3 a lease asked for, the
database file or the lease table does not exist (nothing is created); the CLI adds 1 for
an unreachable backend and 2 for bad settings.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any, TextIO

from sidecar.base.clock import rfc3339
from sidecar.base.errors import EXIT_NO_SUCH_LEASE, ConfigError
from sidecar.lease import LeaseInfo, backend_entry
from sidecar.settings import Settings
from sidecar.shards.assign import assign

COLUMNS = ("LEASE", "HOLDER", "FENCING TOKEN", "EXPIRES")
SHARD_COLUMNS = ("SHARD", "HOLDER", "ASSIGNED TO", "FENCING TOKEN", "EXPIRES")


async def report(settings: Settings, as_json: bool, out: TextIO | None = None,
                 err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    store = settings.store
    asked = settings.names if "names" in settings.explicit else None
    list_leases = backend_entry(store.backend).list_leases
    if list_leases is None:
        raise ConfigError(f"LEASE_BACKEND / --backend: {store.backend} cannot list its leases")
    found = await list_leases(settings, asked)
    shards = await shard_report(settings, found) if settings.shards else None
    found = [info for info in found if info.lease not in settings.shards]
    if asked is None:
        leases, unknown = sorted(found, key=lambda info: info.lease), []
    else:
        by_name = {info.lease: info for info in found}
        leases = [by_name[name] for name in asked if name in by_name]
        unknown = [name for name in asked if name not in by_name]
    if as_json:
        out.write(json.dumps(document(settings, leases, unknown, shards)) + "\n")
    elif leases or shards:
        if leases:
            out.write(table(leases))
        if shards:
            out.write(shard_table(shards))
    elif not unknown:
        err.write(f"no leases under key prefix {store.key_prefix!r} "
                  f"(backend {store.backend})\n")
    if unknown:
        err.write(f"lease-sidecar: no such lease: {', '.join(unknown)} "
                  f"(backend {store.backend}, key prefix {store.key_prefix!r})\n")
        return EXIT_NO_SUCH_LEASE
    return 0


def document(settings: Settings, leases: list[LeaseInfo], unknown: list[str],
             shards: dict[str, Any] | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"backend": settings.store.backend,
                             "key_prefix": settings.store.key_prefix,
                             "leases": [row(info) for info in leases], "unknown": unknown}
    if shards is not None:
        found["shards"] = {"members": shards["members"],
                           "assignment": [{**row(info), "assigned_to": assigned}
                                          for info, assigned in shards["rows"]]}
    return found


async def shard_report(settings: Settings, found: list[LeaseInfo]) -> dict[str, Any]:
    """The shard set's members and assignment (see the module doc). ``found``: the
    leases the backend listed (a backend that lists only the names asked is asked for
    the shards)."""
    entry = backend_entry(settings.store.backend)
    by_name = {info.lease: info for info in found}
    missing = tuple(s for s in settings.shards if s not in by_name)
    if missing and entry.list_leases is not None:
        by_name.update((info.lease, info) for info in
                       await entry.list_leases(settings, missing))
    members: list[str] | None = None
    if entry.list_members is not None:
        members = sorted(set(await entry.list_members(settings,
                                                      settings.store.key(settings.name))))
    assignment = assign(settings.shards, members or [])
    rows = [(by_name.get(shard) or LeaseInfo(shard, None), assignment.get(shard))
            for shard in settings.shards]
    return {"members": members, "rows": rows}


def shard_table(shards: dict[str, Any]) -> str:
    members = shards["members"]
    head = ("members: " + (", ".join(_cell(m) for m in members) if members else "none")
            if members is not None else "members: unknown (the backend cannot list them)")
    cells = [SHARD_COLUMNS] + [(info.lease, _cell(info.holder), _cell(assigned),
                                _cell(info.fencing_token), _cell(_time(info.expires_at)))
                               for info, assigned in shards["rows"]]
    widths = [max(len(line[i]) for line in cells) for i in range(len(SHARD_COLUMNS))]
    return head + "\n" + "".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        + "\n" for line in cells)


def row(info: LeaseInfo) -> dict[str, Any]:
    """One lease as JSON: the four common fields, then the backend's own."""
    fields: dict[str, Any] = {"lease": info.lease, "holder": info.holder,
                              "fencing_token": info.fencing_token,
                              "expires_at": _time(info.expires_at)}
    fields.update({key: _time(value) if isinstance(value, datetime) else value
                   for key, value in info.details.items()})
    return fields


def table(leases: list[LeaseInfo]) -> str:
    cells = [COLUMNS] + [(info.lease, _cell(info.holder), _cell(info.fencing_token),
                          _cell(_time(info.expires_at))) for info in leases]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths,
                                                                      strict=True)).rstrip()
                   + "\n" for line in cells)


def _time(value: datetime | None) -> str | None:
    return rfc3339(value.timestamp()) if value is not None else None


def _cell(value: object) -> str:
    if value is None or value == "":
        return "-"
    text = str(value)
    # A holder is whatever a contender wrote: a newline must not break the table.
    return text if text.isprintable() else repr(text)
