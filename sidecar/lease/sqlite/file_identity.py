"""The database file itself can go: deleted, or replaced by a rename or a restored copy.

A process holding it open would keep renewing on the vanished inode while a newcomer
leads on a new file at the same path. So before every statement the store asks
:meth:`FileGuard.check` to compare the open file's identity (device, inode, taken when it
was opened) with what the path names now; on a difference the store closes the old
file, one warning is logged, and the holder steps down at once (:class:`Replaced`).
Two more rules keep that safe:

- *Hold-off.* A database that replaced another at the path accepts no acquisition for
  one lease duration from when the replacement was noticed (:class:`HeldOff`): by then
  every holder on the old file has stepped down (each renew checks the identity) and its
  claims have run out.
- *Tokens never go back for a path.* ``{path}-fence``, a small JSON file beside the
  database, records the identity of the database file in use, the highest token handed
  out (written before the new holder's first claim) and the hold-off deadline. A new or
  replaced database starts its counter above that token, and above the wall clock in
  microseconds when there is no fence to go by (a brand-new database, or the fence is
  gone too) — an SQLite file cannot commit a million acquisitions a second, so a counter
  seeded from an earlier wall-clock reading never gets there. The fence is updated under
  ``flock``, which also serialises the creation of a new database file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

from sidecar.base.errors import BackendError
from sidecar.lease.rowlease import Refused

log = logging.getLogger("sidecar.lease.sqlite")

Identity = tuple[int, int]


class Replaced(Refused):
    """The file at the path is not the database file we had open (deleted or replaced)."""


class HeldOff(Refused):
    """The database replaced another; no acquisition before ``until`` (wall clock)."""

    def __init__(self, path: str, until: float) -> None:
        super().__init__(f"sqlite {path}: the database file replaced another one; no "
                         f"acquisition before {datetime.fromtimestamp(until, tz=UTC):%H:%M:%S}Z")
        self.until = until


def file_identity(path: str) -> Identity | None:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def wall_clock_us() -> int:
    return time.time_ns() // 1000


@dataclass
class FenceRecord:
    identity: Identity | None  # the database file tokens were last handed out from
    token: int  # the highest token handed out at this path
    not_before: float  # wall clock: no acquisition before (after a replacement)


class Fence:
    """``{path}-fence``: see the module docstring. Every access holds an ``flock``."""

    def __init__(self, db_path: str) -> None:
        self.path = db_path + "-fence"
        self._fd: int | None = None

    def __enter__(self) -> Fence:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._fd is not None
        os.close(self._fd)  # releases the lock
        self._fd = None

    def read(self) -> FenceRecord | None:
        """The record, or None when there is none or it is unreadable (torn write)."""
        assert self._fd is not None
        raw = os.pread(self._fd, 4096, 0)
        try:
            data = json.loads(raw)
            dev, ino = data["dev"], data["ino"]
            return FenceRecord(identity=None if dev is None else (int(dev), int(ino)),
                               token=int(data["token"]), not_before=float(data["not_before"]))
        except (ValueError, KeyError, TypeError):
            return None

    def write(self, record: FenceRecord) -> None:
        assert self._fd is not None
        dev, ino = record.identity or (None, None)
        data = json.dumps({"dev": dev, "ino": ino, "token": record.token,
                           "not_before": record.not_before}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)


class FileGuard:
    """The rules above for one database path, as seen by one process."""

    def __init__(self, path: str, holdoff: float = 0.0) -> None:
        self._path = path
        # How long a database that replaced another takes no acquisitions (the lease
        # duration: the longest an old holder's term can last).
        self._holdoff = holdoff
        self._fence = Fence(path)
        self._identity: Identity | None = None  # of the file the store has open
        self._not_before = 0.0  # wall clock: no acquisition before (hold-off)
        self._replaced_seen = False  # we saw the file change under us (until recorded)
        self._high = 0  # the highest version this process has seen at this path

    def check(self) -> None:
        """Raise :class:`Replaced` when the path no longer names the file we opened."""
        now = file_identity(self._path)
        if now == self._identity:
            return
        self._replaced_seen = True
        log.warning("sqlite database file was deleted or replaced; stepping down "
                    "and reopening", extra={
                        "path": self._path, "inode_was": self._identity[1]
                        if self._identity else None, "inode_now": now[1] if now else None})
        raise Replaced(f"sqlite {self._path}: the database file was deleted or replaced")

    def check_holdoff(self) -> None:
        if time.time() < self._not_before:
            raise HeldOff(self._path, self._not_before)

    def saw(self, version: int) -> None:
        self._high = max(self._high, version)

    def record_token(self, token: int) -> None:
        """Before a new holder's first claim: the fence learns its token."""
        self.saw(token)
        with self._fence as fence:
            record = fence.read() or FenceRecord(identity=self._identity, token=0,
                                                 not_before=0.0)
            if token > record.token:
                record.token = token
                fence.write(record)

    @contextlib.contextmanager
    def opening(self) -> Iterator[Opening]:
        """Open the database inside this, and :meth:`Opening.admit` it: the fence stays
        locked throughout, and this process takes the file on only if that succeeded."""
        with self._fence as fence:
            opening = Opening(self._path, fence, high=self._high,
                              replaced_seen=self._replaced_seen, holdoff=self._holdoff)
            yield opening
        assert opening.admitted is not None, "the database was opened but not admitted"
        self._identity, self._not_before = opening.admitted
        self._replaced_seen = False


class Opening:
    """One (re)opening of the database, under the fence's lock."""

    def __init__(self, path: str, fence: Fence, *, high: int, replaced_seen: bool,
                 holdoff: float) -> None:
        self._path = path
        self._fence = fence
        self._high = high
        self._replaced_seen = replaced_seen
        self._holdoff = holdoff
        self._record = fence.read()
        self._before = file_identity(path)
        # (identity, hold-off deadline) of the file, once admitted.
        self.admitted: tuple[Identity, float] | None = None
        if self._before is None:
            # Journals left by a deleted database would be taken for this one's.
            for suffix in ("-journal", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path + suffix)

    def identity(self) -> Identity:
        """The opened file's identity, once it exists; it must be the one we found."""
        now = file_identity(self._path)
        if now is None or (self._before is not None and now != self._before):
            raise BackendError(f"sqlite {self._path}: the database file changed while "
                               "opening")
        return now

    def token_floor(self, counter: int) -> int:
        """The least next version, given the database's ``counter``."""
        record = self._record
        floor = self._high + 1
        if record is not None:
            floor = max(floor, record.token + 1)
        if counter == 0 or record is None:
            floor = max(floor, wall_clock_us())  # nothing (reliable) to go by
        return floor

    def admit(self, identity: Identity) -> None:
        """Record this file in the fence and start its hold-off if it replaced another."""
        record = self._record
        replaced = self._replaced_seen or (
            record is not None and record.identity not in (None, identity))
        not_before = record.not_before if record and record.identity == identity else 0.0
        if replaced:
            not_before = max(not_before, time.time() + self._holdoff)
            log.warning("sqlite database file is new at this path; no acquisition for "
                        "one lease duration", extra={
                            "path": self._path, "not_before": not_before})
        self._fence.write(FenceRecord(identity=identity, not_before=not_before,
                                      token=max(record.token if record else 0, self._high)))
        self.admitted = (identity, not_before)
