"""Watching a shard set the way its application sees it: every member's ``GET /shards``,
on one clock, every shard judged as the chaos checker judges one lease.

:class:`ShardRecorder` polls each member's ``/shards`` (one request answers for all its
shards) from an event loop of its own in a thread, every ``interval`` (20 ms), each
member from a task of its own so a frozen one does not slow the others. A listed shard
is a claim until its ``valid_until``; it began when the sidecar computed it, which is no
earlier than ``valid_until - claim_horizon`` and no earlier than the request's send time:
the earliest of those is taken, so overlaps are judged conservatively
(:mod:`testkit.chaos.recorder` does the same for ``/leader``).

What is judged, per shard, with :mod:`testkit.chaos.checker`: moments two members
claimed it (:func:`overlaps`), a token that went back or stayed across a change of owner
(:func:`token_problems`); and for the benchmarks: owner changes after a moment
(:func:`moves`), the unowned time of each move (:func:`unowned`), when the led shards
first matched a balanced spread (:func:`balanced_at`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from testkit.chaos.checker import Interval, claim_time, fencing_violations, find_overlaps
from testkit.chaos.recorder import Span
from testkit.support import unix_time_or_none


@dataclass
class Snapshot:
    """One member's latest answer: when it was asked, what it led."""

    asked: float = 0.0
    led: dict[str, tuple[int, float]] = field(default_factory=dict)  # shard -> (token, until)
    members: int = 0
    assigned: int = 0


class ShardRecorder:
    """Records every member's shard claims (see the module doc). Use as a context
    manager; :meth:`add` and :meth:`remove` members while it runs."""

    def __init__(self, targets: dict[str, str], claim_horizon: float,
                 interval: float = 0.02) -> None:
        self.horizon = claim_horizon
        self.interval = interval
        self.spans: dict[str, list[Span]] = defaultdict(list)  # shard -> claims
        self.latest: dict[str, Snapshot] = {}
        self.polls = 0
        self.errors = 0
        self.failed: dict[str, str] = {}  # member -> why its poll task died
        self._targets = dict(targets)  # identity -> base URL
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._lock = threading.Lock()

    # -- control (from the test's thread) ---------------------------------------------
    def __enter__(self) -> ShardRecorder:
        self._thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def add(self, identity: str, url: str) -> None:
        self._call(self._add(identity, url))

    def remove(self, identity: str) -> None:
        """Stop asking ``identity`` (stopped; its port may be reused). Its last answer's
        claims still count until their ``valid_until``."""
        self._call(self._remove(identity))

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        # Generous: on a machine running eight sidecars and an apiserver on two cores,
        # the recorder's loop can be seconds behind.
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(120)

    # -- live view ---------------------------------------------------------------------
    def led_now(self, identity: str) -> set[str]:
        """The shards ``identity`` listed in its latest answer, still valid now."""
        now = time.time()
        with self._lock:
            snap = self.latest.get(identity)
            return {s for s, (_, until) in (snap.led.items() if snap else ()) if until > now}

    def tokens(self, identity: str) -> dict[str, int]:
        """Shard -> fencing token, from ``identity``'s latest answer."""
        with self._lock:
            snap = self.latest.get(identity)
            return {s: token for s, (token, _) in (snap.led.items() if snap else ())}

    def counts(self) -> dict[str, int]:
        return {identity: len(self.led_now(identity)) for identity in list(self.latest)}

    def _led(self, members: Iterable[str],
             shards: int) -> tuple[dict[str, set[str]], int, set[str]]:
        """Each of ``members``' shards led now, the fair share ceil(S / N), and the
        shards led by any of them."""
        led = {m: self.led_now(m) for m in members}
        return led, -(-shards // len(led)), set().union(*led.values())

    def settled(self, members: Iterable[str], shards: int) -> bool:
        """Every shard led by exactly one of ``members``, each leading at most
        ceil(S / N): a balanced spread, as the members' latest answers show it."""
        led, cap, union = self._led(members, shards)
        return (len(union) == shards and sum(map(len, led.values())) == shards
                and all(len(held) <= cap for held in led.values()))

    def spread(self, members: Iterable[str], shards: int) -> str:
        """Why the members are not :meth:`settled`, as their latest answers show it:
        shards led per member, over the fair share, led by nobody or by two."""
        led, cap, union = self._led(members, shards)
        twice = sum(map(len, led.values())) - len(union)
        over = [m for m, held in led.items() if len(held) > cap]
        counts = {m: len(held) for m, held in led.items()}
        dead = {m: why for m, why in self.failed.items() if m in led}
        return (f"led per member {counts}, fair share "
                f"{cap}, over it {over or 'none'}; led by nobody {shards - len(union)}; "
                f"listed by two {twice}; polls that died {dead or 'none'}")

    # -- the loop ------------------------------------------------------------------------
    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5))
        for identity, url in self._targets.items():
            await self._add(identity, url)

    async def _stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()

    async def _add(self, identity: str, url: str) -> None:
        self._targets[identity] = url
        task = asyncio.create_task(self._poll(identity, url))
        self._tasks[identity] = task

        def ended(_: asyncio.Task[None]) -> None:
            # A poll that dies leaves the member's last answer to run out: say why.
            if not task.cancelled() and task.exception() is not None:
                self.failed[identity] = repr(task.exception())

        task.add_done_callback(ended)

    async def _remove(self, identity: str) -> None:
        task = self._tasks.pop(identity, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _poll(self, identity: str, url: str) -> None:
        assert self._session is not None
        while True:
            sent = time.time()
            try:
                async with self._session.get(url + "/shards") as response:
                    body = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                self.errors += 1
            else:
                self._record(identity, body, sent)
            await asyncio.sleep(max(0.0, sent + self.interval - time.time()))

    def _record(self, identity: str, body: dict, sent: float) -> None:
        self.polls += 1
        snap = Snapshot(sent, members=body.get("members", 0),
                        assigned=len(body.get("assigned", [])))
        for entry in body.get("shards", []):
            until = unix_time_or_none(entry["valid_until"])
            if until is None:
                continue
            start = max(sent, until - self.horizon)
            snap.led[entry["shard"]] = (entry["fencing_token"], until)
            if until > start:
                self.spans[entry["shard"]].append(
                    Span(identity, entry["fencing_token"], start, until, "http"))
        with self._lock:
            self.latest[identity] = snap


# -- judging --------------------------------------------------------------------------
def overlaps(spans: dict[str, list[Span]]) -> dict[str, list[Interval]]:
    """Per shard, the moments two members claimed it (none is the rule)."""
    found = {}
    for shard, claims in spans.items():
        both = find_overlaps(claim_time(claims))
        if both:
            found[shard] = both
    return found


def token_problems(spans: dict[str, list[Span]]) -> list[str]:
    """Per shard: a token that went back, or stayed the same across a change of owner."""
    return [f"{shard}: {problem}" for shard, claims in spans.items()
            for problem in fencing_violations(claims)]


def terms(claims: list[Span]) -> list[Interval]:
    """A shard's claim time, merged per owner, in order of start."""
    return sorted((iv for ivs in claim_time(claims).values() for iv in ivs),
                  key=lambda iv: iv.start)


def moves(spans: dict[str, list[Span]], since: float, until: float = float("inf")
          ) -> dict[str, list[tuple[str, str]]]:
    """Per shard, its changes of owner (from, to) whose new owner's claims began in
    ``[since, until)``."""
    found: dict[str, list[tuple[str, str]]] = {}
    for shard, claims in spans.items():
        owned = terms(claims)
        changes = [(a.who[0], b.who[0]) for a, b in itertools.pairwise(owned)
                   if a.who != b.who and since <= b.start < until]
        if changes:
            found[shard] = changes
    return found


def unowned(spans: dict[str, list[Span]], since: float, until: float = float("inf")
            ) -> list[float]:
    """Seconds each change of owner in ``[since, until)`` left its shard with no claim:
    from the end of the old owner's last claim to the new owner's first."""
    gaps = []
    for claims in spans.values():
        owned = terms(claims)
        for a, b in itertools.pairwise(owned):
            if a.who != b.who and since <= b.start < until:
                gaps.append(max(0.0, b.start - a.end))
    return gaps


def settled_at(spans: dict[str, list[Span]], members: Iterable[str], since: float,
               until: float) -> float | None:
    """The first moment in ``[since, until)`` from which on every shard is claimed by
    one of ``members`` and none of them claims more than ceil(S / N), as judged on the
    claims' intervals (the sweep of all claims' edges); None if never."""
    alive = set(members)
    cap = -(-len(spans) // len(alive))
    owned = {shard: terms(claims) for shard, claims in spans.items()}
    edges = sorted({since, *(t for ivs in owned.values() for iv in ivs
                             for t in (iv.start, iv.end) if since <= t < until)})
    first: float | None = None
    for moment in edges:
        probe = moment + 1e-6
        holders = []
        for ivs in owned.values():
            who = [iv.who[0] for iv in ivs if iv.start <= probe < iv.end]
            holders.append(who[0] if len(who) == 1 else None)
        load: dict[str, int] = defaultdict(int)
        for who in holders:
            if who is not None:
                load[who] += 1
        good = (all(h in alive for h in holders) and all(v <= cap for v in load.values()))
        if good and first is None:
            first = moment
        elif not good:
            first = None
    return first
