"""One simulated sidecar: the project's real elector, state and backend lease code, in a
process of the simulation (its own clocks, frozen or killed as a whole).

It is wired as :class:`sidecar.runtime.Sidecar` wires a real one (one state and elector
per lease name over one backend, a shard set's group and manager with a state per shard,
the application-readiness gate, stop = stop every elector and hand the shards over, then
close the backend), without the HTTP server: its application asks each state for a claim
the way ``GET /leader`` does — at once after every change of the facts, at each moment
the claim rule can flip (a term's first claim), and every few tens of milliseconds while
it leads — and the checker judges every claim handed out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection
from dataclasses import replace
from typing import Any

from sidecar.elector import Elector
from sidecar.lease import Backend, BackendEntry, Lease
from sidecar.lease.postgres_advisory.sql import lock_id
from sidecar.settings import Settings
from sidecar.shards.manager import ShardManager
from sidecar.state import Claim, LeaseState
from testkit.sim.checks import Checker
from testkit.sim.world import Endpoint, Host, SimClock, World, in_process


class RecordingState(LeaseState):
    """A :class:`LeaseState` that reports every claim it hands out, and counts terms."""

    process: SimSidecar

    # This lease's terms so far in this process (each acquisition begins one).
    term = 0

    def update(self, event: str | None = None, **changes: Any) -> Any:
        # The application asks right before every change of the facts: the latest claim
        # the facts that end now can hand out (an application that polls without pause
        # would get it), so the checker sees each term's claims at their longest.
        self.claim()
        if event == "acquired":
            self.term += 1
        facts = super().update(event, **changes)
        if not facts.holding or facts.released:
            # This lease's claims stopped: its documented window (if open) ends.
            self.process.checker.excuse(self.process.name, (self.lease,), False)
        if event:
            self.process.world.trace(f"{self.process.name} {event} {self.lease}: token "
                                     f"{facts.fencing_token}, {facts.reason}")
        return facts

    def claim(self) -> Claim:
        claim = super().claim()
        if claim.leader and claim.valid_until is not None and not self.process.dead:
            process = self.process
            now = process.world.now()
            process.checker.now = now
            process.checker.claimed(process.name, self.lease, self.term,
                                    claim.facts.fencing_token, now,
                                    claim.valid_until - process.clock.mono_offset)
        return claim


class SimSidecar(Endpoint):
    def __init__(self, world: World, checker: Checker, identity: str, instance: int,
                 host: Host, settings: Settings, entry: BackendEntry) -> None:
        # The checker tells instances apart: a restarted sidecar (or a second process
        # under the same identity) is another process whose claims may not overlap.
        super().__init__(f"{identity}#{instance}", host)
        self.identity = identity
        self.world = world
        self.checker = checker
        self.settings = replace(settings, identity=identity)
        # Seconds since its host booted, as CLOCK_MONOTONIC counts (never negative).
        self.clock = SimClock(world.loop, host, world.rng.uniform(0, 1e6))
        self._entry = entry
        self.app_ready = True
        self.backend: Backend | None = None
        self.states: list[RecordingState] = []  # the lease names', then the shards'
        self.electors: list[Elector] = []  # the lease names' (the shards' are the manager's)
        self.shards: ShardManager | None = None
        self.electing: list[asyncio.Task[None]] = []
        self.apps: list[asyncio.Task[None]] = []
        self.exited = False
        self.stopping = False
        self.context = in_process(self)

    # -- life -------------------------------------------------------------------------
    def start(self) -> None:
        self.world.loop.create_task(self._start(), context=self.context)

    async def _start(self) -> None:
        settings = self.settings
        self.backend = backend = self._entry.create(settings, self.clock)
        for name in settings.names:
            state = self._state(name)
            elector = Elector(backend.lease(name), state, settings.timing,
                              settings.identity, (), sits_out=self._sits_out)
            self.electors.append(elector)
            self.electing.append(asyncio.create_task(elector.run()))
        if settings.shards:
            assert self._entry.shard_group is not None
            group = self._entry.shard_group(backend, settings, self.clock,
                                            settings.store.key(settings.name))

            def shard_elector(lease: Lease, state: LeaseState,
                              successor: Callable[[], Awaitable[str | None]]) -> Elector:
                return Elector(lease, state, settings.timing, settings.identity, (),
                               sits_out=self._sits_out, shutdown_successor=successor)

            self.shards = ShardManager(group, {n: self._state(n) for n in settings.shards},
                                       settings.identity, settings.timing, self.clock,
                                       shard_elector, ready=self._sits_out)
            await self.shards.start()
        self.apps = [asyncio.create_task(self._app(state)) for state in self.states]

    def leases_locked_by(self, locks: Collection[int]) -> list[str]:
        """This process's leases (names and shards) whose advisory lock keys are among
        ``locks``."""
        key = self.settings.store.key
        return [state.lease for state in self.states if lock_id(key(state.lease)) in locks]

    def _state(self, name: str) -> RecordingState:
        settings = self.settings
        state = RecordingState(lease=name, identity=settings.identity, role=settings.role,
                               claim_horizon=settings.timing.claim_horizon, clock=self.clock)
        state.process = self
        self.states.append(state)
        return state

    def _sits_out(self) -> str | None:
        return None if self.app_ready else "the application is not ready"

    async def _app(self, state: LeaseState) -> None:
        """The application: asks for a claim every so often, and at each moment the claim
        rule can flip with no change of the facts (a term's first claim, the end of its
        validity); :meth:`RecordingState.update` asks before every change."""
        rng = self.world.rng
        while not self.stopping:
            claim = state.claim()
            wait = rng.uniform(0.05, 0.3) if claim.leader else rng.uniform(0.3, 2.0)
            now = self.clock.monotonic()
            flip = state.facts.next_flip(now)
            if flip is not None:
                wait = min(wait, max(0.0, flip - now))
            await asyncio.sleep(wait)

    def stop(self) -> None:
        """SIGTERM: every elector steps down (unpublish, wait out claims, release), then
        the backend closes and the process exits."""
        self.world.loop.create_task(self._stop(), context=self.context)

    async def _stop(self) -> None:
        self.stopping = True
        # As the runtime does: the shards are handed over while the leases step down.
        shards = asyncio.ensure_future(self.shards.stop()) if self.shards else None
        for elector in self.electors:
            elector.stop()
        tasks = (*self.electing, *self.apps)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if shards is not None:
            with contextlib.suppress(Exception):
                await shards
        if self.backend is not None:
            with contextlib.suppress(Exception):
                await self.backend.close()
        self.exited = True
        self.died()

    def kill(self) -> None:
        """SIGKILL: nothing of the process runs again; the kernel closes its sockets."""
        self.died()
        self.exited = True
        self.held.clear()
        for server in self.world.servers:
            server.client_gone(self)

    def freeze(self) -> None:
        self.frozen = True

    def thaw(self) -> None:
        self.frozen = False
        self.world.loop.thaw(self)

    def cut_off(self) -> None:
        self.partitioned = True
        self.partitioned_since = self.world.now()
        for server in self.world.servers:
            server.cut(self)

    def reconnect(self) -> None:
        self.partitioned = False
        self.partitioned_since = None

    def leads(self) -> bool:
        now = self.clock.monotonic()
        return any(state.facts.leads_at(now) for state in self.states)
