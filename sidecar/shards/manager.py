"""Which shards this member campaigns for, and how shards move between members.

Every shard is a lease of its own, driven by an ordinary :class:`~sidecar.elector.Elector`
(its claims, its token, its hand-over: the safety model of docs/design.md, unchanged).
This module decides only *who campaigns*: after each round trip of the shard group
(:class:`~sidecar.lease.ShardGroup`, one a renew interval) it computes the assignment
over the live members (:func:`sidecar.shards.assign.assign`) and

- runs an elector for every shard assigned to this member (a free one is taken at
  once; one another member holds is taken when that member hands it over, or when its
  lease runs out);
- stops the elector of every shard that is neither assigned to it nor held by it;
- hands the shards it holds but is not assigned over to the member the assignment names,
  one at a time, with the elector's hand-over (unpublish, wait out the claims, release
  with the release record, the successor named where the backend keeps a hint), once
  its view of the members has not changed for :data:`MOVE_AFTER` renew intervals — so
  the successor, which sees the same members at its own round trip, campaigns by then;
- when it stops: leaves the group (its member record goes), follows the group until the
  others have had a round trip since (:data:`LEAVE_WAIT` renew intervals), then stops
  every elector at once, each naming its shard's next member — by the freshest view, so
  members leaving together do not hand shards to each other — as its successor.

A member that has just joined waits for its :data:`JOIN_BEATS`-th round trip before it campaigns,
so a group that starts together sees itself whole first instead of the first member up
taking every shard. A member whose application is not ready (``LEASE_APP_READY_URL``,
``LEASE_APP_READY_CONTAINERS``) drops its member record until it is, so its shards go to
members that can work.

Time comes from the sidecar's clock and every wait is an asyncio wait, so a simulated
process runs this as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from sidecar.base.clock import Clock, first_of
from sidecar.elector import Elector
from sidecar.lease import Lease, ShardGroup
from sidecar.settings import Timing
from sidecar.shards.assign import assign
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.shards")

# Round trips a newly joined member makes before it campaigns: its first writes its
# record, and by its second (a renew interval later) the others' round trips (one a renew
# interval, ±5 %) have shown them to it, and it to them.
JOIN_BEATS = 2
# Renew intervals the view of the members must stay the same before a member hands a
# shard over. It saw a newcomer at a round trip after the newcomer's first, so the
# newcomer campaigns (its second round trip, a renew interval ±5 % after its first) by
# then.
MOVE_AFTER = 1.5
# Renew intervals a stopping member's view must hold still, after it dropped its record,
# before it hands its shards over: every other member has had a round trip since the
# last departure it saw.
LEAVE_WAIT = 1.1
# Renew intervals a stopping member follows the group at most before it hands over.
LEAVE_LIMIT = 3
# Why a shard leaves this member, as the metrics count it.
MOVE_REASONS = ("rebalance", "shutdown", "lost")

# (the shard's lease, its state, who to hand it to when this member stops) -> its elector.
MakeElector = Callable[[Lease, LeaseState, Callable[[], Awaitable[str | None]]], Elector]


@dataclass(frozen=True)
class View:
    """One round trip's picture of the group, and what it means for this member."""

    members: tuple[str, ...] = ()
    assignment: Mapping[str, str] | None = None  # shard -> member; None: nothing seen yet
    since: float = 0.0  # monotonic: when the members last changed
    ok: bool = False  # the last round trip succeeded
    error: str = ""


class ShardManager:
    """The campaigns and moves of one member (see the module doc)."""

    def __init__(self, group: ShardGroup, states: Mapping[str, LeaseState],
                 identity: str, timing: Timing, clock: Clock,
                 make_elector: MakeElector,
                 ready: Callable[[], str | None] | None = None) -> None:
        self.group = group
        self.states = dict(states)
        self.shards: Sequence[str] = tuple(states)
        # Our name among the members: the identity, as the group's records hold it.
        self.identity = group.member
        self._timing = timing
        self._clock = clock
        self._make_elector = make_elector
        self._ready = ready
        self.view = View()
        self.electors: dict[str, Elector] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ending: dict[str, asyncio.Task[None]] = {}  # electors told to stop
        self._beats = 0  # successful round trips so far
        self._leaving: tuple[str, ...] | None = None  # members without us, once stopping
        self._changed = asyncio.Event()  # a new view: the mover looks again
        self._loops: list[asyncio.Task[None]] = []
        self._stopping: asyncio.Future[None] | None = None
        self._assigned_to: dict[tuple[str, ...], dict[str, str]] = {}
        self.failure: str | None = None  # the loop that ended with an error, and why

    # -- what the publishers read --------------------------------------------------------
    def assigned(self) -> list[str]:
        """The shards the current view assigns to this member."""
        assignment = self.view.assignment or {}
        return [s for s in self.shards if assignment.get(s) == self.identity]

    def owned(self) -> list[str]:
        """The shards this member holds now (granted by the backend)."""
        return [s for s in self.shards if self.states[s].facts.holding]

    # -- running -------------------------------------------------------------------------
    async def start(self) -> None:
        # The view's task first (tasks take their first step in the order they were
        # created): it waits for the next round trip, and the group's first one begins
        # at the group task's first step. Created after it, the view waited for the
        # second, and a newcomer campaigned a renew interval later than JOIN_BEATS says,
        # after the others had begun handing it shards.
        follow = asyncio.create_task(self._follow(), name="shard-view")
        move = asyncio.create_task(self._move(), name="shard-mover")
        self._loops = [asyncio.create_task(self.group.run(), name="shard-group"),
                       follow, move]
        for task in self._loops:
            task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """A loop that fails is a defect: say which and why once (``/livez`` fails from now
        on, so the kubelet restarts the sidecar; its shards go to the others)."""
        if task.cancelled() or (exc := task.exception()) is None:
            return
        self.failure = f"{task.get_name()}: {exc!r}"
        log.error("a shard loop ended with an error; /livez fails from now on",
                  extra={"loop": task.get_name(), "error": repr(exc)}, exc_info=exc)

    def alive(self) -> bool:
        return all(not task.done() for task in self._loops)

    async def stop(self) -> None:
        """Leave the group and hand every shard to its next member (see the module doc),
        then stop the group's round trips. A second call (a second SIGTERM) waits for
        the first."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        if not self._loops:
            return
        for task in self._loops[1:]:  # no more campaigns or moves; the round trips go on
            task.cancel()
        for task in self._loops[1:]:
            # A loop that had failed re-raises here: it was logged when it ended
            # (_loop_ended), and the stop must still hand the shards over and stop
            # their electors.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._leave()
        electors = list(self.electors.values())
        for elector in electors:
            elector.stop()
        await asyncio.gather(*self._tasks.values(), *self._ending.values(),
                             return_exceptions=True)
        self._tasks.clear()
        self.electors.clear()
        await self.group.close()
        group = self._loops[0]
        with contextlib.suppress(asyncio.CancelledError, Exception):
            async with asyncio.timeout(max(1.0, self._timing.renew_interval)):
                await group
        if not group.done():
            group.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await group
        self._loops.clear()

    async def _leave(self) -> None:
        """Drop our record; while we hold shards, keep following the group until the
        others have had a round trip since (:data:`LEAVE_WAIT`), so the successors, seen
        from the freshest view (members leaving at the same time are gone from it too),
        campaign when the shards come. Bounded: a backend that does not answer must not
        hold the stop up (the shards then go with no successor named: first come wins)."""
        self.group.advertise(False)
        interval = self._timing.renew_interval
        try:
            async with asyncio.timeout(3 * interval):
                members = await self.group.next_beat()
            changed = self._clock.monotonic()
            self._leaving = tuple(m for m in members if m != self.identity)
            log.info("left the shard group", extra={"members": len(self._leaving),
                                                    "owned": len(self.owned())})
            # Until the view has held still that long: members leaving at the same time
            # drop their records at their own round trips, a renew interval apart. Not
            # until the round trip after that: a view last changed at our second round
            # trip held still long enough before the third, which came after the limit.
            async with asyncio.timeout(LEAVE_LIMIT * interval):
                while self.owned():
                    still = changed + LEAVE_WAIT * interval - self._clock.monotonic()
                    if still <= 0:
                        break
                    try:
                        async with asyncio.timeout(still):
                            members = await self.group.next_beat()
                    except TimeoutError:
                        break
                    left = tuple(m for m in members if m != self.identity)
                    if left != self._leaving:
                        self._leaving, changed = left, self._clock.monotonic()
        except Exception as exc:
            log.warning("could not follow the shard group while leaving; handing shards "
                        "over to the last members seen", extra={
                            "error": str(exc) or type(exc).__name__})

    # -- following the group -------------------------------------------------------------
    async def _follow(self) -> None:
        while True:
            if self._ready is not None:
                self.group.advertise(self._ready() is None)
            try:
                members = await self.group.next_beat()
            except Exception as exc:
                self.view = View(self.view.members, self.view.assignment, self.view.since,
                                 ok=False, error=str(exc) or type(exc).__name__)
                continue
            now = self._clock.monotonic()
            self._beats += 1
            if members != self.view.members or self.view.assignment is None:
                assignment = self._assignment(members)
                self.view = View(members, assignment, now, ok=True)
                log.info("shard group changed", extra={
                    "members": len(members), "assigned": len(self.assigned()),
                    "owned": len(self.owned())})
            else:
                self.view = View(members, self.view.assignment, self.view.since, ok=True)
            self._campaign(now)
            self._changed.set()

    def _assignment(self, members: tuple[str, ...]) -> dict[str, str]:
        found = self._assigned_to.get(members)
        if found is None:
            found = assign(self.shards, members)
            self._assigned_to = {members: found}  # one view at a time is enough
        return found

    def _campaign(self, now: float) -> None:
        """Start the electors of our shards, stop those of shards we neither get nor
        hold."""
        if self._beats < JOIN_BEATS:
            return
        assignment = self.view.assignment or {}
        for shard in self.shards:
            mine = assignment.get(shard) == self.identity
            running = shard in self.electors
            if mine and not running:
                self._start_elector(shard)
            elif not mine and running and not self.states[shard].facts.holding:
                self._stop_elector(shard)

    def _start_elector(self, shard: str) -> None:
        ending = self._ending.get(shard)
        if ending is not None and not ending.done():
            return  # its last elector is still finishing (a call in flight): next time
        state = self.states[shard]
        elector = self._make_elector(self.group.lease(shard), state,
                                     lambda: self._successor(shard))
        self.electors[shard] = elector
        self._tasks[shard] = asyncio.create_task(elector.run(), name=f"elector-{shard}")

    def _stop_elector(self, shard: str) -> None:
        """Stop campaigning for ``shard``. Not by cancelling: a call in flight (an acquire
        that may win) ends first, and the elector's own shutdown gives back whatever it
        won; the lease's resources close once it has."""
        elector = self.electors.pop(shard)
        elector.stop()
        task = self._tasks.pop(shard)
        self._ending[shard] = task

        def ended(_: asyncio.Task[None]) -> None:
            if self._ending.get(shard) is task:
                del self._ending[shard]
                if shard not in self.electors:
                    self.group.retire(shard)

        task.add_done_callback(ended)

    async def _successor(self, shard: str) -> str | None:
        """Who gets ``shard`` when this member stops: its member once we are gone."""
        leaving = self._leaving
        return self._assignment(leaving).get(shard) if leaving else None

    # -- moving shards that belong elsewhere --------------------------------------------
    async def _move(self) -> None:
        """Hand over, one at a time, the shards we hold that the view gives to others."""
        interval = self._timing.renew_interval
        while True:
            self._changed.clear()
            shard = self._excess()
            if shard is None:
                await self._changed.wait()
                continue
            view = self.view
            settled = view.since + MOVE_AFTER * interval - self._clock.monotonic()
            if settled > 0 or not view.ok:
                await first_of(self._changed.wait(), timeout=max(settled, 0.05))
                continue
            to = (view.assignment or {}).get(shard)
            elector = self.electors[shard]
            if not elector.request_handover(to, why="rebalance"):
                await first_of(self._changed.wait(), timeout=interval)
                continue
            log.info("handing a shard over", extra={"lease": shard, "to": to})
            await self._stepped_down(shard)
            # A round trip since the release may have stopped the elector already (it
            # holds nothing and the shard is not ours), or started a new one (the shard
            # is ours again): stop only the one that handed over, once.
            if self.electors.get(shard) is elector \
                    and (self.view.assignment or {}).get(shard) != self.identity:
                self._stop_elector(shard)

    def _excess(self) -> str | None:
        assignment = self.view.assignment
        if assignment is None:
            return None
        for shard, elector in self.electors.items():
            facts = self.states[shard].facts
            if assignment.get(shard) != self.identity and facts.holding \
                    and not facts.released and elector is not None:
                return shard
        return None

    async def _stepped_down(self, shard: str) -> None:
        """Wait until the hand-over of ``shard`` has released it (bounded: a release
        that hangs frees itself within a lease duration)."""
        state = self.states[shard]
        deadline = self._clock.monotonic() + self._timing.lease_duration
        while state.facts.holding and (left := deadline - self._clock.monotonic()) > 0:
            await state.wait_for_change(state.facts.version, left)
