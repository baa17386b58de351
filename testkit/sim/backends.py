"""Each backend's part of a simulation run: the models it talks to, behind the seam its
driver uses, and the faults only those servers have."""

from __future__ import annotations

import asyncio
import random
import shutil
import sqlite3
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncinotify import Mask

from sidecar.lease.kubernetes import record as kube_record
from sidecar.lease.kubernetes import transport as kube_transport
from sidecar.lease.postgres_advisory import session as advisory_session
from sidecar.lease.sql import asyncpg_driver, pyodbc_driver
from sidecar.lease.sqlite import file_identity
from sidecar.lease.sqlite import store as sqlite_store
from sidecar.lease.sqlite import watch as sqlite_watch
from testkit.sim import kube, mssql, pg
from testkit.sim.loop import PROCESS
from testkit.sim.scenario import Fault, Run, Setup
from testkit.sim.world import Endpoint, Host, World


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
        if world.now() - cluster.upgraded_at < 60:
            # An upgraded cluster runs a while before its standbys lag behind commits
            # again: a promotion that lost the first commits after a pg_upgrade, then a
            # second pg_upgrade before any later token, could repeat the lost era's
            # tokens (outside the fault model, docs/design.md).
            return
        cluster.standby_lag = rng.choice((0.0, 0.01, 0.3, 1.5))
        down = rng.uniform(0.5, 6)
        world.fault("pg-failover", f"lag {cluster.standby_lag}s down {down:.2f}s")
        cluster.failover(down)

    def upgrade(run: Run, rng: random.Random) -> None:
        down = rng.uniform(2, 20)
        world.fault("pg-upgrade", f"down {down:.2f}s")
        cluster.pg_upgrade(down)

    def terminate(run: Run, rng: random.Random) -> None:
        """pg_terminate_backend of a session whose client can hear of it. (Of one that
        cannot, the server frees the lock while its holder claims on until its renew
        deadline: outside the fault model, docs/design.md.)"""
        server = cluster.server
        reachable = sorted(pid for pid, session in server.sessions.items()
                           if session.endpoint is None or not session.endpoint.partitioned
                           ) if server is not None else []
        if not reachable:
            return
        pid = rng.choice(reachable)
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
                 patches=[(advisory_session, "asyncpg", fake), (asyncpg_driver, "asyncpg", fake)],
                 models={"cluster": cluster}, leader_possible=cluster.tokens_left)


def postgres(world: World) -> Setup:
    return _postgres(world, "postgres")


def postgres_row(world: World) -> Setup:
    return _postgres(world, "postgres-row")


# -- Kubernetes -------------------------------------------------------------------------
# Values a person may write into the annotations the sidecar reads (never a release record
# that matches a term: a hand-forged release is outside the fault model, docs/design.md).
ODD_VALUES = ("2026-12-01T10:00:00", "2026-12-01T10:00:00Z", "garbage", "", " ", "-1",
              "9999-12-31T23:59:59.999999Z", "0001-01-01T00:00:00+14:00", "1e309", "true")


def kubernetes(world: World) -> Setup:
    server = kube.ApiServer(world)
    world.servers.append(server)
    client = kube.fake_client_class(server, _endpoint)
    rng = world.rng
    saved: list[dict[str, Any]] = []
    lease_seconds = [15]  # the sidecars' lease duration, as they write it

    def lease_name(run: Run) -> str:
        return run.settings.store.key(run.settings.name)

    def edit(kind: str, change: Callable[[dict[str, Any]], None]) -> Fault:
        def inject(run: Run, rng: random.Random) -> None:
            name = lease_name(run)
            current = server.objects.get(name)
            if current is not None and rng.random() < 0.3:
                saved.append(kube.copy.deepcopy(current))
            if server.edit(name, change):
                world.fault(f"edit-{kind}", name)
        return 1.0, f"edit-{kind}", inject

    def spec(obj: dict[str, Any]) -> dict[str, Any]:
        return obj.setdefault("spec", {})

    def annotations(obj: dict[str, Any]) -> dict[str, str]:
        return obj["metadata"].setdefault("annotations", {})

    def clear(obj: dict[str, Any]) -> None:
        spec(obj)["holderIdentity"] = ""

    def holder(obj: dict[str, Any]) -> None:
        spec(obj)["holderIdentity"] = rng.choice(("p1", "p2", "p3", "someone-else"))

    def duration(obj: dict[str, Any]) -> None:
        spec(obj)["leaseDurationSeconds"] = rng.choice((1, 2, 5, 60, 3600))

    def transitions_down(obj: dict[str, Any]) -> None:
        spec(obj)["leaseTransitions"] = rng.randrange(0, max(1, spec(obj).get(
            "leaseTransitions") or 1))

    def transitions_huge(obj: dict[str, Any]) -> None:
        spec(obj)["leaseTransitions"] = rng.choice((1 << 20, 2**31 - 1))

    def odd_annotation(obj: dict[str, Any]) -> None:
        key = rng.choice((kube_record.HINT_ANNOTATION, kube_record.HINT_UNTIL_ANNOTATION,
                          kube_record.RELEASED_ANNOTATION))
        annotations(obj)[key] = rng.choice(ODD_VALUES)

    def naive_until(obj: dict[str, Any]) -> None:
        annotations(obj)[kube_record.HINT_ANNOTATION] = rng.choice(("p1", "p2", "p3"))
        annotations(obj)[kube_record.HINT_UNTIL_ANNOTATION] = "2026-12-01T10:00:00"

    def delete(run: Run, rng: random.Random) -> None:
        name = lease_name(run)
        if name in server.objects:
            world.fault("edit-delete", name)
            server.delete(name)

    def recreate_empty(run: Run, rng: random.Random) -> None:
        name = lease_name(run)
        world.fault("edit-recreate-empty", name)
        server.delete(name)
        server.create(name, {"metadata": {"name": name}, "spec": {}})

    def apply_saved(run: Run, rng: random.Random) -> None:
        """``kubectl apply`` of a manifest saved earlier: its spec and annotations come
        back (without a release record), on the same object."""
        name = lease_name(run)
        # A release applied again while its holder lives is a forged release, outside
        # the fault model (docs/design.md): only held or cleared manifests come back.
        held = [o for o in saved if not kube_record.Record.from_object(o).released]
        if not held or name not in server.objects:
            return
        old = rng.choice(held)

        def restore(obj: dict[str, Any]) -> None:
            obj["spec"] = kube.copy.deepcopy(old.get("spec") or {})
            kept = dict(old["metadata"].get("annotations") or {})
            kept.pop(kube_record.RELEASED_ANNOTATION, None)
            obj["metadata"]["annotations"] = kept
        if server.edit(name, restore):
            world.fault("edit-apply-saved", name)

    def stall(run: Run, rng: random.Random) -> None:
        if not server.watches:
            return
        watch = rng.choice(server.watches)
        seconds = rng.expovariate(1 / rng.choice((1.0, 10.0, 60.0)))
        world.fault("watch-stall", f"{watch.endpoint.name if watch.endpoint else ''} "
                                   f"{seconds:.2f}s")
        server.stall(watch, seconds)

    def lag(run: Run, rng: random.Random) -> None:
        if not server.watches:
            return
        watch = rng.choice(server.watches)
        watch.lag = rng.choice((0.0, 0.2, 2.0, 8.0))
        world.fault("watch-lag", f"{watch.lag}s")

    def break_watch(run: Run, rng: random.Random) -> None:
        if server.watches:
            world.fault("watch-break")
            server.end_watch(rng.choice(server.watches))

    def compact(run: Run, rng: random.Random) -> None:
        world.fault("etcd-compaction")
        server.compact()

    def outage(run: Run, rng: random.Random) -> None:
        seconds = rng.expovariate(1 / rng.choice((0.5, 5.0)))
        world.fault("apiserver-down", f"{seconds:.2f}s")
        server.up = False

        def back() -> None:
            server.up = True
        run.undo(seconds, back)

    faults: list[Fault] = [
        edit("clear-holder", clear), edit("set-holder", holder),
        edit("duration", duration), edit("transitions-down", transitions_down),
        (0.2, "edit-transitions-huge", edit("transitions-huge", transitions_huge)[2]),
        edit("odd-annotation", odd_annotation), edit("naive-until", naive_until),
        (0.5, "edit-delete", delete), (0.3, "edit-recreate-empty", recreate_empty),
        (0.5, "edit-apply-saved", apply_saved),
        (2.0, "watch-stall", stall), (1.0, "watch-lag", lag),
        (1.0, "watch-break", break_watch), (0.5, "etcd-compaction", compact),
        (1.0, "apiserver-down", outage),
    ]

    def heal() -> None:
        server.up = True
        for watch in server.watches:
            watch.lag = 0.0
        # The person who set a duration by hand writes it back: the group must lead
        # again within its bound of that fix (a holder named by hand that never renews
        # is waited out like a dead one).
        for name, obj in list(server.objects.items()):
            duration = (obj.get("spec") or {}).get("leaseDurationSeconds")
            if duration is not None and duration != lease_seconds[0]:
                server.edit(name, lambda o: o["spec"].update(
                    leaseDurationSeconds=lease_seconds[0]))

    return Setup(env={"POD_NAMESPACE": server.namespace}, faults=faults, heal=heal,
                 patches=[(kube_transport, "KubeClient", client)], models={"apiserver": server})


# -- SQL Server -------------------------------------------------------------------------------
def sqlserver(world: World) -> Setup:
    server = mssql.SqlServer(world)
    world.servers.append(server)

    def restart(run: Run, rng: random.Random) -> None:
        down = rng.uniform(0.2, 8)
        world.fault("mssql-restart", f"down {down:.2f}s")
        server.up = False

        def back() -> None:
            server.up = True
        world.later(down, back)

    def heal() -> None:
        server.up = True

    return Setup(env={"LEASE_DSN": "Server=sim;Database=lease;UID=lease;PWD=secret"},
                 faults=[(1.0, "mssql-restart", restart)], heal=heal,
                 patches=[(pyodbc_driver, "pyodbc", mssql.fake_pyodbc(server, _endpoint)),
                          (pyodbc_driver, "threading", mssql.fake_threading())],
                 models={"server": server})


# -- SQLite -------------------------------------------------------------------------------------
class _CommitEvents:
    """The database file's side of the processes. inotify on its directory, for the
    simulated loop (it has no file descriptors): every commit on the file, by any
    connection, reaches each open watch as the event a real commit ends with, its
    rollback journal deleted. Polling instead (the fallback where inotify is missing)
    cost the loop ten wake-ups a second per standby and left the production path
    untested."""

    def __init__(self, basename: str) -> None:
        self._journal = basename + "-journal"
        # In the order they opened (a dict, not a set: a set of objects iterates in
        # the order of their addresses, which differ from run to run, and the order the
        # standbys hear of a commit decides which of them acquires first).
        self._open: dict[_Watch, None] = {}
        # Each process's connections: its kernel closes them when it is killed (and
        # with them its locks on the file), as the servers' models drop its sockets.
        self._connections: dict[Endpoint, list[sqlite3.Connection]] = {}

    def opened(self, conn: sqlite3.Connection) -> None:
        if (owner := _endpoint()) is not None:
            self._connections.setdefault(owner, []).append(conn)

    def client_gone(self, endpoint: Endpoint) -> None:
        for conn in self._connections.pop(endpoint, []):
            conn.close()

    def cut(self, endpoint: Endpoint) -> None:
        pass  # a file on the same host: nothing between the process and it

    def open(self, commit_watch: Any) -> _Watch:
        watch = _Watch(self._open)
        commit_watch._open_watches.add(watch)
        return watch

    def committed(self) -> None:
        event = _Event(self._journal, Mask.DELETE)
        for watch in self._open:
            watch.events.put_nowait(event)


@dataclass(frozen=True)
class _Event:
    name: str
    mask: Mask


class _Watch:
    def __init__(self, registry: dict[_Watch, None]) -> None:
        self.events: asyncio.Queue[_Event] = asyncio.Queue()
        self._registry = registry
        registry[self] = None

    async def get(self) -> _Event:
        return await self.events.get()

    def close(self) -> None:
        self._registry.pop(self, None)


class _HostTime:
    """``time`` for the SQLite file guard (its token floor and hold-off read the wall
    clock): the simulated host's, so a replay draws the same tokens."""

    def __init__(self, world: World, host: Host) -> None:
        self._world = world
        self._host = host

    def time(self) -> float:
        return self._host.wall(self._world.now())

    def time_ns(self) -> int:
        return int(self.time() * 1e9)


class _SqliteOnHostClock:
    """``sqlite3`` for the store: real SQLite on a real file, whose ``julianday('now')``
    reads the simulated host's wall clock (SQLite lets a function of the application
    replace a built-in one of the same name and arity), and whose commits the simulated
    inotify hears of."""

    def __init__(self, world: World, host: Host, events: _CommitEvents) -> None:
        self._world = world
        self._host = host
        self._events = events

    def __getattr__(self, name: str) -> Any:
        return getattr(sqlite3, name)

    def connect(self, *args: Any, **kwargs: Any) -> sqlite3.Connection:
        events = self._events

        class Heard(sqlite3.Connection):
            changes_before = 0  # rows changed before the open transaction began

            def execute(self, sql: str, *params: Any) -> sqlite3.Cursor:
                if not self.in_transaction:
                    self.changes_before = self.total_changes
                try:
                    return super().execute(sql, *params)
                finally:
                    # A commit that wrote nothing leaves no journal to delete: no event.
                    if not self.in_transaction and self.total_changes != self.changes_before:
                        events.committed()

        conn = sqlite3.connect(*args, **kwargs, factory=Heard)
        events.opened(conn)
        # Weakly: SQLite holds the function where the garbage collector cannot see it,
        # and a strong reference kept every finished run's world alive (500 MB a run).
        world, host = weakref.ref(self._world), self._host

        def julianday(value: str) -> float | None:
            if value != "now":
                return None
            alive = world()
            if alive is None:  # the run has ended; nothing reads this answer
                return None
            return host.wall(alive.now()) / 86400.0 + 2440587.5
        conn.create_function("julianday", 1, julianday)
        return conn


def sqlite(world: World) -> Setup:
    host = Host("host")
    directory = tempfile.mkdtemp(prefix="lease-sim-")
    weakref.finalize(world, shutil.rmtree, directory, True)
    events = _CommitEvents("leases.db")
    world.servers.append(events)

    def heard_commits(watch: sqlite_watch.CommitWatch) -> _Watch:
        return events.open(watch)  # in place of CommitWatch._open: a method, bound to watch

    return Setup(env={"LEASE_DSN": f"{directory}/leases.db"}, one_host=True, host=host,
                 # One file on one host: no network between the sidecars and the store;
                 # its wall clock steps forward by less than the safety margin (beyond
                 # that, claims may overlap: docs/backends.md says so).
                 excluded=frozenset({"partition", "lost-replies"}), max_forward_step=0.5,
                 wall_clock_leases=True,
                 patches=[(sqlite_store, "sqlite3", _SqliteOnHostClock(world, host, events)),
                          (file_identity, "time", _HostTime(world, host)),
                          (sqlite_watch.CommitWatch, "_open", heard_commits)])


SETUPS: dict[str, Callable[[World], Setup]] = {
    "sqlite": sqlite,
    "sqlserver": sqlserver,
    "postgres": postgres,
    "postgres-row": postgres_row,
    "kubernetes": kubernetes,
}
