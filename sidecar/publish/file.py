"""The leader file: ``{state_dir}/leader`` (first lease) and ``{state_dir}/{name}``.

The file exists exactly while this contender leads; its content is the JSON of
``GET /leader``, including ``valid_until``. It is rewritten every half claim horizon,
so a sidecar that dies or freezes stops claiming within one horizon even
though nobody removes its file. Writes are atomic: a temp file in the same directory,
then ``rename``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from sidecar.state import LeaseState

log = logging.getLogger("sidecar.publish.file")


def write_atomically(path: Path, data: bytes) -> None:
    tmp = f"{path.parent}/.{path.name}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


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
            self._publish(state)
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
