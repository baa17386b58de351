"""The leader file: ``{state_dir}/leader`` (first lease) and ``{state_dir}/{name}``.

The file exists exactly while this contender leads; its content is the JSON of
``GET /leader``, including ``valid_until``. It is rewritten every half claim horizon,
so a sidecar that dies or freezes stops claiming within one horizon even
though nobody removes its file. Writes are atomic: a temp file in the same directory,
then ``rename``.

No symlink is ever followed, so nobody who can write to the directory can make us write
into another file: the temp file has a random name and is created with
``O_CREAT | O_EXCL | O_NOFOLLOW`` (an existing file or symlink of that name is an error,
and we pick another name), and ``rename`` replaces a ``leader`` symlink itself, never
its target. Files are created with mode 0644 less the umask: the application usually
runs as another user and must read it; the claim is not a secret. (The directory itself
is vetted by :mod:`sidecar.statedir`.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from pathlib import Path

from sidecar.base.errors import ConfigError
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.publish.file")


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_ATTEMPTS = 8


def temp_name(path: Path) -> Path:
    """A name nobody can predict, so nobody can plant anything there in advance."""
    return path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"


def write_atomically(path: Path, data: bytes) -> None:
    for _ in range(_ATTEMPTS):
        tmp = temp_name(path)
        try:
            fd = os.open(tmp, _CREATE, 0o644)
        except FileExistsError:
            continue  # something already has that name (planted or not): never reuse it
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        return
    raise FileExistsError(f"{path.parent}: no free temporary name in {_ATTEMPTS} attempts")


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class FilePublisher:
    def __init__(self, states: list[LeaseState], directory: Path) -> None:
        self._states = states
        self._dir = directory
        self._task: asyncio.Task[None] | None = None
        self._written: set[Path] = set()

    def paths(self, state: LeaseState) -> list[Path]:
        paths = [self._dir / state.lease]
        if state is self._states[0]:
            paths.insert(0, self._dir / "leader")
        return paths

    async def start(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        for state in self._states:  # a previous run's leftovers are not our claims
            try:
                self._publish(state)
            except OSError as exc:
                # A state-dir problem (a directory named ``leader``...) says so, not
                # something else that happens to be started next.
                raise ConfigError(f"LEASE_STATE_DIR / --state-dir: "
                                  f"{exc.filename or self._dir}: {exc.strerror or exc}") from None
        horizon = min(s.claim_horizon for s in self._states)
        # Half a horizon: the file always has at least half a horizon left, at two
        # writes per horizon (each write costs CPU on an idle sidecar).
        self._task = asyncio.create_task(self._refresh(horizon / 2), name="leader-file")

    async def changed(self, state: LeaseState) -> None:
        self._publish(state)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for path in list(self._written):
            self._remove(path)

    def _publish(self, state: LeaseState) -> None:
        claim = state.claim()
        if claim.leader:
            data = state.encoded(claim)
            for path in self.paths(state):
                write_atomically(path, data)
                self._written.add(path)
        else:
            for path in self.paths(state):
                self._remove(path)

    def _remove(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._written.discard(path)

    async def _refresh(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            for state in self._states:
                try:
                    self._publish(state)
                except OSError as exc:
                    log.warning("cannot write leader file", extra={
                        "lease": state.lease, "error": str(exc)})
