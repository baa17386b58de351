"""Watches what the application would see: every sidecar's ``GET /leader`` and its file.

One process, one event loop, one clock (``time.time()``, the clock ``valid_until`` is
written in). Each sidecar's HTTP endpoint is polled by its own task, so a frozen
sidecar (which never answers) does not slow the others; all leader files are read by
one task. Files are read every ``interval`` (5 ms), HTTP polled every ``http_interval`` (8 ms;
each request costs more), both under the 10 ms required; the achieved periods are
recorded and reported.

A claim is an interval, not a sample: a ``200`` (or a file) saying ``valid_until = v``
promises leadership until ``v``. The claim began when the sidecar computed it, which
lies in ``[v - claim_horizon, receive time]`` (``valid_until`` is at most one horizon
ahead); we take the earliest moment we cannot rule out, ``max(v - horizon, send time)``
for HTTP and ``max(v - horizon, previous read)`` for a file, so overlaps are judged
conservatively. A frozen sidecar's leftover file keeps counting until its ``v``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from testkit.support import unix_time_or_none


@dataclass(frozen=True)
class Span:
    """One observed claim: ``identity`` leads with ``token`` during ``[start, end]``."""

    identity: str
    token: int | None
    start: float
    end: float
    source: str  # "http" | "file"


@dataclass(frozen=True)
class Target:
    identity: str
    url: str  # base URL of the sidecar's HTTP endpoint
    leader_file: Path


@dataclass
class SampleStats:
    """Loop periods of one source, to show the sampling really ran every ≤ 10 ms."""

    count: int = 0
    periods: list[float] = field(default_factory=list)
    _last: float | None = None

    def tick(self, now: float, answered: bool = True) -> None:
        """One sample began at ``now``; a period counts only if the previous sample got
        an answer (a dead or frozen sidecar's timeouts say nothing about our pace)."""
        self.count += 1
        if self._last is not None:
            self.periods.append(now - self._last)
        self._last = now if answered else None


class Recorder:
    def __init__(self, targets: list[Target], claim_horizon: float,
                 interval: float = 0.005, http_interval: float = 0.008,
                 http_timeout: float = 0.25) -> None:
        self.targets = targets
        self.horizon = claim_horizon
        self.interval = interval
        self.http_interval = http_interval
        self.http_timeout = http_timeout
        self.spans: list[Span] = []
        self.http_stats: dict[str, SampleStats] = {t.identity: SampleStats() for t in targets}
        self.file_stats = SampleStats()
        # When every leader file was read: a gap with no read inside it was not watched.
        self.file_reads: array[float] = array("d")
        self.anomalies: list[str] = []
        self._latest: dict[str, float] = {}  # identity -> latest claim end seen
        self._file_seen: dict[str, float | None] = {}
        self._file_read: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._http_tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None

    # -- control -----------------------------------------------------------------------
    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.http_timeout)
        self._session = aiohttp.ClientSession(timeout=timeout)
        for target in self.targets:
            self._http_tasks[target.identity] = asyncio.create_task(self._poll_http(target))
        self._tasks = [asyncio.create_task(self._poll_files())]

    def add_target(self, target: Target) -> None:
        """Watch one more sidecar from now on (pods come and go in a rolling restart).

        Call on the recorder's event loop, after :meth:`start`.
        """
        self.targets.append(target)
        self.http_stats.setdefault(target.identity, SampleStats())
        self._http_tasks[target.identity] = asyncio.create_task(self._poll_http(target))

    def remove_target(self, identity: str) -> None:
        """Stop watching a sidecar that is gone (its address may be given to another)."""
        self.targets = [t for t in self.targets if t.identity != identity]
        task = self._http_tasks.pop(identity, None)
        if task is not None:
            task.cancel()
            self._tasks.append(task)  # awaited by stop()

    async def stop(self) -> None:
        tasks = [*self._tasks, *self._http_tasks.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()

    # -- live queries (for targeting and pacing faults) --------------------------------
    def leader_now(self, now: float | None = None) -> str | None:
        """Who claims leadership right now, as far as we have seen."""
        now = time.time() if now is None else now
        live = [(end, ident) for ident, end in self._latest.items() if end > now]
        return max(live)[1] if live else None

    # -- sampling ----------------------------------------------------------------------
    def _record(self, identity: str, body: dict, start: float, source: str) -> None:
        end = unix_time_or_none(body.get("valid_until"))
        if end is None:
            self.anomalies.append(f"{source} claim of {identity} without valid_until")
            return
        if body.get("identity") != identity:
            self.anomalies.append(f"{source} of {identity} names {body.get('identity')!r}")
        start = max(start, end - self.horizon)
        if end <= start:
            return
        self.spans.append(Span(identity, body.get("fencing_token"), start, end, source))
        self._latest[identity] = max(self._latest.get(identity, 0.0), end)

    async def _poll_http(self, target: Target) -> None:
        assert self._session is not None
        stats = self.http_stats[target.identity]
        url = target.url + "/leader"
        answered = False
        while True:
            sent = time.time()
            stats.tick(sent, answered)
            answered = False
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with self._session.get(url) as response:
                    body = await response.json(content_type=None)
                    answered = True
                    if response.status == 200 and body.get("leader"):
                        self._record(target.identity, body, sent, "http")
            await asyncio.sleep(max(0.0, sent + self.http_interval - time.time()))

    async def _poll_files(self) -> None:
        while True:
            began = time.time()
            self.file_stats.tick(began)
            self.file_reads.append(began)
            for target in list(self.targets):
                self._read_file(target)
            await asyncio.sleep(max(0.0, began + self.interval - time.time()))

    def _read_file(self, target: Target) -> None:
        ident = target.identity
        now = time.time()
        previous = self._file_read.get(ident, now)
        self._file_read[ident] = now
        try:
            body = json.loads(target.leader_file.read_bytes())
        except (FileNotFoundError, ValueError):
            # Gone (not leading) or caught mid-write on a filesystem without atomic
            # rename (not expected: the publisher renames).
            self._file_seen[ident] = None
            return
        end = body.get("valid_until")
        if end == self._file_seen.get(ident):
            return  # the same claim as last time
        self._file_seen[ident] = end
        if body.get("leader"):
            self._record(ident, body, previous, "file")
        else:
            self.anomalies.append(f"file of {ident} exists but says leader=false")
