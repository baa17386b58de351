"""The one "wait for the first of several" helper."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable


async def first_of(*waitables: Awaitable[object], timeout: float | None = None) -> None:
    """Return when the first of ``waitables`` finishes (or ``timeout`` passes).

    Coroutines are wrapped in tasks that are cancelled and awaited before returning;
    futures and tasks passed in are shared with the caller and left running.
    """
    if len(waitables) == 1 and asyncio.iscoroutine(waitables[0]):
        # One coroutine (a holder's sleep between renews): run it in this task, without
        # a task of its own to create, cancel and await each time.
        with contextlib.suppress(Exception):  # TimeoutError, or what the waitable raised
            async with asyncio.timeout(timeout):
                await waitables[0]
        return
    ours = [asyncio.ensure_future(w) for w in waitables if not asyncio.isfuture(w)]
    shared = [w for w in waitables if asyncio.isfuture(w)]
    try:
        await asyncio.wait([*ours, *shared], timeout=timeout,
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in ours:
            task.cancel()
        for task in ours:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
