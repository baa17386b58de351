"""The simulated world: one virtual clock, a seeded random source, hosts with their own
wall clocks, and the network between the processes and the servers' models.

Everything random is drawn from ``World.rng``, seeded once, and the loop runs callbacks
in a deterministic order: a seed replays the same run, step by step (``trace``).

The network is a function call with two delays. A request reaches the server after one
latency (unless the link drops it), the server's model acts on it *then* — whatever the
client does meanwhile — and the reply reaches the client after another latency (unless
the link drops it: the client's own timeout then ends its wait, and a commit whose reply
was lost has still happened). Latencies are milliseconds, with rare spikes of seconds
while a fault says so.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from testkit.sim.loop import PROCESS, Gate, SimLoop

T = TypeVar("T")
# How a server's model answers one request: ``reply(value, error)``.
Reply = Callable[[Any, BaseException | None], None]

# Wall time at virtual time 0: a plausible Unix time (late 2027), so that Lease objects,
# rows and tokens carry realistic values.
EPOCH = 1_825_000_000.0


class ConnectionLost(Exception):
    """The model's side of a broken connection: the fake drivers turn it into their
    library's own error."""


class Blocked(Exception):
    """Raised by a worker thread's call in the simulation: the thread waited ``seconds``
    (a lost request or reply, its driver's own timeout) and then failed with ``error``."""

    def __init__(self, error: BaseException, seconds: float) -> None:
        super().__init__(str(error))
        self.error = error
        self.seconds = seconds


@dataclass
class Host:
    """A machine's wall clock: virtual time plus an offset that clock steps move."""

    name: str
    offset: float = 0.0

    def wall(self, now: float) -> float:
        return EPOCH + now + self.offset


class SimClock:
    """A process's :class:`sidecar.base.clock.Clock`: monotonic time with an offset of
    its own (so code that mixes two clocks shows up), wall time from its host."""

    def __init__(self, loop: asyncio.AbstractEventLoop, host: Host, mono_offset: float) -> None:
        self._loop = loop
        self._host = host
        self.mono_offset = mono_offset

    def monotonic(self) -> float:
        return self._loop.time() + self.mono_offset

    def wall(self) -> float:
        return self._host.wall(self._loop.time())


class Endpoint(Gate):
    """A process's side of the network: its gate (frozen, dead) and its link."""

    def __init__(self, name: str, host: Host) -> None:
        super().__init__()
        self.name = name
        self.host = host
        # Requests and replies are dropped while cut off from every server (since when:
        # a server's keepalive gives up only on a cut that lasts).
        self.partitioned = False
        self.partitioned_since: float | None = None
        # Each request's reply is lost with this probability (the request still lands).
        self.lose_replies = 0.0
        # Extra seconds on each delivery while a slow-network fault lasts.
        self.extra_latency = 0.0
        # The answers to its calls: those it had no time to take when it died are marked
        # taken (:meth:`died`), not reported as errors of the sidecar's.
        self.answers: weakref.WeakSet[asyncio.Future[Any]] = weakref.WeakSet()

    def died(self) -> None:
        self.dead = True
        for future in list(self.answers):
            if future.done() and not future.cancelled():
                future.exception()


class World:
    def __init__(self, seed: int, trace: Callable[[str], None] | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        # The sidecar's own jitter draws from the module-level generator.
        random.seed(seed)
        self.loop = SimLoop()
        self.loop.executor_call = self._executor_call
        self.loop.set_exception_handler(self._unhandled)
        self._trace = trace
        self.context = contextvars.Context()  # the world's: PROCESS unset
        self.faults: Counter[str] = Counter()
        self.errors: list[str] = []

        # The servers' models: told when a client dies (its kernel closes its sockets)
        # or is cut off (``client_gone(endpoint)``, ``cut(endpoint)``).
        self.servers: list[Any] = []
        # Set by the run: ``excuse(endpoint, locks)`` opens a documented window in which
        # the process's claims of the leases whose advisory locks (keys) an ended session
        # held may overlap others' (the termination notice on its way); each lease's
        # window closes when its claims stop (:class:`testkit.sim.process.RecordingState`).
        self.excuse: Callable[[Endpoint, Collection[int]], None] = lambda endpoint, locks: None

    # -- time and scheduling ------------------------------------------------------------
    def now(self) -> float:
        return self.loop.time()

    def later(self, delay: float, callback: Callable[..., object],
              *args: Any) -> asyncio.TimerHandle:
        """Run ``callback`` in the world's context ``delay`` seconds from now."""
        return self.loop.call_at(self.now() + max(0.0, delay), callback, *args,
                                 context=self.context)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str = "") -> asyncio.Task[T]:
        """A task of the world's (a server's, the scheduler's)."""
        return self.loop.create_task(coro, name=name or None, context=self.context.copy())

    def trace(self, what: str) -> None:
        if self._trace is not None:
            self._trace(f"{self.now():11.4f}  {what}")

    def fault(self, kind: str, what: str = "") -> None:
        self.faults[kind] += 1
        if self._trace is not None:
            self.trace(f"FAULT {kind} {what}")

    # -- the network ----------------------------------------------------------------------
    def latency(self, endpoint: Endpoint | None) -> float:
        base = self.rng.uniform(0.0003, 0.004)
        if endpoint is not None and endpoint.extra_latency:
            base += self.rng.uniform(0, endpoint.extra_latency)
        return base

    def deliver(self, endpoint: Endpoint | None, at_server: Callable[[Reply], None],
                future: asyncio.Future[Any]) -> None:
        """Send one request: ``at_server(reply)`` runs at the server after a latency and
        calls ``reply(value, error)`` when it has an answer (at once, or later: a lock
        wait); the answer reaches ``future`` after another latency. A partitioned or dead
        endpoint's requests and replies vanish; so does a reply the link loses."""
        if endpoint is not None:
            endpoint.answers.add(future)
        if endpoint is not None and (endpoint.partitioned or endpoint.dead):
            return

        def reply(value: Any, error: BaseException | None = None) -> None:
            if endpoint is not None and (endpoint.partitioned or endpoint.dead):
                return
            if endpoint is not None and endpoint.lose_replies and \
                    self.rng.random() < endpoint.lose_replies:
                self.trace(f"reply to {endpoint.name} lost")
                return
            self.later(self.latency(endpoint), _settle, future, value, error, endpoint)

        self.later(self.latency(endpoint), at_server, reply)

    def _executor_call(self, owner: Gate | None,
                       func: Callable[[], Any]) -> asyncio.Future[Any]:
        """A worker thread's call (SQLite, pyodbc): it runs once the request is out, in
        the owner's context (a frozen process's threads are frozen too), and its result
        arrives a latency later."""
        future: asyncio.Future[Any] = self.loop.create_future()
        endpoint = owner if isinstance(owner, Endpoint) else None
        if endpoint is not None:
            endpoint.answers.add(future)

        def run() -> None:
            delay = self.latency(endpoint)
            try:
                value, error = func(), None
            except Blocked as blocked:
                value, error, delay = None, blocked.error, blocked.seconds
            except Exception as exc:
                value, error = None, exc
            self.later(delay, _settle, future, value, error, endpoint)

        self.loop.call_at(self.now() + self.latency(endpoint), run)
        return future

    def _unhandled(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = context.get("message", "")
        if "Task was destroyed but it is pending" in message:
            return  # a killed process's tasks, dropped with it
        exc = context.get("exception")
        if "never retrieved" in message and type(exc).__module__.startswith("asyncpg"):
            return  # a fake connection failing a query its dead or gone caller left
        if exc is not None and exc.__traceback__ is not None:
            import traceback
            where = "".join(traceback.format_tb(exc.__traceback__)[-3:])
            self.errors.append(f"{message}: {exc!r}\n{where}")
            return
        self.errors.append(f"{message}: {exc!r}" if exc else message)


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None,
            endpoint: Endpoint | None = None) -> None:
    if future.done() or (endpoint is not None and endpoint.dead):
        return  # nobody waits: a dead process's answer is lost with it
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def in_process(gate: Gate) -> contextvars.Context:
    """A context whose tasks and callbacks belong to ``gate``'s process."""
    context = contextvars.copy_context()
    context.run(PROCESS.set, gate)
    return context
