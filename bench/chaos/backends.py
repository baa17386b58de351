"""Backend environments: how the harness gets a backend, points sidecars at it, breaks
it, and how long a leader may be missing after each fault.

An environment knows its backend's faults (a local SQLite file has no network path
and no server to restart) and its liveness bounds. Bounds are generous but finite and
derived from the timing settings, so a short-lease run has short bounds:

- ``base`` = lease duration + 2 renew intervals + one claim horizon + 1 s slack: a dead,
  frozen or cut-off holder's lease runs out (TTL) and a standby's next retry (every
  renew interval, ±20 % jitter) takes it and publishes; slack absorbs CPU contention
  on a 2-core machine with five sidecars, a recorder and a database;
- latency: plus twice the added delay (the holder's last renew and release are late);
- backend restart: plus the time the server was down and one capped retry backoff
  (the elector backs off up to one lease duration, ±20 %);
- advisory locks: plus the renew deadline (a silent holder is detected by deadline and
  by the server's idle-session timeout rather than by a TTL).

Test beds are imported lazily, so a sqlite run never imports asyncpg.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.chaos.faults import NETWORK_FAULTS, PROCESS_FAULTS, Fault
from bench.chaos.proxy import Proxy

if TYPE_CHECKING:
    from tests.testbed.postgres import PgServer

SLACK = 1.0


@dataclass(frozen=True)
class Timing:
    """The sidecars' lease settings (short, so many faults fit in a run)."""

    lease_duration: float = 2.0
    renew_interval: float = 0.3
    renew_deadline: float = 1.5
    claim_horizon: float = 0.1
    safety_margin: float = 0.5

    def args(self) -> list[str]:
        return ["--lease-duration", f"{self.lease_duration}s",
                "--renew-interval", f"{self.renew_interval}s",
                "--renew-deadline", f"{self.renew_deadline}s",
                "--claim-horizon", f"{self.claim_horizon}s",
                "--safety-margin", f"{self.safety_margin}s"]


class BackendEnv:
    """Base: a backend with no network path and no server (override what applies)."""

    name = ""
    faults: tuple[str, ...] = PROCESS_FAULTS

    def __init__(self, timing: Timing) -> None:
        self.timing = timing

    async def setup(self, workdir: Path, sidecars: int) -> None:
        """Provision the backend for ``sidecars`` contenders."""

    def sidecar_env(self, index: int) -> dict[str, str]:
        """Environment of sidecar ``index`` (LEASE_BACKEND, LEASE_DSN, ...)."""
        raise NotImplementedError

    def proxy(self, index: int) -> Proxy | None:
        return None

    async def restart(self, down_for: float) -> None:
        raise NotImplementedError(f"{self.name} has no server to restart")

    async def teardown(self) -> None:
        """Release everything ``setup`` made."""

    def bound(self, fault: Fault) -> float:
        t = self.timing
        bound = t.lease_duration + 2 * t.renew_interval + t.claim_horizon + SLACK
        if fault.kind == "latency":
            bound += 2 * fault.params["delay"]
        if fault.kind == "backend-restart" and fault.ended is not None:
            bound += (fault.ended - fault.at) + 1.2 * t.lease_duration
        return bound


class SqliteEnv(BackendEnv):
    name = "sqlite"

    async def setup(self, workdir: Path, sidecars: int) -> None:
        self.path = workdir / "leases.sqlite3"

    def sidecar_env(self, index: int) -> dict[str, str]:
        return {"LEASE_BACKEND": "sqlite", "LEASE_DSN": str(self.path)}

    def bound(self, fault: Fault) -> float:
        # A process frozen inside its (millisecond) write transaction holds SQLite's file
        # lock, so nobody can acquire until it resumes: sqlite's documented limit.
        bound = super().bound(fault)
        if fault.kind == "sigstop":
            bound += fault.params["stopped_for"]
        return bound


class PostgresEnv(BackendEnv):
    """``postgres`` (advisory lock) or ``postgres-row`` against a real PostgreSQL.

    Uses the given test-bed server (the pytest ``pg`` fixture) or starts its own. Every
    sidecar reaches the server through its own :class:`Proxy`, so network faults hit one
    contender; ``restart`` is an immediate (crash) stop and a start.
    """

    faults = PROCESS_FAULTS + NETWORK_FAULTS + ("backend-restart",)

    def __init__(self, backend: str, timing: Timing, server: PgServer | None = None) -> None:
        super().__init__(timing)
        self.name = backend
        self.server = server
        self._owns_server = server is None
        self.proxies: list[Proxy] = []
        self.database = f"chaos_{uuid.uuid4().hex[:10]}"

    async def setup(self, workdir: Path, sidecars: int) -> None:
        from tests.testbed.postgres import HOST, PgServer

        if self.server is None:
            self.server = await asyncio.to_thread(lambda: PgServer().init())
        server = self.server
        await asyncio.to_thread(server.create_database, self.database)
        self.proxies = [await Proxy((HOST, server.port)).start() for _ in range(sidecars)]
        await asyncio.to_thread(self._apply_schema)

    def _dsn(self, port: int) -> str:
        from tests.testbed.postgres import HOST, TEST_ROLE

        assert self.server is not None
        return (f"postgresql://{TEST_ROLE}:{self.server.password}@{HOST}:{port}/"
                f"{self.database}")

    def _apply_schema(self) -> None:
        """Provision the table once, directly (not through a proxy), if there is one."""
        if self.name != "postgres-row":
            return
        assert self.server is not None
        env = {**os.environ, "LEASE_BACKEND": self.name,
               "LEASE_DSN": self._dsn(self.server.port)}
        result = subprocess.run([sys.executable, "-m", "sidecar", "schema", "--apply"],
                                env=env, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"schema --apply failed: {result.stderr.strip()}")

    def sidecar_env(self, index: int) -> dict[str, str]:
        return {"LEASE_BACKEND": self.name, "LEASE_DSN": self._dsn(self.proxies[index].port)}

    def proxy(self, index: int) -> Proxy | None:
        return self.proxies[index]

    async def restart(self, down_for: float) -> None:
        assert self.server is not None
        await asyncio.to_thread(self.server.stop, "immediate")
        await asyncio.sleep(down_for)
        await asyncio.to_thread(self.server.start)

    async def teardown(self) -> None:
        for proxy in self.proxies:
            await proxy.close()
        if self._owns_server and self.server is not None:
            await asyncio.to_thread(self.server.destroy)

    def bound(self, fault: Fault) -> float:
        bound = super().bound(fault)
        if self.name == "postgres":
            bound += self.timing.renew_deadline
        return bound


def make_env(backend: str, timing: Timing, server: PgServer | None = None) -> BackendEnv:
    if backend == "sqlite":
        return SqliteEnv(timing)
    if backend in ("postgres", "postgres-row"):
        return PostgresEnv(backend, timing, server)
    raise ValueError(f"no chaos environment for backend {backend!r}")
