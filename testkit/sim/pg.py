"""A model of a PostgreSQL cluster, reached through a fake ``asyncpg``: the seam both
PostgreSQL backends (the advisory lock and the row lease) talk through.

The model knows the statements the sidecar sends, by their exact text (taken from the
sidecar's own modules, so a changed statement is a statement the model does not know,
and the run fails loudly), and gives them the semantics the sidecar relies on:

- sessions with their settings (``set_config``), a marker, ``application_name``, and the
  ways a session ends: the client closes or drops it (the server hears of it a latency
  later, unless the network is cut), ``idle_session_timeout`` while it is idle, TCP
  keepalive or ``tcp_user_timeout`` while the client cannot answer, a server crash,
  ``pg_terminate_backend``;
- session advisory locks that stack, try-locks, lock waits queued in order and granted
  on release, ``lock_timeout``, ``statement_timeout``, ``pg_cancel_backend``;
- transaction ids and a sequence that grow, timelines, and commits that are durable only
  once flushed: with ``synchronous_commit = off`` a commit is flushed up to
  3 x ``wal_writer_delay`` later, and a crash in between loses it (the counters and the
  rows go back with it; the sequence to its last logged value);
- a synchronous standby whose stall holds every commit's reply (the commit itself has
  happened: a client that gives up still changed the row);
- failover to a standby that lags (a new timeline, the last commits lost), restarts,
  ``pg_upgrade`` (timeline 1 again, transaction ids and sequences kept);
- the lease table's rows, with ``now()`` from the server's wall clock, the sweep,
  release records and NOTIFY.

What it leaves out: PgBouncer (the real one is tested), SQL it was not given, and
anything about plans, MVCC snapshots or row locks beyond "one statement at a time is
atomic" (each statement runs whole at one instant of the server's time).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import asyncpg
from asyncpg import exceptions as pgerr

from sidecar.lease import pg_session, pg_timeline
from sidecar.lease.postgres_advisory import group as adv_group
from sidecar.lease.postgres_advisory import handover as adv_hint
from sidecar.lease.postgres_advisory import sql as adv
from sidecar.lease.sql.dialect import PostgresDialect
from testkit.sim.world import Endpoint, Host, Reply, World, in_process

SERVER_VERSION = SimpleNamespace(major=15, minor=4, micro=0, releaselevel="final", serial=0)
VERSION_NUM = 150004
SEQ_LOG_VALS = 32  # a sequence's WAL record covers this many values ahead
WAL_WRITER_DELAY = 0.2


@dataclass
class LeaseRow:
    owner: str
    acquired_at: float
    renewed_at: float
    expires_at: float
    metadata: str | None
    version: int


@dataclass
class Data:
    """What survives a restart once flushed: the rows and the counters."""

    rows: dict[str, LeaseRow] = field(default_factory=dict)
    seq: int = 0  # the last value nextval() handed out
    seq_logged: int = 0  # the value the sequence's last WAL record covers
    next_xid: int = 1000
    # Small tables by name: the token era's (created, as `lease-sidecar schema` does).
    tables: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        pg_timeline.ERA_TABLE: {"base": 0, "highest": 0}})


@dataclass
class Commit:
    at: float
    durable_at: float
    data: Data


@dataclass
class Session:
    pid: int
    endpoint: Endpoint | None
    conn: FakeConnection | None
    settings: dict[str, str]
    started: float
    locks: dict[int, int] = field(default_factory=dict)  # lock id -> grants
    busy: bool = False
    pending: Reply | None = None
    waiting_for: int | None = None
    wait_timers: list[asyncio.TimerHandle] = field(default_factory=list)
    idle_timer: asyncio.TimerHandle | None = None
    listening: set[str] = field(default_factory=set)
    # What a granted lock wait resumes.
    lock_granted: Callable[[], None] | None = None
    ended: bool = False


class Server:
    """One postmaster: its sessions and locks live as long as it runs."""

    def __init__(self, cluster: Cluster, data: Data, timeline: int,
                 checkpoint: tuple[int, float]) -> None:
        self.cluster = cluster
        self.world = cluster.world
        self.data = data
        self.timeline = timeline
        self.started = self.world.now()
        # (timeline, true time) of the latest checkpoint.
        self.checkpoint = checkpoint
        self.up = True
        self.sessions: dict[int, Session] = {}
        self.holders: dict[int, int] = {}  # lock id -> pid
        self.queues: dict[int, deque[int]] = {}  # lock id -> waiting pids, in order

    # -- time -------------------------------------------------------------------------
    def wall(self) -> float:
        return self.cluster.host.wall(self.world.now())

    # -- sessions ---------------------------------------------------------------------
    def open_session(self, endpoint: Endpoint | None, conn: FakeConnection,
                     server_settings: dict[str, str]) -> Session:
        self.cluster.next_pid += 1
        settings = {**self.cluster.role_settings, **server_settings}
        session = Session(self.cluster.next_pid, endpoint, conn, settings, self.world.now())
        self.sessions[session.pid] = session
        self._arm_idle(session)
        return session

    def end_session(self, session: Session, why: BaseException | None,
                    tell_client: bool = True) -> None:
        """The session ends: its locks go (to the next waiter), its wait fails."""
        if session.ended:
            return
        session.ended = True
        self.sessions.pop(session.pid, None)
        self._cancel_timers(session)
        if session.idle_timer is not None:
            session.idle_timer.cancel()
        if session.waiting_for is not None:
            queue = self.queues.get(session.waiting_for)
            if queue is not None and session.pid in queue:
                queue.remove(session.pid)
            session.waiting_for = None
        held = list(session.locks)
        for lock in held:
            session.locks.pop(lock)
            self._unlocked(lock, session.pid)
        session.pending = None
        conn = session.conn
        if conn is not None and tell_client:
            error = why or pgerr.ConnectionDoesNotExistError(
                "connection was closed in the middle of operation")
            conn.server_ended(error, held)

    def crash(self) -> None:
        self.up = False
        for session in list(self.sessions.values()):
            self.end_session(session, pgerr.AdminShutdownError(
                "terminating connection due to administrator command"), tell_client=True)

    def _arm_idle(self, session: Session) -> None:
        if session.idle_timer is not None:
            session.idle_timer.cancel()
            session.idle_timer = None
        limit = _ms(session.settings.get("idle_session_timeout", "0"))
        if limit > 0:
            session.idle_timer = self.world.later(limit, self._idle_ended, session)

    def _idle_ended(self, session: Session) -> None:
        if not session.ended and not session.busy:
            self.world.trace(f"pg: idle_session_timeout ends pid {session.pid}")
            self.end_session(session, pgerr.IdleSessionTimeoutError(
                "terminating connection due to idle-session timeout"))

    def keepalive_deadline(self, session: Session) -> float:
        """Seconds of client silence after which the kernel ends the session."""
        s = session.settings
        idle = float(s.get("tcp_keepalives_idle", "7200") or 7200)
        interval = float(s.get("tcp_keepalives_interval", "75") or 75)
        count = float(s.get("tcp_keepalives_count", "9") or 9)
        deadline = idle + interval * count
        user = _ms(s.get("tcp_user_timeout", "0"))
        if session.busy and user > 0:
            deadline = min(deadline, user)
        return deadline

    # -- statements -------------------------------------------------------------------
    def execute(self, session: Session, sql: str, args: tuple[Any, ...],
                reply: Reply) -> None:
        if not self.up or session.ended:
            return  # the connection is gone: the client hears of it as a close
        handler = self.cluster.handlers.get(sql)
        if handler is None:
            raise AssertionError(f"the PostgreSQL model does not know this statement: "
                                 f"{' '.join(sql.split())[:160]}")
        session.busy = True
        if session.idle_timer is not None:
            session.idle_timer.cancel()
            session.idle_timer = None

        def answered(value: Any, error: BaseException | None = None) -> None:
            if session.ended:
                return
            session.busy = False
            session.pending = None
            self._cancel_timers(session)
            self._arm_idle(session)
            reply(value, error)

        session.pending = answered
        timeout = _ms(session.settings.get("statement_timeout", "0"))
        if timeout > 0:
            session.wait_timers.append(self.world.later(timeout, self._cancel, session,
                                                        "statement timeout"))
        try:
            handler(self, session, sql, args, answered)
        except pgerr.PostgresError as exc:
            answered(None, exc)

    def _cancel_timers(self, session: Session) -> None:
        for timer in session.wait_timers:
            timer.cancel()
        session.wait_timers.clear()

    def _cancel(self, session: Session, why: str) -> None:
        """A statement's wait ends: lock_timeout, statement_timeout, a cancel request."""
        answered = session.pending
        if answered is None or session.ended:
            return
        if session.waiting_for is not None:
            queue = self.queues.get(session.waiting_for)
            if queue is not None and session.pid in queue:
                queue.remove(session.pid)
            session.waiting_for = None
        if why == "lock timeout":
            answered(None, pgerr.LockNotAvailableError("canceling statement due to lock timeout"))
        elif why == "sync":
            # The commit has happened locally; only the wait for the standby ends.
            answered(None, pgerr.QueryCanceledError(
                "canceling wait for synchronous replication due to user request"))
        else:
            answered(None, pgerr.QueryCanceledError(f"canceling statement due to {why}"))

    def cancel_request(self, pid: int) -> None:
        session = self.sessions.get(pid)
        if session is not None and session.pending is not None:
            self._cancel(session, "sync" if session.waiting_for is None and session.busy
                         and self.cluster.sync_waits.get(pid) else "user request")

    # -- advisory locks ---------------------------------------------------------------
    def try_lock(self, session: Session, lock: int) -> bool:
        holder = self.holders.get(lock)
        if holder is not None and holder != session.pid:
            return False
        self._grant(session, lock)
        return True

    def _grant(self, session: Session, lock: int) -> None:
        self.holders[lock] = session.pid
        session.locks[lock] = session.locks.get(lock, 0) + 1

    def unlock(self, session: Session, lock: int) -> bool:
        if session.locks.get(lock, 0) <= 0:
            return False
        session.locks[lock] -= 1
        if session.locks[lock] == 0:
            del session.locks[lock]
            self._unlocked(lock, session.pid)
        return True

    def _unlocked(self, lock: int, pid: int) -> None:
        if self.holders.get(lock) != pid:
            return
        del self.holders[lock]
        queue = self.queues.get(lock)
        while queue:
            waiter = self.sessions.get(queue.popleft())
            if waiter is None or waiter.ended or waiter.waiting_for != lock:
                continue
            waiter.waiting_for = None
            self._grant(waiter, lock)
            if waiter.lock_granted is not None:
                waiter.lock_granted()
            return

    def wait_lock(self, session: Session, lock: int, granted: Callable[[], None],
                  lock_timeout: float) -> None:
        if self.try_lock(session, lock):
            granted()
            return
        session.waiting_for = lock
        session.lock_granted = granted
        self.queues.setdefault(lock, deque()).append(session.pid)
        if lock_timeout > 0:
            session.wait_timers.append(self.world.later(lock_timeout, self._cancel, session,
                                                        "lock timeout"))

    # -- transactions -----------------------------------------------------------------
    def commit(self, session: Session, answered: Reply, value: Any,
               mode: str | None = None) -> None:
        """The statement's transaction commits now; its reply waits for a synchronous
        standby where one is configured and the commit is not asynchronous. ``mode``:
        the transaction's own synchronous_commit, where the statement set one."""
        mode = mode or session.settings.get("synchronous_commit", "on")
        self.cluster.committed(mode)
        if mode != "off" and self.cluster.sync_standby_stalled_until > self.world.now():
            self.cluster.sync_waits[session.pid] = True

            def acked() -> None:
                self.cluster.sync_waits.pop(session.pid, None)
                if session.pending is answered:
                    answered(value)
            self.world.later(self.cluster.sync_standby_stalled_until - self.world.now(), acked)
            return
        answered(value)

    def xid(self) -> int:
        xid = self.data.next_xid
        self.data.next_xid += 1
        return xid

    def nextval(self) -> int:
        data = self.data
        data.seq += 1
        if data.seq > data.seq_logged:
            data.seq_logged = data.seq + SEQ_LOG_VALS
        return data.seq

    def notify(self, channel: str, payload: str) -> None:
        for session in list(self.sessions.values()):
            if channel in session.listening and session.conn is not None:
                session.conn.notified(channel, payload, session.pid)


class Cluster:
    """A primary and its standby, as one DSN reaches them."""

    def __init__(self, world: World, name: str = "pg") -> None:
        self.world = world
        self.name = name
        self.host = Host(f"{name}-host", offset=world.rng.uniform(-2.0, 2.0))
        self.role_settings: dict[str, str] = {}
        self.next_pid = 4000
        data = Data(next_xid=world.rng.randrange(1000, 100_000))
        self.timeline = 1
        self.server: Server | None = Server(self, data, 1, (1, world.now() - 3600))
        self.server.started = world.now() - 3600  # up for an hour when the run begins
        self.wal: list[Commit] = [Commit(world.now() - 3600, world.now() - 3600,
                                         copy.deepcopy(data))]
        # Seconds the standby's replay lags the primary's commits.
        self.standby_lag = 0.0
        self.upgraded_at = float("-inf")  # when the last pg_upgrade's cluster came up
        self.sync_standby_stalled_until = float("-inf")
        self.sync_waits: dict[int, bool] = {}
        self.handlers = _handlers()
        self.dialect = PostgresDialect()

    # -- the WAL: durability and replay ------------------------------------------------
    def committed(self, mode: str) -> None:
        now = self.world.now()
        durable = now if mode != "off" else now + self.world.rng.uniform(0, 3 * WAL_WRITER_DELAY)
        assert self.server is not None
        self.wal.append(Commit(now, durable, copy.deepcopy(self.server.data)))
        self._prune()

    def _prune(self) -> None:
        now = self.world.now()
        keep_from = 0
        for i, commit in enumerate(self.wal):
            # Keep what a lagging standby or an unflushed tail may still need.
            if commit.durable_at <= now and commit.at <= now - self.standby_lag - 1.0:
                keep_from = i
        if keep_from:
            del self.wal[:keep_from]

    def _survivor(self, at: float, replayed_by: float | None = None) -> Data:
        """The data a restart at ``at`` recovers (the flushed prefix), or a standby that
        replayed what was committed by ``replayed_by``."""
        best = self.wal[0]
        flushed = max((i for i, c in enumerate(self.wal) if c.durable_at <= at), default=0)
        for i, commit in enumerate(self.wal):
            if i > flushed:
                break
            if replayed_by is not None and commit.at > replayed_by:
                break
            best = commit
        data = copy.deepcopy(best.data)
        data.seq = data.seq_logged  # recovery restores a sequence to its logged value
        return data

    # -- operations on the cluster -----------------------------------------------------
    def crash_restart(self, down_for: float) -> None:
        """The primary crashes and comes back: unflushed commits are lost."""
        server = self.server
        if server is None:
            return
        now = self.world.now()
        server.crash()
        self.server = None
        data = self._survivor(now)

        def back() -> None:
            self.server = Server(self, data, self.timeline, (self.timeline, self.world.now()))
        self.world.later(down_for, back)

    def failover(self, down_for: float) -> None:
        """The primary dies; the standby, ``standby_lag`` behind, is promoted."""
        server = self.server
        if server is None:
            return
        now = self.world.now()
        server.crash()
        self.server = None
        data = self._survivor(now, replayed_by=now - self.standby_lag)
        self.timeline += 1
        timeline = self.timeline

        def promoted() -> None:
            old = self.wal[0].at
            self.server = Server(self, data, timeline, (timeline - 1, old))
            self.wal = [Commit(self.world.now(), self.world.now(), copy.deepcopy(data))]
            # The end-of-recovery checkpoint lands a little later, on the new timeline.
            server_now = self.server
            self.world.later(self.world.rng.uniform(0.5, 5.0), _checkpointed, server_now)
        self.world.later(down_for, promoted)

    def pg_upgrade(self, down_for: float) -> None:
        """``pg_upgrade`` to a new cluster: timeline 1, transaction ids and the data kept."""
        server = self.server
        if server is None:
            return
        self.upgraded_at = self.world.now() + down_for
        server.crash()  # a clean shutdown first; clients see their sessions end
        self.server = None
        data = copy.deepcopy(server.data)
        self.timeline = 1

        def upgraded() -> None:
            self.server = Server(self, data, 1, (1, self.world.now()))
            self.wal = [Commit(self.world.now(), self.world.now(), copy.deepcopy(data))]
        self.world.later(down_for, upgraded)

    def tokens_left(self) -> bool:
        """Whether a fencing token can still be drawn: the era (the timeline plus the era
        table's base, never below the highest era recorded) is below
        ``pg_timeline.TIMELINE_LIMIT``. Past it every sidecar refuses to hold, by design
        (a token would pass 2^53); a long run of failovers and upgrades gets there."""
        data = self.server.data if self.server is not None else self.wal[-1].data
        era = data.tables[pg_timeline.ERA_TABLE]
        return max(era["highest"], self.timeline + era["base"]) < pg_timeline.TIMELINE_LIMIT

    def terminate_backend(self, pid: int) -> bool:
        server = self.server
        session = server.sessions.get(pid) if server else None
        if server is None or session is None:
            return False
        server.end_session(session, pgerr.AdminShutdownError(
            "terminating connection due to administrator command"))
        return True

    def cut(self, endpoint: Endpoint) -> None:
        """The client is unreachable (partition, dead host): its sessions end once the
        server's keepalive (or tcp_user_timeout) gives up, unless it is back by then."""
        server = self.server
        if server is None:
            return
        for session in list(server.sessions.values()):
            if session.endpoint is endpoint:
                self.world.later(server.keepalive_deadline(session), self._keepalive, server,
                                 session, self.world.now(), False)

    def _keepalive(self, server: Server, session: Session, since: float,
                   orphan: bool) -> None:
        """The server's keepalive (or tcp_user_timeout) gives up on a client it has not
        heard from since ``since``: one cut off all that time, or (``orphan``) whose side
        of the connection is gone (dropped or dead behind a cut: its kernel answers the
        next probe with a reset, or nothing does)."""
        endpoint = session.endpoint
        if endpoint is None or session.ended:
            return
        cut_since = endpoint.partitioned_since
        if orphan or endpoint.dead or (cut_since is not None and cut_since <= since):
            self.world.trace(f"pg: keepalive ends pid {session.pid}")
            server.end_session(session, None, tell_client=False)

    def client_gone(self, endpoint: Endpoint) -> None:
        """The client's process died: its kernel closes the sockets (the server hears of
        it a latency later, unless the network is cut)."""
        server = self.server
        if server is None:
            return
        for session in list(server.sessions.values()):
            if session.endpoint is endpoint:
                if endpoint.partitioned:
                    self.world.later(server.keepalive_deadline(session), self._keepalive,
                                     server, session, self.world.now(), True)
                else:
                    self.world.later(self.world.latency(None), server.end_session, session,
                                     None, False)


def _checkpointed(server: Server) -> None:
    if server.up:
        server.checkpoint = (server.timeline, server.world.now())


def _ms(value: str) -> float:
    """A PostgreSQL duration setting (``"1500ms"``, ``"3"`` s for tcp settings given as
    plain numbers is handled by callers) as seconds."""
    value = value.strip()
    if value.endswith("ms"):
        return float(value[:-2]) / 1000
    if value.endswith("s"):
        return float(value[:-1])
    if value.endswith("min"):
        return float(value[:-3]) * 60
    return float(value or 0) / 1000  # a bare number of a time setting means ms


# -- the statements -------------------------------------------------------------------
Handler = Callable[[Server, Session, str, tuple[Any, ...], Reply], None]


def _ours(session: Session, marker: Any) -> bool:
    return session.settings.get(adv.MARKER_SETTING) == marker


def _poison(session: Session, ours: bool) -> str | None:
    if not ours:
        session.settings[adv.MARKER_SETTING] = "shared"
        return "shared"
    return None


def _apply(server: Server, session: Session, sql: str, args: tuple[Any, ...],
           answer: Reply) -> None:
    names, values, marker = args
    session.settings.update(zip(names, values, strict=True))
    durable = _durable(session, sql)
    session.settings[adv.MARKER_SETTING] = marker
    row = (session.pid, len(names), marker) if durable is None else (
        session.pid, len(names), durable, marker)
    answer([row], None)


def _durable(session: Session, sql: str, transaction: bool = False) -> str | None:
    """What ``pg_timeline.DURABLE_COMMIT`` does, where the statement carries it: ``off``
    becomes ``on``; for the session, or (``transaction``) for this statement's commit."""
    if "set_config('synchronous_commit'" not in sql:
        return None
    value = session.settings.get("synchronous_commit", "on")
    value = "on" if value == "off" else value
    if not transaction:
        session.settings["synchronous_commit"] = value
    return value


def _set_session(server: Server, session: Session, sql: str, args: tuple[Any, ...],
                 answer: Reply) -> None:
    names, values = args
    session.settings.update(zip(names, values, strict=True))
    answer([(len(names),)], None)


def _role_values(server: Server, session: Session, sql: str, args: tuple[Any, ...],
                 answer: Reply) -> None:
    (names,) = args
    rows = [("sidecar", "app", name, value, "", "user")
            for name, value in server.cluster.role_settings.items()
            if name in names and value != "0"]
    answer(rows, None)


def _backend_pid(server: Server, session: Session, sql: str, args: tuple[Any, ...],
                 answer: Reply) -> None:
    answer([(session.pid,)], None)


def _probe(server: Server, session: Session, sql: str, args: tuple[Any, ...],
           answer: Reply) -> None:
    found = session.settings.get(adv.MARKER_SETTING)
    session.settings[adv.MARKER_SETTING] = "probe"
    answer([(found, session.pid, "probe")], None)


def _lock(wait: bool) -> Handler:
    def run(server: Server, session: Session, sql: str, args: tuple[Any, ...],
            answer: Reply) -> None:
        lock, marker = args[0], args[2]
        ours = _ours(session, marker)
        already = session.locks.get(lock, 0) > 0
        poison = _poison(session, ours)
        uptime = server.world.now() - server.started

        def result(got: bool) -> None:
            counter = None
            if got:
                counter = server.xid()  # drawn after the grant; the WAL message commits it
                server.commit(session, answer, [(ours, already, counter, server.timeline,
                                                 uptime, "0/0", poison)])
                return
            answer([(ours, already, None, server.timeline, uptime, None, poison)], None)

        if not ours or already:
            result(False)
            return
        if not wait:
            result(server.try_lock(session, lock))
            return
        wait_for = _ms(args[5])
        server.wait_lock(session, lock, lambda: result(True), wait_for)
    return run


def _lock_many(server: Server, session: Session, sql: str, args: tuple[Any, ...],
               answer: Reply) -> None:
    """adv.try_lock_many_sql: every free key of $1 at once, one counter after them all."""
    keys, _, marker = args
    ours = _ours(session, marker)
    held = {lock for lock, grants in session.locks.items() if grants > 0}
    already = [key for key in keys if key in held]
    got = [key for key in keys if ours and key not in held and server.try_lock(session, key)]
    poison = _poison(session, ours)
    uptime = server.world.now() - server.started
    if got:
        counter = server.xid()  # drawn after every grant; the WAL message commits it
        server.commit(session, answer, [(ours, already, got, counter, server.timeline,
                                         uptime, "0/0", poison)])
        return
    answer([(ours, already, got, None, server.timeline, uptime, None, poison)], None)


def _holds(server: Server, session: Session, sql: str, args: tuple[Any, ...],
           answer: Reply) -> None:
    classid, objid, marker = args
    ours = _ours(session, marker)
    lock = adv.key_from_halves(classid, objid)
    answer([(ours, session.locks.get(lock, 0) > 0, _poison(session, ours))], None)


def _unlock(server: Server, session: Session, sql: str, args: tuple[Any, ...],
            answer: Reply) -> None:
    lock, marker, levels = args
    ours = _ours(session, marker)
    done = None
    if ours:
        done = all([server.unlock(session, lock) for _ in range(int(levels))])
    answer([(ours, done)], None)


def _holder(server: Server, session: Session, sql: str, args: tuple[Any, ...],
            answer: Reply) -> None:
    lock = adv.key_from_halves(*args)
    pid = server.holders.get(lock)
    holder = server.sessions.get(pid) if pid is not None else None
    answer([(holder.settings.get("application_name"),)] if holder else [], None)


def _checkpoint(server: Server, session: Session, sql: str, args: tuple[Any, ...],
                answer: Reply) -> None:
    timeline, at = server.checkpoint
    stored = math.floor(server.cluster.host.wall(at))  # checkpoint_time: whole seconds
    answer([(timeline, server.wall() - stored)], None)


def _hints(server: Server, session: Session, sql: str, args: tuple[Any, ...],
           answer: Reply) -> None:
    (pattern,) = args
    prefix = pattern.rstrip("%")
    answer([(s.settings.get("application_name"),) for s in server.sessions.values()
            if (s.settings.get("application_name") or "").startswith(prefix)], None)


def _name_and_clear(server: Server, session: Session, sql: str, args: tuple[Any, ...],
                    answer: Reply) -> None:
    tag, classid, objid, named = args
    session.settings["application_name"] = tag
    lock = adv.key_from_halves(classid, objid)
    cancelled = 0
    for pid in list(server.queues.get(lock, ())):
        waiter = server.sessions.get(pid)
        if waiter is not None and waiter.settings.get("application_name") != named:
            server._cancel(waiter, "user request")
            cancelled += 1
    answer([(tag, cancelled)], None)


def _set_name(server: Server, session: Session, sql: str, args: tuple[Any, ...],
              answer: Reply) -> None:
    session.settings["application_name"] = args[0]
    answer([(args[0],)], None)


def _era(server: Server, session: Session, sql: str, args: tuple[Any, ...],
         answer: Reply) -> None:
    """pg_timeline.era_sql: record this timeline's era, raising the base past a reset."""
    era = server.data.tables.get(pg_timeline.ERA_TABLE)
    if era is None:
        raise pgerr.UndefinedTableError(f'relation "lease.{pg_timeline.ERA_TABLE}" does not '
                                        'exist')
    t, base, highest = server.timeline, era["base"], era["highest"]
    new_base = highest if t + base < highest else base
    era["highest"] = max(highest, t + new_base)
    era["base"] = new_base
    server.commit(session, answer, [(t, new_base, _started_us(server))],
                  _durable(session, sql, transaction=True))


def _started_us(server: Server) -> int:
    """pg_timeline.SERVER_START: the postmaster's start, in microseconds."""
    return round(server.started * 1_000_000)


# -- the row lease (sidecar.lease.sql.dialect.PostgresDialect) -------------------------
def _version(server: Server, values: dict[str, Any]) -> int:
    """A row version as the dialect's expression draws it: the era's base and the
    timeline and server it was read on come with the statement (``era_tl`` -1: no era
    table)."""
    counter = server.nextval()
    base = 0
    if "era_tl" in values:
        tl, base = int(values["era_tl"]), int(values["era_base"])
        if tl >= 0 and (tl != server.timeline or int(values["era_start"]) != _started_us(server)):
            raise pgerr.NotNullViolationError('null value in column "version" violates '
                                              'not-null constraint')
    version = pg_timeline.token(server.timeline, counter, base)
    if version is None:
        raise pgerr.NotNullViolationError('null value in column "version" violates not-null '
                                          'constraint')
    return version


def _row_acquire(server: Server, session: Session, sql: str, args: tuple[Any, ...],
                 answer: Reply) -> None:
    values = dict(zip(_NAMES["acquire"], args, strict=True))
    name, owner, duration = values["name"], values["owner"], float(values["duration"])
    now = server.wall()
    rows = server.data.rows
    row = rows.get(name)
    result: tuple[Any, ...]
    if row is None or row.expires_at <= now:
        after = row is not None and row.metadata == f"released:{row.version}"
        row = rows[name] = LeaseRow(owner, now, now, now + duration,
                                    "after-release" if after else None,
                                    _version(server, values))
        result = (row.owner, row.version, row.expires_at, True, after, server.timeline)
    else:
        result = (row.owner, row.version, row.expires_at, False, False, server.timeline)
    # The dialect's sweep leaves a row with its release record for a lease duration.
    swept = [key for key, other in rows.items() if key != name and other.expires_at <= now
             and (other.metadata != f"released:{other.version}"
                  or other.expires_at <= now - duration)]
    for key in swept:
        del rows[key]
    wrote = bool(result[3] or swept)
    for key in swept:
        server.notify(server.cluster.dialect.channel or "", key)
    if wrote:
        server.commit(session, answer, [result], _durable(session, sql, transaction=True))
    else:
        answer([result], None)


def _row_renew(server: Server, session: Session, sql: str, args: tuple[Any, ...],
               answer: Reply) -> None:
    values = dict(zip(_NAMES["renew"], args, strict=True))
    now = server.wall()
    row = server.data.rows.get(values["name"])
    # The renew statement names the version it needs: ours exactly, or ours or later.
    later_too = "version >= CAST(" in sql
    if (row is None or row.owner != values["owner"] or row.expires_at <= now
            or not (row.version >= int(values["version"]) if later_too
                    else row.version == int(values["version"]))):
        answer([], None)
        return
    row.renewed_at = now
    row.expires_at = now + float(values["duration"])
    row.version = _version(server, values)
    server.commit(session, answer, [(row.owner, row.version, row.expires_at)],
                  _durable(session, sql, transaction=True))


def _row_release(server: Server, session: Session, sql: str, args: tuple[Any, ...],
                 answer: Reply) -> None:
    values = dict(zip(_NAMES["release"], args, strict=True))
    now = server.wall()
    name = values["name"]
    row = server.data.rows.get(name)
    if row is None or row.owner != values["owner"] or row.version != int(values["version"]):
        answer([], None)
        return
    row.expires_at = min(row.expires_at, now)
    row.metadata = f"released:{row.version}" if int(values["record"]) == 1 else None
    server.notify(server.cluster.dialect.channel or "", name)
    server.commit(session, answer, [("",)])


def _row_read(live_only: bool) -> Handler:
    def run(server: Server, session: Session, sql: str, args: tuple[Any, ...],
            answer: Reply) -> None:
        row = server.data.rows.get(args[0])
        if row is None or (live_only and row.expires_at <= server.wall()):
            answer([], None)
        else:
            answer([(row.owner, row.version, row.expires_at)], None)
    return run


def _row_group_beat(server: Server, session: Session, sql: str, args: tuple[Any, ...],
                    answer: Reply) -> None:
    """The dialect's ``group_beat``: every held row renewed (one version drawn for the
    statement), the member's own row written or dropped, the other live members read on
    the statement's snapshot."""
    values = dict(zip(_NAMES["group_beat"], args, strict=True))
    now = server.wall()
    rows = server.data.rows
    owner, member, prefix = values["owner"], values["member"], values["prefix"]
    others = [(key, row.owner) for key, row in rows.items()
              if key.startswith(prefix) and row.expires_at > now and key != member]
    renewed: list[tuple[Any, ...]] = []
    version: int | None = None
    for name, held in zip(values["names"], values["versions"], strict=True):
        row = rows.get(name)
        if (row is None or row.owner != owner or row.version < int(held)
                or row.expires_at <= now):
            continue
        if version is None:
            version = _version(server, values)
        row.renewed_at, row.expires_at = now, now + float(values["duration"])
        row.version = version
        renewed.append(("lease", name, version))
    joined: list[tuple[Any, ...]] = []
    if int(values["advertise"]) == 1:
        old = rows.get(member)
        rows[member] = LeaseRow(owner, old.acquired_at if old else now, now,
                                now + float(values["duration"]), old.metadata if old else None,
                                old.version if old else 0)
        joined.append(("member", owner, None))
    else:
        rows.pop(member, None)
    result = [*renewed, *joined, *(("member", who, None) for _, who in others)]
    server.commit(session, answer, result, _durable(session, sql, transaction=True))


def _group_beat(server: Server, session: Session, sql: str, args: tuple[Any, ...],
                answer: Reply) -> None:
    """The advisory shard group's heartbeat: our marker, every advisory lock the session
    holds, its ``application_name`` set, the other sessions showing the group's prefix."""
    marker, name, prefix = args
    ours = session.settings.get(adv.MARKER_SETTING) == marker
    locks = [lock for lock, grants in session.locks.items() if grants > 0]
    session.settings["application_name"] = name
    others = [app for s in server.sessions.values() if s.pid != session.pid and not s.ended
              and (app := s.settings.get("application_name") or "").startswith(prefix)]
    answer([(ours, locks, name, others)], None)


def _group_unlock(server: Server, session: Session, sql: str, args: tuple[Any, ...],
                  answer: Reply) -> None:
    """The advisory shard group's release: every key of $1 unlocked on our session, each
    announced on the channel."""
    locks, marker, channel = args
    ours = session.settings.get(adv.MARKER_SETTING) == marker
    done = [lock for lock in locks if server.unlock(session, lock)] if ours else None
    for lock in locks:
        server.notify(channel, str(lock))
    answer([(ours, done, len(locks))], None)


def _handlers() -> dict[str, Handler]:
    handlers: dict[str, Handler] = {
        adv.APPLY: _apply, pg_session.SET_SESSION: _set_session,
        pg_session.ROLE_VALUES: _role_values, "SELECT pg_backend_pid()": _backend_pid,
        adv.PROBE: _probe, adv.try_lock_sql(VERSION_NUM): _lock(wait=False),
        adv.wait_lock_sql(VERSION_NUM): _lock(wait=True),
        adv.try_lock_many_sql(VERSION_NUM): _lock_many, adv.HOLDS: _holds,
        adv.UNLOCK: _unlock, adv.HOLDER: _holder, pg_timeline.CHECKPOINT: _checkpoint,
        adv_hint.HINTS: _hints, adv_hint.NAME_AND_CLEAR: _name_and_clear,
        "select set_config('application_name', $1, false)": _set_name,
        pg_timeline.era_sql("lease"): _era,
        adv_group.BEAT: _group_beat, adv_group.UNLOCK: _group_unlock,
    }
    dialect = PostgresDialect()
    assert dialect.group_beat is not None
    handlers[dialect.group_beat.numeric()[0]] = _row_group_beat
    handlers[dialect.acquire.numeric()[0]] = _row_acquire
    handlers[dialect.renew.numeric()[0]] = _row_renew
    handlers[dialect.release.numeric()[0]] = _row_release
    handlers[dialect.read.numeric()[0]] = _row_read(live_only=True)
    handlers[dialect.read_replica.numeric()[0]] = _row_read(live_only=False)
    return handlers


# The row statements' parameter names, in the order asyncpg passes them.
_DIALECT = PostgresDialect()
assert _DIALECT.group_beat is not None  # PostgreSQL's dialect has shard groups
_NAMES = {"acquire": _DIALECT.acquire.numeric()[1],
          "renew": _DIALECT.renew.numeric()[1],
          "release": _DIALECT.release.numeric()[1],
          "group_beat": _DIALECT.group_beat.numeric()[1]}


# -- the fake asyncpg ---------------------------------------------------------------------
class FakeConnection:
    """The client side of one session, as asyncpg's ``Connection`` looks to the sidecar."""

    def __init__(self, cluster: Cluster, endpoint: Endpoint | None,
                 command_timeout: float | None) -> None:
        self._cluster = cluster
        self._world = cluster.world
        self._endpoint = endpoint
        self._command_timeout = command_timeout
        self._server: Server | None = None
        self._session: Session | None = None
        self._closed = False
        self._termination: list[Callable[[Any], None]] = []
        self._listeners: dict[str, list[Callable[..., None]]] = {}
        self._pending: asyncio.Future[Any] | None = None
        self._pid = 0

    async def _open(self, timeout: float, server_settings: dict[str, str]) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def at_server(reply: Reply) -> None:
            server = self._cluster.server
            if server is None or not server.up:
                reply(None, ConnectionRefusedError(111, "Connection refused"))
                return
            session = server.open_session(self._endpoint, self, dict(server_settings))
            reply((server, session), None)

        self._world.deliver(self._endpoint, at_server, future)
        async with asyncio.timeout(timeout):
            self._server, self._session = await future
        self._pid = self._session.pid

    # -- what the sidecar calls -------------------------------------------------------
    def is_closed(self) -> bool:
        return self._closed

    def get_server_pid(self) -> int:
        return self._pid

    def get_server_version(self) -> Any:
        return SERVER_VERSION

    def add_termination_listener(self, callback: Callable[[Any], None]) -> None:
        self._termination.append(callback)

    async def add_listener(self, channel: str, callback: Callable[..., None]) -> None:
        self._listeners.setdefault(channel, []).append(callback)
        session = self._session

        def at_server(reply: Reply) -> None:
            if session is not None and not session.ended:
                session.listening.add(channel)
                reply(None, None)
        await self._roundtrip(at_server, self._command_timeout)

    async def fetch(self, sql: str, *args: Any, timeout: float | None = None) -> list[Any]:
        return list(await self._query(sql, args, timeout))

    async def fetchrow(self, sql: str, *args: Any, timeout: float | None = None) -> Any:
        rows = await self._query(sql, args, timeout)
        return rows[0] if rows else None

    async def fetchval(self, sql: str, *args: Any, timeout: float | None = None) -> Any:
        rows = await self._query(sql, args, timeout)
        return rows[0][0] if rows else None

    async def execute(self, sql: str, *args: Any, timeout: float | None = None) -> str:
        await self._query(sql, args, timeout)
        return "SELECT 1"

    def terminate(self) -> None:
        """Drop the socket: the server hears of it a latency later (if it can)."""
        if self._closed:
            return
        self._closed = True
        self._fail_pending(pgerr.ConnectionDoesNotExistError("connection was closed"))
        server, session = self._server, self._session
        if server is not None and session is not None:
            endpoint = self._endpoint
            if endpoint is not None and endpoint.partitioned:
                self._world.later(server.keepalive_deadline(session), self._cluster._keepalive,
                                  server, session, self._world.now(), True)
            else:
                self._world.later(self._world.latency(endpoint), server.end_session, session,
                                  None, False)

    async def close(self, timeout: float | None = None) -> None:
        self.terminate()

    # -- the server's side -------------------------------------------------------------
    def server_ended(self, error: BaseException, held: list[int]) -> None:
        """The server ended the session: the client hears of it a latency later (a frozen
        client when it thaws; a cut-off one not until it tries)."""
        endpoint = self._endpoint
        if endpoint is not None and endpoint.partitioned:
            self._world.trace("pg: a session ended that its client cannot hear of")
            return
        if endpoint is not None and held:
            # The documented window: until the holder has heard of it and stopped
            # claiming (:class:`testkit.sim.process.RecordingState`), its claims may
            # overlap the next holder's.
            self._world.excuse(endpoint, held)
        self._world.later(self._world.latency(endpoint), self._hear_end, error)

    def _hear_end(self, error: BaseException) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_pending(error)
        for callback in self._termination:
            # In the client's process: its termination listener runs there.
            self._call_in_client(callback, self)


    def notified(self, channel: str, payload: str, pid: int) -> None:
        endpoint = self._endpoint
        if endpoint is not None and (endpoint.partitioned or endpoint.dead):
            return
        for callback in self._listeners.get(channel, ()):
            self._world.later(self._world.latency(endpoint), self._call_in_client,
                              callback, self, pid, channel, payload)

    def _call_in_client(self, callback: Callable[..., None], *args: Any) -> None:
        if self._endpoint is None:
            callback(*args)
            return
        self._world.loop.call_soon(callback, *args, context=in_process(self._endpoint))

    # -- internals -------------------------------------------------------------------------
    def _fail_pending(self, error: BaseException) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and not pending.done():
            pending.set_exception(error)

    async def _query(self, sql: str, args: tuple[Any, ...], timeout: float | None) -> list[Any]:
        if self._closed:
            raise pgerr.InterfaceError("cannot call Connection.fetch(): connection is closed")
        if self._pending is not None:
            raise pgerr.InterfaceError("cannot perform operation: another operation is in "
                                       "progress")
        server, session = self._server, self._session
        assert server is not None and session is not None

        def at_server(reply: Reply) -> None:
            server.execute(session, sql, args, reply)
        return list(await self._roundtrip(at_server, timeout or self._command_timeout))

    async def _roundtrip(self, at_server: Callable[[Reply], None],
                         timeout: float | None) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending = future
        self._world.deliver(self._endpoint, at_server, future)
        try:
            # A timeout cancels the future: a reply that still comes is dropped.
            async with asyncio.timeout(timeout):
                return await future
        except TimeoutError:
            # asyncpg sends a cancel request (a new connection) and gives up waiting.
            server, session = self._server, self._session
            if server is not None and session is not None:
                pid = session.pid
                self._world.deliver(self._endpoint, lambda reply: server.cancel_request(pid),
                                    loop.create_future())
            raise
        finally:
            if self._pending is future:
                self._pending = None


class FakePool:
    """asyncpg's ``Pool`` as the row lease's driver uses it."""

    def __init__(self, cluster: Cluster, endpoint: Endpoint | None, max_size: int,
                 timeout: float, command_timeout: float | None,
                 init: Callable[[Any], Any] | None) -> None:
        self._cluster = cluster
        self._endpoint = endpoint
        self._max = max_size
        self._timeout = timeout
        self._command_timeout = command_timeout
        self._init = init
        self._idle: list[FakeConnection] = []
        self._count = 0
        self._free = asyncio.Condition()

    async def _acquire(self) -> FakeConnection:
        async with self._free:
            while True:
                while self._idle:
                    conn = self._idle.pop()
                    if not conn.is_closed():
                        return conn
                    self._count -= 1
                if self._count < self._max:
                    self._count += 1
                    break
                await self._free.wait()
        try:
            conn = FakeConnection(self._cluster, self._endpoint, self._command_timeout)
            await conn._open(self._timeout, {})
            if self._init is not None:
                await self._init(conn)
            return conn
        except BaseException:
            async with self._free:
                self._count -= 1
                self._free.notify()
            raise

    async def _release(self, conn: FakeConnection) -> None:
        async with self._free:
            if conn.is_closed():
                self._count -= 1
            else:
                self._idle.append(conn)
            self._free.notify()

    async def fetch(self, sql: str, *args: Any, timeout: float | None = None) -> list[Any]:
        conn = await self._acquire()
        try:
            return await conn.fetch(sql, *args, timeout=timeout)
        except (TimeoutError, pgerr.QueryCanceledError):
            conn.terminate()  # asyncpg's pool drops a connection whose query was cut off
            raise
        finally:
            await self._release(conn)

    @contextlib.asynccontextmanager
    async def acquire(self) -> Any:
        conn = await self._acquire()
        try:
            yield conn
        finally:
            await self._release(conn)

    async def close(self) -> None:
        for conn in self._idle:
            conn.terminate()
        self._idle.clear()


class FakeAsyncpg:
    """Stands in for the ``asyncpg`` module inside the sidecar's PostgreSQL modules:
    ``connect`` and ``create_pool`` reach the cluster the DSN names; everything else
    (exception classes) is the real module's."""

    def __init__(self, clusters: dict[str, Cluster],
                 endpoint_of: Callable[[], Endpoint | None]) -> None:
        self._clusters = clusters
        self._endpoint_of = endpoint_of

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncpg, name)

    def _cluster(self, dsn: str | None) -> Cluster:
        return self._clusters[(dsn or "").rsplit("/", 1)[-1]]

    async def connect(self, dsn: str | None = None, *, timeout: float = 60,
                      command_timeout: float | None = None, statement_cache_size: int = 100,
                      server_settings: dict[str, str] | None = None) -> FakeConnection:
        conn = FakeConnection(self._cluster(dsn), self._endpoint_of(), command_timeout)
        await conn._open(timeout, server_settings or {})
        return conn

    async def create_pool(self, dsn: str | None = None, *, min_size: int = 10,
                          max_size: int = 10, timeout: float = 60,
                          command_timeout: float | None = None, reset: Any = None,
                          init: Callable[[Any], Any] | None = None,
                          **kwargs: Any) -> FakePool:
        return FakePool(self._cluster(dsn), self._endpoint_of(), max_size, timeout,
                        command_timeout, init)
