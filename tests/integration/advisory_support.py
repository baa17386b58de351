"""What the ``postgres`` (advisory lock) tests share: fast timing, the backend as the
registry builds it, and who holds the lock by ``pg_locks``."""

from __future__ import annotations

from sidecar.base.clock import SystemClock
from sidecar.lease.postgres_advisory import AdvisoryBackend, create
from sidecar.lease.postgres_advisory.sql import lock_halves, lock_id
from sidecar.settings import Settings, StoreSettings, Timing
from testkit.testbed.postgres import PgServer

LEASE, RENEW, DEADLINE, HORIZON = 3.0, 0.3, 2.0, 0.25
FAST = ["--lease-duration", f"{LEASE}s", "--renew-interval", f"{RENEW}s",
        "--renew-deadline", f"{DEADLINE}s", "--claim-horizon", f"{HORIZON}s"]


def settings(dsn: str, identity: str) -> Settings:
    return Settings(store=StoreSettings(backend="postgres", dsn=dsn), identity=identity,
                    names=("jobs",),
                    timing=Timing(lease_duration=LEASE, renew_interval=RENEW,
                                  renew_deadline=DEADLINE, claim_horizon=HORIZON,
                                  holds_by="session"))


def advisory(dsn: str, identity: str) -> AdvisoryBackend:
    """The backend as the registry builds it."""
    return create(settings(dsn, identity), SystemClock())


def lock_holders(pg: PgServer, database: str, name: str = "jobs") -> list[int]:
    """Server pids whose session holds the lock of lease ``name``."""
    classid, objid = lock_halves(lock_id(StoreSettings().key(name)))
    out = pg.psql(f"select pid from pg_locks where locktype = 'advisory' and granted "
                  f"and classid = {classid} and objid = {objid} and objsubid = 1",
                  dbname=database)
    return [int(pid) for pid in out.split()]
