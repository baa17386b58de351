"""Time as the sidecar reads, writes and waits for it.

- Reading: the elector, the state and the backends read time only through a
  :class:`Clock`, so the timing rules are unit-tested without sleeping.
- Writing: instants as RFC 3339 / Unix milliseconds, rounded down (a claim never reads
  longer than it is); durations as Go writes them (``time.ParseDuration``, as client-go
  users do): ``250ms``, ``1.5s``, ``1m30s``, ``1h2m``, also ``us``/``µs``/``ns``, or plain
  seconds.
- Waiting: :func:`first_of`, the one "wait for the first of several" helper, and
  :class:`Wakeups`, wake-ups by key (a released lease's name or lock id) that a waiter
  cannot miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import re
import time
from collections.abc import Awaitable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Generic, Protocol, TypeVar


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


def epoch_ms(wall: float | None) -> int | None:
    """Unix milliseconds, rounded *down* (a claim never reads longer than it is)."""
    if wall is None:
        return None
    return math.floor(wall * 1000)


def rfc3339(wall: float | None) -> str | None:
    """UTC, millisecond precision, rounded *down* like :func:`epoch_ms`."""
    ms = epoch_ms(wall)
    if ms is None:
        return None
    second, milli = divmod(ms, 1000)
    return f"{_utc_second(second)}.{milli:03d}Z"


@functools.lru_cache(maxsize=4)
def _utc_second(second: int) -> str:
    """``YYYY-MM-DDTHH:MM:SS`` of a Unix second: the leader file and ``/leader`` ask for
    the same second many times, and formatting a datetime is most of a claim's cost."""
    return datetime.fromtimestamp(second, tz=UTC).isoformat(timespec="seconds")[:-len("+00:00")]


# -- durations ----------------------------------------------------------------------
# Go's duration syntax: one or more <number><unit>; a lone number is seconds here.
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_PART = re.compile(rf"({_NUMBER})(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_PARTS = re.compile(rf"(?:{_PART.pattern})+")
_PLAIN = re.compile(_NUMBER)
_UNITS = {"ns": Decimal("1e-9"), "us": Decimal("1e-6"), "\u00b5s": Decimal("1e-6"),
          "\u03bcs": Decimal("1e-6"), "ms": Decimal("0.001"), "s": Decimal(1),
          "m": Decimal(60), "h": Decimal(3600)}
# Far beyond any setting's bound; keeps every parsed value a finite float.
MAX_DURATION = Decimal(10**9)


def _quoted(text: str) -> str:
    """The user's text in an error, cut short (a value can be 400 characters of nines)."""
    return repr(text) if len(text) <= 24 else f"{text[:12]!r}… ({len(text)} characters)"


def parse_duration(text: str) -> float:
    """Go's duration syntax (``1m30s``, ``250ms``, ``1.5h``) or plain seconds → seconds."""
    raw = text.strip()
    if raw.startswith("-"):
        raise ValueError(f"{_quoted(text)} is not a duration: it is negative")
    body = raw[1:] if raw.startswith("+") else raw
    if _PLAIN.fullmatch(body):
        total = Decimal(body)
    elif _PARTS.fullmatch(body):
        total = sum((Decimal(number) * _UNITS[unit] for number, unit in _PART.findall(body)),
                    Decimal(0))
    else:
        raise ValueError(f"{_quoted(text)} is not a duration (use 250ms, 1.5s, 1m30s, 2h or "
                         "plain seconds)")
    if total > MAX_DURATION:
        raise ValueError(f"{_quoted(text)} is too large (more than {MAX_DURATION} seconds)")
    return float(total)


def format_duration(seconds: float) -> str:
    """Seconds as Go would write them, shortest form: ``250ms``, ``1.5s``, ``1m30s``."""
    if seconds == 0:
        return "0s"
    if seconds < 0.001:
        return f"{round(seconds * 1e6, 3):g}\u00b5s"
    if seconds < 1:
        return f"{round(seconds * 1e3, 3):g}ms"
    hours, rest = divmod(round(seconds * 1000), 3_600_000)
    minutes, millis = divmod(rest, 60_000)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else ""]
    if millis or not any(parts):
        parts.append(f"{millis / 1000:g}s")
    return "".join(parts)


# -- waiting ------------------------------------------------------------------------
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


Key = TypeVar("Key")


class Wakeups(Generic[Key]):
    """Wake-ups by key: :meth:`announce` wakes every current waiter of its key, and a
    waiter that comes late returns at once when the key was announced after the moment
    it says it last looked (``since``), so a wake-up between a standby's try and its
    wait is never slept through. Times are the announcer's: waiters pass ``since`` on the
    same clock.

    Why by key: a shard group's member waits for hundreds of leases on one channel, and a
    release must wake the standby of its own lease only (each woken standby sends an
    acquire, and the one that can win queued behind the rest)."""

    def __init__(self) -> None:
        self._events: dict[Key, asyncio.Event] = {}
        self._last: dict[Key, float] = {}

    def announce(self, key: Key, now: float) -> None:
        self._last[key] = now
        # A fresh event per wake-up, so every current waiter wakes and later ones wait.
        event = self._events.pop(key, None)
        if event is not None:
            event.set()

    async def wait(self, key: Key, timeout: float, since: float) -> None:
        """Until ``key`` is announced, or ``timeout`` seconds; at once if it was
        announced after ``since``."""
        if self._last.get(key, float("-inf")) > since:
            return
        event = self._events.setdefault(key, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()
