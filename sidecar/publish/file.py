"""The leader file: ``{state_dir}/leader`` (first lease) and ``{state_dir}/{name}``.

The file exists exactly while this contender leads; its content is the JSON of
``GET /leader``, including ``valid_until``. It is rewritten every two thirds of a claim
horizon, so a sidecar that dies or freezes stops claiming within one horizon even
though nobody removes its file. Writes are atomic: a temp file in the same directory,
then ``rename``.

Nothing else wakes the publisher: a timer is armed only while a file of ours is on disk
(or a term's first claim is due), so a standby costs nothing here, and the rewrite is a
plain callback of the event loop with a few system calls, since it runs six times a
second for as long as the sidecar leads (issue 20: the leader's idle CPU).

No symlink is ever followed, so nobody who can write to the directory can make us write
into another file: the temp file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a
random name (an existing file or symlink of that name is an error, and we pick another
name), and ``rename`` replaces a ``leader`` symlink itself, never its target. The temp
name is reused while it stays free: the rename frees it, and anything planted there
since only costs one more random name. Files are created with mode 0644 less the umask:
the application usually runs as another user and must read it; the claim is not a
secret. (The directory itself is vetted by :mod:`sidecar.statedir`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from sidecar.base.errors import ConfigError
from sidecar.publish import ClaimEncoder
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.publish.file")


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_ATTEMPTS = 8


def temp_name(path: Path) -> Path:
    """A name nobody can predict, so nobody can plant anything there in advance."""
    return path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"


class AtomicFile:
    """One published file, replaced whole by ``rename`` from a temp file beside it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._target = os.fspath(path)
        self._temp = os.fspath(temp_name(path))

    def write(self, data: bytes, also: Sequence[AtomicFile] = ()) -> None:
        """Replace the file with ``data``, and each of ``also`` with the same file: one
        more name for the temp file (a hard link) each, where the filesystem has them."""
        tmp = self._create(data)
        try:
            for other in also:
                other._take(tmp, data)
            os.replace(tmp, self._target)
        except BaseException:
            _unlink(tmp)
            raise

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._target)

    def _create(self, data: bytes) -> str:
        """A new temp file holding ``data``; its name."""
        for _ in range(_ATTEMPTS):
            tmp = self._temp
            try:
                fd = os.open(tmp, _CREATE, 0o644)
            except FileExistsError:
                # Something already has that name (planted or not): never open it.
                self._temp = os.fspath(temp_name(self.path))
                continue
            try:
                done = os.write(fd, data)
                while done < len(data):
                    done += os.write(fd, data[done:])
            except BaseException:
                os.close(fd)
                _unlink(tmp)
                raise
            os.close(fd)
            return tmp
        raise FileExistsError(f"{self.path.parent}: no free temporary name in {_ATTEMPTS} "
                              "attempts")

    def _take(self, source: str, data: bytes) -> None:
        """Become the temp file ``source`` of another published file (same content)."""
        for _ in range(_ATTEMPTS):
            tmp = self._temp
            try:
                # Never replaces whatever has that name, never follows a symlink.
                os.link(source, tmp, follow_symlinks=False)
            except FileExistsError:
                self._temp = os.fspath(temp_name(self.path))
                continue
            except OSError:  # a filesystem without hard links: a copy of our own
                tmp = self._create(data)
            try:
                os.replace(tmp, self._target)
            except BaseException:
                _unlink(tmp)
                raise
            return
        raise FileExistsError(f"{self.path.parent}: no free temporary name in {_ATTEMPTS} "
                              "attempts")


def write_atomically(path: Path, data: bytes) -> None:
    AtomicFile(path).write(data)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class FilePublisher:
    def __init__(self, states: list[LeaseState], directory: Path) -> None:
        self._states = states
        self._dir = directory
        self._paths = {id(state): self.paths(state) for state in states}
        self._files = {id(state): [AtomicFile(path) for path in self._paths[id(state)]]
                       for state in states}
        self._encoders = {id(state): ClaimEncoder(state) for state in states}
        self._written: set[Path] = set()
        # Two thirds of a horizon: a reader always finds at least a third of a horizon
        # (83 ms by default) left on the file's claim. The rewrite is nearly all of an
        # idle leader's CPU, so this period is the trade between the two: half a horizon
        # cost 0.3 % of a core, two thirds costs a quarter less. No claim rule depends
        # on it: the claim in the file is valid until its own valid_until either way.
        self._period = min(s.claim_horizon for s in states) * 2 / 3 if states else math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._due = math.inf  # loop time the timer fires at
        self._running = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def paths(self, state: LeaseState) -> list[Path]:
        paths = [self._dir / state.lease]
        if state is self._states[0]:
            paths.insert(0, self._dir / "leader")
        return paths

    async def start(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        for state in self._states:  # a previous run's leftovers are not our claims
            for file in self._files[id(state)]:
                self._written.add(file.path)
            try:
                self._publish(state)
            except OSError as exc:
                # A state-dir problem (a directory named ``leader``...) says so, not
                # something else that happens to be started next.
                raise ConfigError(f"LEASE_STATE_DIR / --state-dir: "
                                  f"{exc.filename or self._dir}: {exc.strerror or exc}") from None
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._schedule()

    async def changed(self, state: LeaseState) -> None:
        try:
            self._publish(state)
        finally:
            self._schedule()

    async def stop(self) -> None:
        self._running = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._due = None, math.inf
        for state in self._states:
            self._remove_all(self._files[id(state)])

    def _publish(self, state: LeaseState) -> bool:
        """Write or remove ``state``'s files; True while it leads (they need rewriting)."""
        claim = state.claim()
        if claim.leader:
            # Before the write: a write that fails half-way may have replaced a name.
            self._written.update(self._paths[id(state)])
            first, *others = self._files[id(state)]
            first.write(self._encoders[id(state)](claim), also=others)
            return True
        self._remove_all(self._files[id(state)])
        return False

    def _remove_all(self, files: list[AtomicFile]) -> None:
        """Remove each of ``files`` we may have written (a standby has none), all of them
        even when one cannot be removed; then raise the first error."""
        failed: OSError | None = None
        for file in files:
            if file.path in self._written:
                try:
                    file.remove()
                    self._written.discard(file.path)
                except OSError as exc:
                    failed = failed or exc
        if failed is not None:
            raise failed

    def _tick(self) -> None:
        self._timer, self._due = None, math.inf
        rewrite = False
        for state in self._states:
            try:
                rewrite = self._publish(state) or rewrite
            except OSError as exc:
                rewrite = True  # leading: try again at the next rewrite
                log.warning("cannot write leader file", extra={
                    "lease": state.lease, "error": str(exc)})
        if rewrite:  # the usual case, six times a second: no need to ask every state
            self._arm(self._period)
        else:
            self._schedule()

    def _schedule(self) -> None:
        """Arm the timer for the earliest state whose files need a look, unless it is
        armed for earlier already (so a transition keeps the rewrites' cadence)."""
        if not self._running:
            return
        waits = [w for w in map(self._next_look, self._states) if w is not None]
        if not waits:
            return  # an armed timer just finds nothing to do, and is not re-armed
        self._arm(min(waits))

    def _arm(self, delay: float) -> None:
        if not self._running:
            return
        loop = self._loop
        assert loop is not None  # running: set by start()
        due = loop.time() + delay
        if due < self._due:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._due = loop.call_at(due, self._tick), due

    def _next_look(self, state: LeaseState) -> float | None:
        """Seconds until ``state``'s files need a look with no word from the elector:
        two thirds of a horizon while it leads or a file of it is on disk (its claim runs out,
        or a write failed and is retried); until the term's first claim is due while one
        is coming; None while nothing can change before the elector says so."""
        facts = state.facts
        now = state.clock.monotonic()
        if facts.leads_at(now) or any(f.path in self._written
                                      for f in self._files[id(state)]):
            return self._period
        flip = facts.next_flip(now)
        return None if flip is None else max(0.0, flip - now)
