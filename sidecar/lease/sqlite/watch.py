"""Wakes a standby when another process commits to the database file."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncinotify import Event, Inotify

# How often a standby looks for a commit by another process when inotify is missing.
WATCH_INTERVAL = 0.1

Signature = tuple[tuple[int, int, int] | None, ...]


class CommitWatch:
    """Sleeps until another process has committed to the database since our last look.

    Whether one did, ``committed`` answers (the store asks SQLite's ``data_version``,
    which only another connection's commit changes: exact, where comparing the files'
    size and mtime missed a commit in the same clock tick as ours, or one that landed
    between our own commit and the look). It is asked as the wait begins, then whenever
    inotify shows a commit end: the rollback journal deleted (or, while a sidecar of an
    older version still runs the file in WAL mode, the ``-wal`` file written), or the
    file itself created, moved or deleted. The watch lives for one wait: events while
    nobody waits (a holder's own commits) are not kept for the next. Where inotify is
    unavailable we ``stat`` the files every ``WATCH_INTERVAL`` and ask when they changed.

    Many waits run at once on one store (a shard group's standbys, dozens per member):
    each closes its own inotify instance when it ends (only the latest one used to be
    closed; the others leaked until the user's instance limit, 128 by default, was
    spent), one that cannot get an instance (the limit reached) polls for that wait only,
    and each poll compares the files with what *that* wait saw last (a signature shared
    by all the waits let one waiter's look hide a commit from the others, which then
    slept out their retry interval: the second-long tail of a burst of shard moves).
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._basename = os.path.basename(path)
        # False once inotify proved unavailable, or the watch was closed for good.
        self._inotify_usable = True
        self._open_watches: set[Inotify] = set()  # of the waits running now

    async def wait(self, timeout: float, committed: Callable[[], Awaitable[bool]]) -> None:
        """Return when ``committed()`` says yes, or after ``timeout``. A missed commit
        only delays the takeover to the next retry."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        watch = self._open()
        polled: Signature | None = None  # the files as this wait last looked
        try:
            if await committed():
                return
            while (left := deadline - loop.time()) > 0:
                if watch is not None:
                    try:
                        async with asyncio.timeout(left):
                            while not self._ends_a_commit(await watch.get()):
                                pass
                    except TimeoutError:
                        return
                else:
                    await asyncio.sleep(min(left, WATCH_INTERVAL))
                    if polled == (signature := self._signature()):
                        continue
                    polled = signature
                if await committed():
                    return
        finally:
            if watch is not None:
                self._open_watches.discard(watch)
                watch.close()

    def _ends_a_commit(self, event: Event) -> bool:
        from asyncinotify import Mask

        name = str(event.name)
        if name == self._basename:
            return not event.mask & Mask.MODIFY  # created, replaced or deleted
        if name == self._basename + "-journal":
            return bool(event.mask & Mask.DELETE)
        return name == self._basename + "-wal"

    def _open(self) -> Inotify | None:
        """An inotify watch on the database's directory, or None (then this wait polls;
        every later one too where inotify is missing)."""
        if not self._inotify_usable:
            return None
        try:
            from asyncinotify import Inotify, Mask
        except ImportError:
            self._inotify_usable = False
            return None
        try:
            inotify = Inotify()
            try:
                inotify.add_watch(os.path.dirname(os.path.abspath(self._path)),
                                  Mask.MODIFY | Mask.CREATE | Mask.MOVED_TO | Mask.DELETE)
            except BaseException:
                inotify.close()
                raise
        except OSError:
            return None  # no instance to spare now (the user's limit): poll this time
        self._open_watches.add(inotify)
        return inotify

    def _signature(self) -> Signature:
        def one(path: str) -> tuple[int, int, int] | None:
            try:
                st = os.stat(path)
            except OSError:
                return None
            return st.st_ino, st.st_size, st.st_mtime_ns

        return one(self._path), one(self._path + "-wal")

    def close(self) -> None:
        self._inotify_usable = False
        for watch in self._open_watches:
            watch.close()
        self._open_watches.clear()
