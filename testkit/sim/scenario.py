"""The seeded scheduler: phases of faults, each followed by a quiet phase that heals
everything and checks that someone leads again within the backend's bound.

A run is ``(backend, seed, faults)``. The seed picks everything: the variant of the
servers' configuration for each episode, which fault comes when, to whom, for how long,
and every latency. Faults, drawn from the backend's menu and the common one:

- a process frozen (SIGSTOP) for milliseconds to two lease durations;
- a process killed (SIGKILL) or stopped (SIGTERM), and started again (same identity, a new
  process) a little later;
- a process cut off from every server, replies lost, a slow network;
- its application not ready (it sits out), a hand-over or a release asked of it;
- a host's wall clock stepped;
- and the servers' own: restarts, failovers, watches that stall, hand edits, ...
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import random
import sys
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

from sidecar import config
from sidecar.lease import backend_entry
from sidecar.settings import Settings
from testkit.sim.checks import Checker, Verdict
from testkit.sim.process import SimSidecar
from testkit.sim.world import Endpoint, Host, World

# A fault: (weight, kind, inject(run, rng) -> None).
Fault = tuple[float, str, Callable[["Run", random.Random], None]]


@dataclass
class Setup:
    """What one backend brings to a run: its models, its settings, its faults."""

    env: dict[str, str]
    faults: list[Fault] = field(default_factory=list)
    # Seconds after the faults stop within which someone must lead again.
    bound: Callable[[Settings], float] = lambda s: 3 * s.timing.lease_duration + 10
    # Called at the start of each quiet phase: the servers healed.
    heal: Callable[[], None] = lambda: None
    # Module attributes replaced for the run: (module, name, value).
    patches: list[tuple[Any, str, Any]] = field(default_factory=list)
    # One wall clock for every process (SQLite coordinates one host): this one.
    one_host: bool = False
    host: Host | None = None
    # Common faults that do not apply (no network between the sidecars and the store).
    excluded: frozenset[str] = frozenset()
    # The largest forward step of a host's wall clock the backend's guarantee allows.
    max_forward_step: float = math.inf
    # Leases expire by the hosts' wall clock (SQLite): a step back lengthens them by as
    # much, and the liveness bound with them.
    wall_clock_leases: bool = False
    # The models by name ("cluster", "apiserver", ...), for scripted tests.
    models: dict[str, Any] = field(default_factory=dict)
    # Whether the servers still allow a leader (False: by design nobody may hold, e.g. a
    # cluster whose fencing tokens are used up); the quiet phase's liveness check skips
    # then, the safety checks stay.
    leader_possible: Callable[[], bool] = lambda: True


@dataclass
class Result:
    backend: str
    seed: int
    faults: int
    simulated: float
    verdict: Verdict
    by_kind: dict[str, int]
    errors: list[str]


class Run:
    PROCESSES = 3

    def __init__(self, backend: str, seed: int, faults: int,
                 setup: Callable[[World], Setup],
                 trace: Callable[[str], None] | None = None,
                 exclude: frozenset[str] = frozenset(),
                 env: dict[str, str] | None = None) -> None:
        self.backend = backend
        self.exclude = exclude
        self.world = World(seed, trace)
        self.checker = Checker()
        self.world.excuse = self._excuse
        self.checker.trace = self.world.trace if trace is not None else None
        self.target = faults
        self.setup = setup(self.world)
        self.entry = backend_entry(backend)
        rng = self.world.rng
        # Now and then a sidecar holds two lease names, each judged on its own; on a
        # backend that holds shards, a quarter of the runs add a shard set (each shard a
        # lease of its own, campaigned for by the member the assignment names).
        variant = {"LEASE_NAME": "default,reports"} if rng.random() < 0.2 else {}
        if self.entry.shard_group is not None and rng.random() < 0.25:
            variant["LEASE_SHARDS"] = str(rng.randint(2, 6))
        self.settings = config.load(env={"LEASE_BACKEND": backend, "LEASE_IDENTITY": "sim",
                                         **variant, **self.setup.env, **(env or {})})
        shared = self.setup.host or Host("host")
        self.hosts = {f"p{i}": shared if self.setup.one_host else Host(f"host-{i}")
                      for i in range(1, self.PROCESSES + 1)}
        self.instances: dict[str, int] = dict.fromkeys(self.hosts, 0)
        self.live: dict[str, SimSidecar] = {}
        # Every instance ever started: a killed one's tasks stay referenced (never run,
        # never collected mid-run) until the run ends.
        self.every: list[SimSidecar] = []
        self.generation = 0  # undos of an earlier phase's faults do nothing
        self.stepped_back = 0.0  # seconds the hosts' wall clocks went back this phase

    # -- processes --------------------------------------------------------------------
    def _excuse(self, endpoint: Endpoint, locks: Collection[int]) -> None:
        if isinstance(endpoint, SimSidecar):
            self.checker.excuse(endpoint.name, endpoint.leases_locked_by(locks), True)

    def start(self, identity: str) -> SimSidecar:
        self.instances[identity] += 1
        process = SimSidecar(self.world, self.checker, identity, self.instances[identity],
                             self.hosts[identity], self.settings, self.entry)
        self.live[identity] = process
        self.every.append(process)
        self.world.trace(f"start {process.name}")
        process.start()
        return process

    def pick(self, rng: random.Random) -> SimSidecar | None:
        alive = [p for p in self.live.values() if not p.dead]
        return rng.choice(alive) if alive else None

    def leader(self) -> SimSidecar | None:
        leading = [p for p in self.live.values() if not p.dead and p.leads()]
        return leading[0] if leading else None

    def undo(self, delay: float, action: Callable[[], None]) -> None:
        """Run ``action`` after ``delay`` unless a quiet phase healed everything first."""
        generation = self.generation

        def run() -> None:
            if self.generation == generation:
                action()
        self.world.later(delay, run)

    # -- the run ----------------------------------------------------------------------
    def execute(self, script: Callable[[Run], Awaitable[None]] | None = None) -> Result:
        """Run the seeded schedule of faults, or ``script`` (a scripted scenario: it
        drives the run itself, from three started processes)."""
        with _patched(self.setup.patches):
            loop = self.world.loop
            main = self._schedule() if script is None else self._scripted(script)
            try:
                loop.run_until_complete(self.world.spawn(main))
            finally:
                _end(loop, self.every)
        world = self.world
        return Result(self.backend, world.seed, sum(world.faults.values()), world.now(),
                      self.checker.verdict, dict(world.faults), world.errors)

    async def _scripted(self, script: Callable[[Run], Awaitable[None]]) -> None:
        for identity in self.hosts:
            self.start(identity)
        await script(self)

    async def until(self, condition: Callable[[], object], timeout: float,
                    step: float = 0.01) -> None:
        """Wait (simulated time) until ``condition()`` holds; AssertionError after
        ``timeout`` seconds."""
        deadline = self.world.now() + timeout
        while not condition():
            if self.world.now() >= deadline:
                raise AssertionError(f"not within {timeout}s of simulated time")
            await asyncio.sleep(step)

    async def _schedule(self) -> None:
        world, rng = self.world, self.world.rng
        for identity in self.hosts:
            self.start(identity)
        bound = self.setup.bound(self.settings)
        skipped = self.exclude | self.setup.excluded
        menu = [f for f in (*common_faults(), *self.setup.faults) if f[1] not in skipped]
        weights = [weight for weight, _, _ in menu]
        while sum(world.faults.values()) < self.target and not self.checker.verdict.violations:
            phase_end = world.now() + rng.uniform(20, 120)
            rate = rng.choice((0.5, 2.0, 5.0, 20.0))  # faults per second in this phase
            while world.now() < phase_end and sum(world.faults.values()) < self.target:
                await asyncio.sleep(rng.expovariate(rate))
                inject = rng.choices(menu, weights)[0][2]
                inject(self, rng)
            self._heal()
            self.checker.quiet_began(world.now(), (*self.settings.names, *self.settings.shards))
            world.trace("quiet: everything healed")
            wait = bound + (self.stepped_back if self.setup.wall_clock_leases else 0.0)
            self.stepped_back = 0.0
            # Until someone leads and a little after (renews, a release or two), at most
            # the bound: then the next phase of faults.
            ends = world.now() + wait
            while world.now() < ends and not self.checker.led_since_quiet():
                await asyncio.sleep(min(1.0, ends - world.now()))
                for identity, process in list(self.live.items()):
                    if process.exited:  # stopped during the faults, gone only now
                        self.start(identity).app_ready = process.app_ready
            await asyncio.sleep(min(5.0, max(0.0, ends - world.now())))
            self.checker.now = world.now()
            possible = self.setup.leader_possible()
            if not possible:
                world.trace("quiet: no leader expected (the servers allow none, by design)")
            self.checker.quiet_ended(world.now(), wait, leader_expected=possible)
            for process in self.live.values():
                if (shards := process.shards) is not None:
                    if shards.failure is not None:  # moves stopped: a liveness defect
                        world.errors.append(f"{process.name} shard group: {shards.failure}")
                    view = shards.view
                    world.trace(f"  {process.name} shard group: members {view.members}, ok "
                                f"{view.ok} {view.error}, assigned {shards.assigned()}, "
                                f"campaigning {sorted(shards.electors)}")
                for state in process.states:
                    facts = state.facts
                    world.trace(f"  {process.name} {state.lease}: holding {facts.holding}, "
                                f"claims from "
                                f"{facts.claim_from - process.clock.monotonic():+.2f}s, "
                                f"valid {facts.valid_until - process.clock.monotonic():+.2f}s,"
                                f" {facts.reason}")

    def _heal(self) -> None:
        self.generation += 1
        # Now and then one application stays not ready through the quiet phase: the
        # others must lead all the same (a lease granted to one that sits out must not
        # stay with it).
        unready = self.world.rng.choice(list(self.live)) \
            if self.world.rng.random() < 0.3 else None
        for identity, process in list(self.live.items()):
            if process.dead:
                process = self.start(identity)
            if process.frozen:
                process.thaw()
            process.reconnect()
            process.lose_replies = 0.0
            process.extra_latency = 0.0
            process.app_ready = identity != unready
        self.setup.heal()


# -- the common faults ----------------------------------------------------------------
def common_faults() -> list[Fault]:
    return [
        (6, "freeze", _freeze),
        (2, "kill", _kill),
        (2, "sigterm", _sigterm),
        (3, "partition", _partition),
        (4, "lost-replies", _lost_replies),
        (3, "slow-network", _slow),
        (2, "app-unready", _app_unready),
        (1, "handover", _handover),
        (1, "release", _release),
        (1, "clock-step", _clock_step),
    ]


def _duration(rng: random.Random, run: Run) -> float:
    """Milliseconds to two lease durations, mostly short."""
    lease = run.settings.timing.lease_duration
    return min(2 * lease, rng.expovariate(1 / rng.choice((0.2, 2.0, lease / 2))))


def _freeze(run: Run, rng: random.Random) -> None:
    process = run.pick(rng)
    if process is None or process.frozen:
        return
    seconds = _duration(rng, run)
    run.world.fault("freeze", f"{process.name} for {seconds:.3f}s")
    process.freeze()
    run.undo(seconds, process.thaw)


def _restart_later(run: Run, rng: random.Random, identity: str) -> None:
    run.undo(rng.uniform(0, 5), lambda: run.start(identity) if run.live[identity].dead else None)


def _kill(run: Run, rng: random.Random) -> None:
    process = run.pick(rng)
    if process is None:
        return
    run.world.fault("kill", process.name)
    process.kill()
    _restart_later(run, rng, process.identity)


def _sigterm(run: Run, rng: random.Random) -> None:
    process = run.pick(rng)
    if process is None or process.frozen:
        return
    run.world.fault("sigterm", process.name)
    process.stop()
    identity = process.identity

    def again() -> None:
        if run.live[identity].exited:
            run.start(identity)
    run.undo(rng.uniform(0.5, 8), again)


def _partition(run: Run, rng: random.Random) -> None:
    process = run.pick(rng)
    if process is None or process.partitioned:
        return
    seconds = _duration(rng, run)
    run.world.fault("partition", f"{process.name} for {seconds:.3f}s")
    process.cut_off()
    run.undo(seconds, process.reconnect)


def _lost_replies(run: Run, rng: random.Random) -> None:
    process = run.pick(rng)
    if process is None:
        return
    seconds = _duration(rng, run)
    share = rng.choice((0.1, 0.5, 1.0))
    run.world.fault("lost-replies", f"{process.name} {share:.0%} for {seconds:.3f}s")
    process.lose_replies = share

    def back() -> None:
        process.lose_replies = 0.0
    run.undo(seconds, back)


def _slow(run: Run, rng: random.Random) -> None:
    process = run.pick(rng)
    if process is None:
        return
    seconds = _duration(rng, run)
    extra = rng.choice((0.05, 0.5, 3.0))
    run.world.fault("slow-network", f"{process.name} +{extra}s for {seconds:.3f}s")
    process.extra_latency = extra

    def back() -> None:
        process.extra_latency = 0.0
    run.undo(seconds, back)


def _app_unready(run: Run, rng: random.Random) -> None:
    process = run.pick(rng)
    if process is None:
        return
    seconds = _duration(rng, run)
    run.world.fault("app-unready", f"{process.name} for {seconds:.3f}s")
    process.app_ready = False

    def back() -> None:
        process.app_ready = True
    run.undo(seconds, back)


def _handover(run: Run, rng: random.Random) -> None:
    leader = run.leader()
    if leader is None or leader.frozen:
        return
    others = [i for i in run.live if i != leader.identity]
    to = rng.choice([*others, None])
    run.world.fault("handover", f"{leader.name} to {to}")
    for elector in leader.electors:
        run.world.loop.call_soon(elector.request_handover, to, context=leader.context)


def _release(run: Run, rng: random.Random) -> None:
    leader = run.leader()
    if leader is None or leader.frozen:
        return
    run.world.fault("release", leader.name)
    for elector in leader.electors:
        run.world.loop.call_soon(elector.request_release, context=leader.context)


def _clock_step(run: Run, rng: random.Random) -> None:
    host = rng.choice(list(run.hosts.values()))
    step = rng.choice((-1, 1)) * rng.choice((0.05, 0.5, 5.0, 60.0))
    if step > run.setup.max_forward_step:
        step = -step
    # Where leases run on the hosts' wall clock, a step back lengthens the lease by as
    # much and nobody can take it meanwhile: past two lease durations back in a phase
    # the clock steps forward instead, or the run spends its time waiting steps out.
    if run.setup.wall_clock_leases and \
            run.stepped_back - step > 2 * run.settings.timing.lease_duration:
        step = min(-step, run.setup.max_forward_step)
    run.stepped_back += max(0.0, -step)
    run.world.fault("clock-step", f"{host.name} {step:+.2f}s")
    host.offset += step


def _end(loop: asyncio.AbstractEventLoop, processes: Any) -> None:
    """Every process dies with the run; their coroutines are closed while the loop is
    still open (their ``finally`` blocks find a loop that drops what they schedule)."""
    for process in processes:
        process.died()
    hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
    disabled = logging.root.manager.disable
    logging.disable(logging.CRITICAL)  # what the closed coroutines' handlers would log
    # What a finally block schedules with ensure_future lands on this loop, whose close
    # drops it; on the thread's default loop it kept every finished run alive.
    asyncio.set_event_loop(loop)
    try:
        closed: set[asyncio.Task[Any]] = set()
        while pending := asyncio.all_tasks(loop) - closed:  # a finally block's own tasks
            for task in pending:
                with contextlib.suppress(BaseException):
                    task.get_coro().close()  # type: ignore[union-attr]  # coroutines here
            closed |= pending
        with contextlib.suppress(Exception):
            loop.close()
        del processes
        gc.collect()
    finally:
        asyncio.set_event_loop(None)
        sys.unraisablehook = hook
        logging.disable(disabled)


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
