"""Each backend's part of a simulation run: the models it talks to, behind the seam its
driver uses, and the faults only those servers have."""

from __future__ import annotations

import random
from collections.abc import Callable

from sidecar.lease.postgres_advisory import session as advisory_session
from sidecar.lease.sql import asyncpg_driver
from testkit.sim import pg
from testkit.sim.loop import PROCESS
from testkit.sim.scenario import Fault, Run, Setup
from testkit.sim.world import Endpoint, World


def _endpoint() -> Endpoint | None:
    owner = PROCESS.get()
    return owner if isinstance(owner, Endpoint) else None


# -- PostgreSQL (both backends) ------------------------------------------------------------
def _postgres(world: World, backend: str) -> Setup:
    cluster = pg.Cluster(world)
    world.servers.append(cluster)
    fake = pg.FakeAsyncpg({"pg": cluster}, _endpoint)
    rng = world.rng
    # The cluster's configuration for this run: what users set that the sidecar must
    # survive. Each drawn once per run from the seed.
    if rng.random() < 0.3:
        cluster.role_settings["synchronous_commit"] = "off"
    if rng.random() < 0.2:
        cluster.role_settings["statement_timeout"] = "50ms"
    if rng.random() < 0.2:
        cluster.role_settings["idle_session_timeout"] = "1500ms"
    sync_standby = rng.random() < 0.3

    def crash(run: Run, rng: random.Random) -> None:
        down = rng.uniform(0.2, 8)
        world.fault("pg-restart", f"down {down:.2f}s")
        cluster.crash_restart(down)

    def failover(run: Run, rng: random.Random) -> None:
        cluster.standby_lag = rng.choice((0.0, 0.01, 0.3, 1.5))
        down = rng.uniform(0.5, 6)
        world.fault("pg-failover", f"lag {cluster.standby_lag}s down {down:.2f}s")
        cluster.failover(down)

    def upgrade(run: Run, rng: random.Random) -> None:
        down = rng.uniform(2, 20)
        world.fault("pg-upgrade", f"down {down:.2f}s")
        cluster.pg_upgrade(down)

    def terminate(run: Run, rng: random.Random) -> None:
        server = cluster.server
        if server is None or not server.sessions:
            return
        pid = rng.choice(sorted(server.sessions))
        world.fault("pg-terminate", f"pid {pid}")
        cluster.terminate_backend(pid)

    def stall(run: Run, rng: random.Random) -> None:
        seconds = rng.expovariate(1 / rng.choice((0.5, 5.0)))
        world.fault("pg-sync-standby-stall", f"{seconds:.2f}s")
        cluster.sync_standby_stalled_until = max(cluster.sync_standby_stalled_until,
                                                 world.now() + seconds)

    faults: list[Fault] = [(1.0, "pg-restart", crash), (0.7, "pg-failover", failover),
                           (0.1, "pg-upgrade", upgrade), (2.0, "pg-terminate", terminate)]
    if sync_standby:
        faults.append((2.0, "pg-sync-standby-stall", stall))

    def heal() -> None:
        cluster.sync_standby_stalled_until = float("-inf")

    return Setup(env={"LEASE_DSN": "postgresql://sim/pg"}, faults=faults, heal=heal,
                 patches=[(advisory_session, "asyncpg", fake), (asyncpg_driver, "asyncpg", fake)])


def postgres(world: World) -> Setup:
    return _postgres(world, "postgres")


def postgres_row(world: World) -> Setup:
    return _postgres(world, "postgres-row")


SETUPS: dict[str, Callable[[World], Setup]] = {
    "postgres": postgres,
    "postgres-row": postgres_row,
}
