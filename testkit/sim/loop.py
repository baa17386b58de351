"""An asyncio event loop on a virtual clock, where each simulated process can be frozen
or killed.

Time moves only when every ready callback has run: the loop then jumps to the next
timer. Nothing touches the outside world (no sockets, no threads): the models of the
servers answer through :class:`~testkit.sim.world.World`'s simulated network, and
``run_in_executor`` (SQLite's and pyodbc's worker threads) runs the function at a later
virtual instant the world chooses.

Each callback the loop schedules belongs to the simulated process whose context it was
scheduled from (the :data:`PROCESS` context variable, inherited by every task and
callback a process creates). A frozen process (SIGSTOP) keeps its callbacks until it is
thawed; a killed one (SIGKILL) never runs another. The servers' models run in the world's
context (:data:`PROCESS` unset) and are never held back.

Hand-written rather than async-solipsism (GPL-3.0) or looptime (which polls the real
selector and idles dozens of loop cycles per step of time, far too slow for a million
faults): the fake selector is a dozen lines, and the gate is ours anyway.
"""

from __future__ import annotations

import asyncio
import contextvars
import selectors
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

# Virtual seconds one turn of the loop takes.
TURN = 1e-6


class Gate:
    """What the loop asks of a simulated process before running one of its callbacks."""

    frozen: bool = False
    dead: bool = False

    def __init__(self) -> None:
        # Callbacks due while frozen, with their handle (a handle cancelled meanwhile,
        # such as an ``asyncio.timeout`` left before the thaw, is skipped).
        self.held: list[tuple[_Slot, Callable[..., object], tuple[Any, ...],
                              contextvars.Context]] = []


# The simulated process a task or callback belongs to; None: the world (servers, faults).
PROCESS: contextvars.ContextVar[Gate | None] = contextvars.ContextVar("sim_process",
                                                                      default=None)


class _Selector(selectors.BaseSelector):
    """Nothing is ever ready: ``select(timeout)`` only moves the virtual clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, id(fileobj), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError("the simulation has nothing left to run (every task waits "
                               "forever)")
        self.now += timeout
        return []

    def get_map(self) -> Any:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class SimLoop(asyncio.SelectorEventLoop):
    """The loop of one simulation; ``executor_call`` decides when executor work runs."""

    def __init__(self) -> None:
        self._fake = _Selector()
        super().__init__(self._fake)
        self._clock_resolution = 1e-9
        # (process, function) -> future: set by the world (latency, lost replies).
        self.executor_call: Callable[[Gate | None, Callable[[], Any]],
                                     asyncio.Future[Any]] | None = None

    def time(self) -> float:
        return self._fake.now

    def _run_once(self) -> None:
        # Running callbacks takes time: each turn of the loop costs a microsecond. Code
        # that waits until exactly monotonic T (converted through a process's clock
        # offset, T may sit an ulp beyond any loop time) then sees T pass, as it does on
        # a real clock, instead of waking at the same instant forever.
        self._fake.now += TURN
        super()._run_once()  # type: ignore[misc]  # private in typeshed, there at runtime

    # -- every callback passes the gate of the process it belongs to ------------------
    def call_soon(self, callback: Callable[..., object], *args: Any,
                  context: contextvars.Context | None = None) -> asyncio.Handle:
        owner = PROCESS.get() if context is None else context.get(PROCESS)
        if owner is None:
            return super().call_soon(callback, *args, context=context)
        slot = _Slot()
        slot.handle = super().call_soon(_gated, owner, slot, callback, args, context=context)
        return slot.handle

    def call_at(self, when: float, callback: Callable[..., object], *args: Any,
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        owner = PROCESS.get() if context is None else context.get(PROCESS)
        if owner is None:
            return super().call_at(when, callback, *args, context=context)
        slot = _Slot()
        slot.handle = super().call_at(when, _gated, owner, slot, callback, args,
                                      context=context)
        return slot.handle

    def thaw(self, gate: Gate) -> None:
        """Run what a process's freeze held back, in the order it came."""
        held, gate.held = gate.held, []
        for slot, callback, args, context in held:
            if not slot.handle.cancelled():
                super().call_soon(_gated, gate, slot, callback, args, context=context)

    def run_in_executor(self, executor: Executor | None, func: Callable[..., Any],
                        *args: Any) -> asyncio.Future[Any]:
        assert self.executor_call is not None, "the world sets executor_call"
        return self.executor_call(PROCESS.get(), lambda: func(*args))

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any,
                             context: contextvars.Context | None = None) -> asyncio.Handle:
        return self.call_soon(callback, *args, context=context)


class _Slot:
    """The handle a gated callback runs under, so that the gate can tell it was cancelled
    (an ``asyncio.timeout`` left before a frozen process thawed cancels its timer handle,
    which had already fired into the freeze). Not a reference from the handle to itself:
    asyncio's debug mode prints handles."""

    __slots__ = ("handle",)
    handle: asyncio.Handle

    def __repr__(self) -> str:
        return "<gated>"


def _gated(owner: Gate, slot: _Slot, callback: Callable[..., object],
           args: tuple[Any, ...]) -> None:
    if owner.dead or slot.handle.cancelled():
        return
    if owner.frozen:
        owner.held.append((slot, callback, args, contextvars.copy_context()))
        return
    callback(*args)
