"""Wakes a standby when another process commits to the database file."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from asyncinotify import Inotify

# How often a standby looks for a commit by another process when inotify is missing.
WATCH_INTERVAL = 0.1

Signature = tuple[tuple[int, int, int] | None, ...]


class CommitWatch:
    """Any commit changes the database file (or its ``-wal`` file, while a sidecar of an
    older version still runs it in WAL mode). inotify tells us at once and for free;
    where it is unavailable we ``stat`` the files every ``WATCH_INTERVAL``."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._basename = os.path.basename(path)
        self._seen: Signature | None = None
        # None: not tried yet; False: unavailable or closed.
        self._inotify: Inotify | Literal[False] | None = None

    def seen(self) -> None:
        """The files as they are now are not news (our own commits change them too)."""
        self._seen = self._signature()

    async def wait(self, timeout: float) -> None:
        """Sleep until the files change from what was :meth:`seen`, or ``timeout``. A
        missed change only delays the takeover to the next retry."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        watch = self._watch()
        while (left := deadline - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left if watch else min(left, WATCH_INTERVAL)):
                    if watch:
                        while not str((await watch.get()).name).startswith(self._basename):
                            pass
                    else:
                        await asyncio.sleep(left)
            signature = self._signature()
            if signature != self._seen:
                self._seen = signature
                return

    def _watch(self) -> Inotify | None:
        """An inotify watch on the database's directory, or None (then we poll)."""
        if self._inotify is None:
            try:
                from asyncinotify import Inotify, Mask

                inotify = Inotify()
                inotify.add_watch(os.path.dirname(os.path.abspath(self._path)),
                                  Mask.MODIFY | Mask.CREATE | Mask.MOVED_TO | Mask.DELETE)
                self._inotify = inotify
            except (ImportError, OSError):
                self._inotify = False
        return self._inotify or None

    def _signature(self) -> Signature:
        def one(path: str) -> tuple[int, int, int] | None:
            try:
                st = os.stat(path)
            except OSError:
                return None
            return st.st_ino, st.st_size, st.st_mtime_ns

        return one(self._path), one(self._path + "-wal")

    def close(self) -> None:
        if self._inotify:
            self._inotify.close()
        self._inotify = False
