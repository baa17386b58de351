"""Publishers turn state changes into what the application sees.

Each publisher consumes :class:`~sidecar.state.LeaseState` and nothing else: it never
talks to the backend. The elector calls ``changed`` after every transition and awaits
it (bounded) before releasing a lease, which is what makes "unpublish, then release"
hold for the file and the pod label. The HTTP endpoint needs no call: it reads the
state at request time.
"""

from __future__ import annotations

from typing import Protocol

from sidecar.state import LeaseState


class Publisher(Protocol):
    async def start(self) -> None: ...

    async def changed(self, state: LeaseState) -> None:
        """Bring the published view of ``state`` up to date (idempotent)."""
        ...

    async def stop(self) -> None: ...
