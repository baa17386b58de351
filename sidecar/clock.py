"""Time, injectable: the elector, the state and the backends read it only through a
:class:`Clock`, so the timing rules are unit-tested without sleeping."""

from __future__ import annotations

import functools
import math
import time
from datetime import UTC, datetime
from typing import Protocol


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
