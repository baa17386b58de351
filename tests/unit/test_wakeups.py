"""``Wakeups``: a wake-up by key wakes the waiters of that key only, every one of them,
and one announced after the waiter's last look is never slept through."""

from __future__ import annotations

import asyncio

from sidecar.base.clock import Wakeups


async def test_an_announcement_wakes_every_waiter_of_its_key_and_no_other() -> None:
    wakeups: Wakeups[str] = Wakeups()
    first = asyncio.ensure_future(wakeups.wait("work-1", 30.0, since=0.0))
    second = asyncio.ensure_future(wakeups.wait("work-1", 30.0, since=0.0))
    bystander = asyncio.ensure_future(wakeups.wait("work-2", 30.0, since=0.0))
    await asyncio.sleep(0)
    wakeups.announce("work-1", now=1.0)
    await asyncio.wait_for(asyncio.gather(first, second), 1.0)
    await asyncio.sleep(0.01)
    assert not bystander.done()
    bystander.cancel()


async def test_an_announcement_after_the_last_look_returns_at_once() -> None:
    wakeups: Wakeups[int] = Wakeups()
    wakeups.announce(7, now=5.0)
    # Looked at 4.0, the release came at 5.0: do not sleep.
    await asyncio.wait_for(wakeups.wait(7, 30.0, since=4.0), 0.5)
    # Looked at 6.0, after it: wait for the next one (here: the timeout).
    loop = asyncio.get_running_loop()
    started = loop.time()
    await wakeups.wait(7, 0.05, since=6.0)
    assert loop.time() - started >= 0.04
