"""A TCP proxy the harness owns, between one sidecar and its network backend.

Each sidecar gets its own proxy (127.0.0.1 only), so a network fault hits exactly one
contender. Three faults:

- ``cut(seconds)``: abort every open connection (both sides see a reset) and refuse new
  ones for ``seconds`` — a crashed middlebox or a torn-down connection;
- ``add_latency(delay, seconds)``: hold every chunk ``delay`` seconds before forwarding
  it, in both directions — a slow or congested path;
- ``partition(seconds)``: stop forwarding (connections stay open, data is buffered) and
  deliver everything afterwards — a silent black hole that heals, the case where nobody
  sees a reset and only timeouts can tell;
- ``blackhole()`` then ``retarget(upstream)``: the connections open now go silent for
  good (not even the upstream's end reaches the client) while new ones go to another
  server — a database host that drops off the network, then a failover.

Why our own and not toxiproxy: it is ~100 lines of asyncio, needs no Go build, and the
harness can drive it directly on its one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib


class Proxy:
    def __init__(self, upstream: tuple[str, int], listen_host: str = "127.0.0.1") -> None:
        self._upstream = upstream
        self._host = listen_host
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._refuse_until = 0.0
        self._delay = 0.0
        self._delay_until = 0.0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._heal: asyncio.TimerHandle | None = None
        # One per open connection: cleared for good when it is black-holed.
        self._alive: set[asyncio.Event] = set()
        self.port = 0

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, self._host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._abort_all()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    # -- faults ------------------------------------------------------------------------
    def cut(self, seconds: float) -> int:
        """Reset every open connection and refuse new ones for ``seconds``; returns how
        many connections were cut."""
        loop = asyncio.get_running_loop()
        self._refuse_until = max(self._refuse_until, loop.time() + seconds)
        return self._abort_all()

    def add_latency(self, delay: float, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self._delay = delay
        self._delay_until = loop.time() + seconds

    def partition(self, seconds: float) -> None:
        self._flowing.clear()
        if self._heal is not None:
            self._heal.cancel()
        self._heal = asyncio.get_running_loop().call_later(seconds, self._flowing.set)

    def blackhole(self) -> int:
        """Silence every open connection for good; returns how many."""
        count = len(self._alive)
        for alive in self._alive:
            alive.clear()
        self._alive.clear()
        return count

    def retarget(self, upstream: tuple[str, int]) -> None:
        """New connections go to ``upstream``."""
        self._upstream = upstream

    @property
    def connections(self) -> int:
        return len(self._writers) // 2

    # -- plumbing ----------------------------------------------------------------------
    def _abort_all(self) -> int:
        count = self.connections
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        return count

    async def _accept(self, client_r: asyncio.StreamReader,
                      client_w: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() < self._refuse_until:
            client_w.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self._upstream)
        except OSError:
            # Backend down (restart fault): the client sees what it would see directly.
            client_w.transport.abort()
            return
        self._writers |= {client_w, up_w}
        alive = asyncio.Event()
        alive.set()
        self._alive.add(alive)
        pumps = [asyncio.create_task(self._pump(client_r, up_w, alive)),
                 asyncio.create_task(self._pump(up_r, client_w, alive))]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._alive.discard(alive)
            for task in pumps:
                task.cancel()
            for writer in (client_w, up_w):
                writer.transport.abort()
                self._writers.discard(writer)
            self._tasks.difference_update(pumps)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    alive: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if loop.time() < self._delay_until:
                    # Inline sleep keeps order; chunks queued meanwhile wait a bit longer.
                    await asyncio.sleep(self._delay)
                await self._flowing.wait()
                await alive.wait()
                writer.write(data)
                await writer.drain()
        if not alive.is_set():
            # Black-holed: the other side must not hear of this end either (until close).
            await asyncio.Event().wait()
