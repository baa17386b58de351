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
  by the server's idle-session timeout rather than by a TTL);
- failover (PostgreSQL): plus the fault's own time (lag, handovers, kill, promote) and
  the new holder's wait on a new timeline (renew deadline or lease duration);
- kubernetes: the lease duration is whole seconds on the wire (rounded up), and a
  standby counts it on its own clock from when it last saw the Lease change, so ``base``
  uses the rounded value; an apiserver restart is down time plus the apiserver's own
  start-up (``ended`` is when /readyz answers again) plus the capped backoff.

Test beds are imported lazily, so a sqlite run never imports asyncpg.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.lease import backend_entry
from testkit.chaos.faults import NETWORK_FAULTS, PROCESS_FAULTS, Fault
from testkit.chaos.proxy import Proxy

if TYPE_CHECKING:
    from testkit.testbed.kube import ControlPlane
    from testkit.testbed.pg_failover import PgFailover
    from testkit.testbed.postgres import PgServer

SLACK = 1.0
# How late a live advisory-lock holder may learn that its session ended (the RST on
# loopback takes milliseconds; this leaves room for a loaded machine).
ADVISORY_NOTICE_BOUND = 0.05

# The lease every chaos sidecar contends for (the harness passes it as --name).
LEASE_NAME = "chaos"


@dataclass(frozen=True)
class ChaosTiming:
    """The sidecars' lease settings (short, so many faults fit in a run)."""

    lease_duration: float = 2.0
    renew_interval: float = 0.3
    renew_deadline: float = 1.5
    claim_horizon: float = 0.1
    safety_margin: float = 0.5

    @staticmethod
    def default_margin(backend: str) -> float:
        """The short margin, or the least the backend accepts where that is more (its
        entry holds the rule and the reason)."""
        least = backend_entry(backend).min_safety_margin
        return max(ChaosTiming.safety_margin, least[0] if least else 0.0)

    @classmethod
    def for_backend(cls, backend: str) -> ChaosTiming:
        return cls(safety_margin=cls.default_margin(backend))

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

    def __init__(self, timing: ChaosTiming) -> None:
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

    async def foreign_write(self, edit: str, standby: str) -> None:
        """Write the lease as someone other than a sidecar would (``FOREIGN_EDITS``;
        ``standby``: an identity for "holder-to-standby")."""
        raise NotImplementedError(f"{self.name} has no foreign-write fault")

    async def lag(self) -> None:
        raise NotImplementedError(f"{self.name} has no standby")

    async def fail_over(self, promote_after: float) -> int:
        """Kill the primary, promote the standby; the new timeline."""
        raise NotImplementedError(f"{self.name} has no standby")

    async def teardown(self) -> None:
        """Release everything ``setup`` made."""

    def overlap_bound(self, fault: Fault) -> float:
        """The overlap this backend documents for ``fault``; none by default."""
        return 0.0

    def bound(self, fault: Fault) -> float:
        t = self.timing
        bound = t.lease_duration + 2 * t.renew_interval + t.claim_horizon + SLACK
        if fault.kind == "latency":
            bound += 2 * fault.params["delay"]
        if fault.kind == "backend-restart" and fault.ended is not None:
            bound += (fault.ended - fault.at) + 1.2 * t.lease_duration
        if fault.kind == "foreign-write":
            # The next term waits out the previous holder's possible claims (one lease).
            bound += t.lease_duration
        if fault.kind == "failover" and fault.ended is not None:
            bound += (fault.ended - fault.at) + 1.2 * t.lease_duration + t.lease_duration
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

    Uses the given test-bed server (the pytest ``pg`` fixture) or starts its own: then a
    primary with an asynchronous streaming standby (:class:`PgFailover`), and the
    ``failover`` fault too. Sidecars reach the server one of two ways (``style``):

    - ``proxy``: each through its own :class:`Proxy`, so network faults hit one
      contender; a failover black-holes every open connection (the old primary drops off
      the network without a word), kills the primary, promotes the standby and points
      the proxies at it;
    - ``multi-host``: a DSN naming both servers with
      ``target_session_attrs=read-write`` (no proxy, no network faults); a failover
      kills the primary and promotes the standby.

    ``restart`` is an immediate (crash) stop and a start. ``lag`` stops the standby's WAL
    receiver: what the primary commits from then on is lost at the failover.
    """

    def __init__(self, backend: str, timing: ChaosTiming, server: PgServer | None = None,
                 style: str = "proxy") -> None:
        super().__init__(timing)
        if style not in ("proxy", "multi-host"):
            raise ValueError(f"unknown connection style {style!r}")
        self.name = backend
        self.style = style
        self._server = server
        self.cluster: PgFailover | None = None
        self._owns_server = server is None
        network = NETWORK_FAULTS if style == "proxy" else ()
        self.faults = (PROCESS_FAULTS + network + ("backend-restart",)
                       + (("failover",) if self._owns_server else ()))
        self.proxies: list[Proxy] = []
        self.database = f"chaos_{uuid.uuid4().hex[:10]}"

    @property
    def server(self) -> PgServer | None:
        """The primary now."""
        return self.cluster.primary if self.cluster is not None else self._server

    async def setup(self, workdir: Path, sidecars: int) -> None:
        from testkit.testbed.pg_failover import PgFailover
        from testkit.testbed.postgres import HOST

        if self._owns_server:
            self.cluster = await asyncio.to_thread(lambda: PgFailover().start())
            await asyncio.to_thread(self.cluster.create_database, self.database)
        else:
            assert self._server is not None
            await asyncio.to_thread(self._server.create_database, self.database)
        server = self.server
        assert server is not None
        if self.style == "proxy":
            self.proxies = [await Proxy((HOST, server.port)).start() for _ in range(sidecars)]
        await asyncio.to_thread(self._apply_schema)

    def _dsn(self, port: int) -> str:
        from testkit.testbed.postgres import HOST, TEST_ROLE

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
        if self.style == "multi-host":
            assert self.cluster is not None
            dsn = self.cluster.multi_host_dsn(self.database)
        else:
            dsn = self._dsn(self.proxies[index].port)
        return {"LEASE_BACKEND": self.name, "LEASE_DSN": dsn}

    def proxy(self, index: int) -> Proxy | None:
        return self.proxies[index] if self.proxies else None

    async def lag(self) -> None:
        assert self.cluster is not None, "failover needs a server of the harness's own"
        await asyncio.to_thread(self.cluster.lag)

    async def fail_over(self, promote_after: float) -> int:
        from testkit.testbed.postgres import HOST

        assert self.cluster is not None, "failover needs a server of the harness's own"
        for proxy in self.proxies:
            proxy.blackhole()
        await asyncio.to_thread(self.cluster.kill_primary)
        await asyncio.sleep(promote_after)
        primary = await asyncio.to_thread(self.cluster.promote)
        for proxy in self.proxies:
            proxy.retarget((HOST, primary.port))
        return await asyncio.to_thread(self.cluster.timeline)

    async def restart(self, down_for: float) -> None:
        assert self.server is not None
        await asyncio.to_thread(self.server.stop, "immediate")
        await asyncio.sleep(down_for)
        await asyncio.to_thread(self.server.start)

    async def teardown(self) -> None:
        for proxy in self.proxies:
            await proxy.close()
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.destroy)

    def bound(self, fault: Fault) -> float:
        bound = super().bound(fault)
        if self.name == "postgres":
            bound += self.timing.renew_deadline
        return bound

    def overlap_bound(self, fault: Fault) -> float:
        """The advisory lock's documented window (docs/backends.md): when the
        server or the network ends the holder's session, the lock passes at once while
        the holder stops claiming only when the termination reaches it."""
        if self.name == "postgres" and fault.kind in ("cut", "backend-restart"):
            return ADVISORY_NOTICE_BOUND
        return 0.0


class KubeEnv(BackendEnv):
    """``kubernetes``: a coordination.k8s.io/v1 Lease on the test bed's real apiserver.

    Uses the given ``ControlPlane`` (the pytest ``control_plane`` fixture) or starts its
    own. Each run gets a fresh namespace with deploy/rbac.yaml applied, and every sidecar
    runs as that ServiceAccount with its own kubeconfig whose server is its own
    :class:`Proxy` (TLS passes through unchanged; the serving certificate has 127.0.0.1
    as an IP SAN, so the client verifies it via the proxy's address). The pod label is
    off: no Pod objects exist, and label publishing is not what this harness judges.
    ``restart`` kills kube-apiserver hard and starts it on the same port and etcd.
    """

    name = "kubernetes"
    faults = PROCESS_FAULTS + NETWORK_FAULTS + ("backend-restart", "foreign-write")
    service_account = "lease-sidecar"  # the one deploy/rbac.yaml creates

    def __init__(self, timing: ChaosTiming, control_plane: ControlPlane | None = None) -> None:
        super().__init__(timing)
        self.cp = control_plane
        self._owns_cp = control_plane is None
        self.proxies: list[Proxy] = []
        self.kubeconfigs: list[Path] = []
        self.namespace = ""

    async def setup(self, workdir: Path, sidecars: int) -> None:
        from testkit.testbed.kube import ControlPlane

        if self.cp is None:
            self.cp = ControlPlane()
            await asyncio.to_thread(self.cp.start)
        cp = self.cp
        self.namespace = await asyncio.to_thread(cp.create_namespace, "chaos")
        token = await asyncio.to_thread(self._install_rbac)
        self.proxies = [await Proxy(("127.0.0.1", cp.apiserver_port)).start()
                        for _ in range(sidecars)]
        self.kubeconfigs = [self._write_kubeconfig(workdir, i, token) for i in range(sidecars)]

    def _install_rbac(self) -> str:
        """Apply the shipped Role (naming the chaos Lease); return a token of its
        ServiceAccount."""
        from testkit.kube_support import rbac_manifest

        assert self.cp is not None
        self.cp.kubectl("-n", self.namespace, "apply", "-f", "-",
                        input=rbac_manifest((f"lease-sidecar.{LEASE_NAME}",)))
        # Outlives any run (the long run is 40 min at most).
        return self.cp.service_account_token(self.namespace, self.service_account, "4h")

    def _write_kubeconfig(self, workdir: Path, index: int, token: str) -> Path:
        from testkit.testbed.kube import render_kubeconfig

        assert self.cp is not None
        user = f"system:serviceaccount:{self.namespace}:{self.service_account}"
        path = workdir / f"chaos-{index}.kubeconfig"
        path.write_text(render_kubeconfig(f"https://127.0.0.1:{self.proxies[index].port}",
                                          self.cp.ca_cert, user, {"token": token},
                                          self.namespace))
        path.chmod(0o600)
        return path

    def sidecar_env(self, index: int) -> dict[str, str]:
        return {"LEASE_BACKEND": "kubernetes", "LEASE_POD_LABEL": "off",
                "KUBECONFIG": str(self.kubeconfigs[index]), "POD_NAMESPACE": self.namespace}

    def proxy(self, index: int) -> Proxy | None:
        return self.proxies[index]

    async def restart(self, down_for: float) -> None:
        assert self.cp is not None
        await asyncio.to_thread(self.cp.kill_apiserver)
        await asyncio.sleep(down_for)
        await asyncio.to_thread(self.cp.start_apiserver)

    async def foreign_write(self, edit: str, standby: str) -> None:
        """kubectl, as admin, edits or deletes the Lease (deploy/rbac.yaml grants the
        sidecars create, so one of them re-creates a deleted Lease)."""

        assert self.cp is not None
        name = f"lease-sidecar.{LEASE_NAME}"
        if edit == "deleted":
            args = ["delete", "lease", name, "--ignore-not-found"]
        else:
            spec = {"holder-cleared": {"holderIdentity": None},
                    "holder-to-standby": {"holderIdentity": standby},
                    "duration-1s": {"leaseDurationSeconds": 1}}[edit]
            args = ["patch", "lease", name, "--type", "merge",
                    "-p", json.dumps({"spec": spec})]
        await asyncio.to_thread(self.cp.kubectl, "-n", self.namespace, *args, check=False)

    async def teardown(self) -> None:
        for proxy in self.proxies:
            await proxy.close()
        # The namespace stays (no namespace controller would finish deleting it).
        if self._owns_cp and self.cp is not None:
            await asyncio.to_thread(self.cp.stop)

    def bound(self, fault: Fault) -> float:
        t = self.timing
        return super().bound(fault) + math.ceil(t.lease_duration) - t.lease_duration


def make_env(backend: str, timing: ChaosTiming, server: PgServer | None = None,
             control_plane: ControlPlane | None = None, style: str = "proxy") -> BackendEnv:
    """``style``: how PostgreSQL sidecars connect (:class:`PostgresEnv`)."""
    if backend == "sqlite":
        return SqliteEnv(timing)
    if backend in ("postgres", "postgres-row"):
        return PostgresEnv(backend, timing, server, style)
    if backend == "kubernetes":
        return KubeEnv(timing, control_plane)
    raise ValueError(f"no chaos environment for backend {backend!r}")
