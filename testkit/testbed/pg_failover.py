"""A primary and an asynchronous streaming standby that fail over, again and again.

    with PgFailover() as cluster:
        dsn = cluster.multi_host_dsn(db)   # postgresql://…@h:p1,h:p2/db?target_session_attrs=read-write
        cluster.lag()                      # the standby stops receiving WAL
        ...                                # commits now never reach it
        cluster.fail_over()                # kill the primary (immediate), promote the standby

Two ports serve for ever: after a failover the next standby is built (``pg_basebackup
-R`` from the promoted server) on the failed primary's port, so one multi-host DSN naming
both stays right across any number of failovers. The servers live in one temp dir the
cluster owns.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from types import TracebackType

from testkit.testbed.postgres import HOST, TEST_ROLE, PgError, PgServer, PgStandby


class PgFailover:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="lease-pg-failover-"))
        self.primary: PgServer = PgServer(root=self.root, name="node0")
        self.standby: PgStandby | None = None
        self.failovers = 0
        self._spare_port: int | None = None
        self._nodes = 1

    def start(self) -> PgFailover:
        try:
            self.primary.init()
            self.ensure_standby()
        except BaseException:
            self.destroy()
            raise
        return self

    # -- addresses -----------------------------------------------------------------------
    @property
    def ports(self) -> tuple[int, ...]:
        """Both ports, the first server's first (the order a multi-host DSN names them)."""
        ports = [self.primary.port]
        if self.standby is not None:
            ports.append(self.standby.port)
        elif self._spare_port is not None:
            ports.append(self._spare_port)
        return tuple(sorted(ports))

    def multi_host_dsn(self, dbname: str) -> str:
        hosts = ",".join(f"{HOST}:{port}" for port in self.ports)
        return (f"postgresql://{TEST_ROLE}:{self.primary.password}@{hosts}/{dbname}"
                "?target_session_attrs=read-write")

    def create_database(self, dbname: str) -> None:
        self.primary.create_database(dbname)
        if self.standby is not None:
            self.standby.wait_replayed()

    # -- the failover --------------------------------------------------------------------
    def ensure_standby(self) -> PgStandby:
        """A streaming standby of the primary, caught up (built if there is none)."""
        if self.standby is None:
            self.standby = PgStandby(self.primary, name=f"node{self._nodes}",
                                     port=self._spare_port).init()
            self._nodes += 1
        self.standby.wait_replayed()
        return self.standby

    def lag(self) -> None:
        """From now on the standby receives nothing (it was caught up until now)."""
        self.ensure_standby().stop_receiving()

    def kill_primary(self) -> None:
        """A crash: ``pg_ctl stop -m immediate``; its data is removed."""
        old = self.primary
        old.stop("immediate")
        self._spare_port = old.port
        shutil.rmtree(old.data, ignore_errors=True)

    def promote(self) -> PgServer:
        """Promote the standby (a new timeline); it is the primary from now on."""
        if self.standby is None:
            raise PgError("no standby to promote")
        self.standby.promote()
        self.primary, self.standby = self.standby, None
        self.failovers += 1
        return self.primary

    def fail_over(self, promote_after: float = 0.2) -> PgServer:
        self.kill_primary()
        time.sleep(promote_after)
        return self.promote()

    def timeline(self) -> int:
        """The primary's timeline (as the sidecars read it: its current WAL file)."""
        return int(self.primary.psql(
            "select ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int"))

    # -- lifecycle -----------------------------------------------------------------------
    def destroy(self) -> None:
        for server in (self.primary, self.standby):
            if server is not None:
                server.destroy()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgFailover:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.destroy()
