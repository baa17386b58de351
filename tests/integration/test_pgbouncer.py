"""Both PostgreSQL backends through a real PgBouncer (Debian's package), with real sidecar
processes, real signals and every sidecar's ``GET /leader`` sampled on one clock.

- ``postgres`` (advisory lock) behind ``pool_mode=transaction`` must refuse, say why, exit
  with 2 and never let two claims overlap, for pool sizes 1 and 5 and 2 or 3 sidecars; a
  killed holder's lock, which the pooler's server session keeps, must not be taken over.
- ``postgres`` behind ``pool_mode=session`` works: one leader, SIGTERM hands over.

``postgres-row`` behind ``pool_mode=transaction``: ``test_pgbouncer_row.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import pytest

from sidecar.lease.postgres_advisory.lease import AdvisoryLease
from sidecar.lease.postgres_advisory.session import (
    POOLER,
    Connector,
    close,
    pooler_evidence,
)
from sidecar.lease.postgres_advisory.sql import MARKER_SETTING, lock_id
from sidecar.settings import StoreSettings
from testkit import support
from testkit.support import REPO, SidecarProcess, get_json, one_leader, wait_until
from testkit.testbed.postgres import PgServer
from tests.integration.advisory_support import (
    FAST,
    HORIZON,
    LEASE,
    advisory,
    lock_holders,
    settings,
)
from tests.testbed.pgbouncer_fixtures import StartBouncer

pytestmark = pytest.mark.postgres

# What a sidecar that refused logs and /status shows (the first words of the reason).
REFUSAL = POOLER.split(":", 1)[0]
PREPARED_ERRORS = ("prepared statement", "__asyncpg_stmt", "DuplicatePreparedStatement",
                   "InvalidSQLStatementName")


class ClaimRecorder(support.ClaimRecorder):
    """The shared recorder, with each claim's start bounded tighter from below.

    A claim was handed out between the request's send time and the answer, and its
    ``valid_until`` is at most one horizon after that moment: so it began no earlier than
    ``max(sent, valid_until - horizon)``. On a loaded machine an answer can take longer
    than a horizon, and counting from the send time alone then reports overlaps of
    claims that were handed out after the other had ended.
    """

    def overlaps(self):
        self.claims = [(who, max(sent, until - HORIZON), until)
                       for who, sent, until in self.claims]
        return super().overlaps()


def test_the_recorder_bound_still_sees_a_real_overlap() -> None:
    recorder = ClaimRecorder([])
    recorder.claims = [("a", 0.0, 1.0), ("b", 0.5, 0.9)]  # b began by 0.65 < 1.0
    assert len(recorder.overlaps()) == 1
    recorder.claims = [("a", 0.0, 1.0), ("b", 0.5, 1.3)]  # b began at 1.05 at the earliest
    assert recorder.overlaps() == []


def dbname(dsn: str) -> str:
    return dsn.rsplit("/", 1)[1]


def start_sidecars(tmp_path: Path, dsn: str, count: int, backend: str = "postgres",
                   tag: str = "pgb", timing: list[str] | None = None) -> list[SidecarProcess]:
    """Start ``count`` sidecars at once; wait until each serves HTTP or has exited (a
    sidecar behind a transaction pooler may refuse and exit within its first second)."""
    procs = [SidecarProcess(tmp_path, f"{tag}-{i}",
                            args=["--backend", backend, "--dsn", dsn, "--name", "jobs",
                                  *(timing or FAST)]).start()
             for i in range(count)]
    for proc in procs:
        wait_until(lambda p=proc: p.proc.poll() is not None
                   or get_json(p.url + "/healthz", timeout=0.5)[0] in (200, 503), timeout=15)
    return procs


def stop_all(procs: list[SidecarProcess], password: str) -> None:
    for proc in procs:
        proc.stop()
    for proc in procs:
        assert password not in proc.logs(), f"{proc.identity} logged the password"


def log_lines(proc: SidecarProcess) -> list[dict]:
    lines = []
    for line in proc.logs().splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    return lines


def refusals(proc: SidecarProcess) -> list[dict]:
    return [line for line in log_lines(proc) if line.get("msg", "").startswith(REFUSAL)]


def assert_refused(proc: SidecarProcess) -> None:
    """Exit code 2, one error line naming the pooler and postgres-row."""
    assert proc.proc is not None and proc.proc.poll() == 2, (proc.identity, proc.logs())
    lines = refusals(proc)
    assert len(lines) == 1, proc.logs()
    assert lines[0]["level"] == "error"
    assert "pool_mode=transaction" in lines[0]["msg"]
    assert "LEASE_BACKEND=postgres-row" in lines[0]["msg"]


# -- library level: the checks themselves -------------------------------------------------
async def test_shared_server_session_is_refused_on_both_sides(
        pg: PgServer, pg_dsn: str, pgbouncer: StartBouncer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's reproduction: through pool size 1, two clients get one server session.
    Before the fix both were granted (locks are re-entrant within a session)."""
    # The checks inside the lock statements alone, without the probe after a grant
    # (tested on its own below), which would find the pooler first.
    async def no_probe(self: object, session: object) -> None:
        return None

    monkeypatch.setattr(AdvisoryLease, "_probe_pooler", no_probe)
    bouncer = pgbouncer("transaction", 1)
    dsn = bouncer.dsn_for(dbname(pg_dsn))
    a, b = advisory(dsn, "lib-a"), advisory(dsn, "lib-b")
    try:
        la, lb = a.lease("jobs"), b.lease("jobs")
        assert (await la.try_acquire()).held  # alone on the pool: nothing to see yet
        assert (await la.try_renew()).held
        refused = await lb.try_acquire()  # lands on a's server session, which holds it
        assert not refused.held and refused.reason.startswith(POOLER)
        assert "already held the lock" in refused.reason
        # b's connect overwrote a's marker on the shared session: a's heartbeat sees it.
        lost = await la.try_renew()
        assert not lost.held and lost.reason.startswith(POOLER)
        assert "without this connection's marker" in lost.reason
        assert la.lost.is_set()
        assert a.misconfigured.is_set() and b.misconfigured.is_set()
        assert a.misconfiguration and a.misconfiguration.startswith(POOLER)
        # Refused for good, without another round trip.
        assert not (await la.try_acquire()).held and not (await lb.try_acquire()).held
    finally:
        await a.close()
        await b.close()
    # Dropping the client ends nothing behind a transaction pooler: the server session
    # still holds the lock (which is why every contender must refuse, not wait).
    assert len(lock_holders(pg, dbname(pg_dsn))) == 1


async def test_a_session_holding_a_lock_we_never_took_is_not_ours(pg: PgServer,
                                                                   pg_dsn: str) -> None:
    """Straight to PostgreSQL (no pooler) the same held-key check drops the session (it
    frees the unknown lock) and tries again; nothing is refused for good."""
    backend = advisory(pg_dsn, "direct")
    try:
        lease = backend.lease("jobs")
        assert (await lease.try_acquire()).held
        await lease.release()
        session = lease._link.session
        assert session is not None and not session.proxied
        # Take the lock on our session behind the lease's back.
        await session.conn.fetchval("select pg_advisory_lock($1)", lease.lock_id)
        grant = await lease.try_acquire()
        assert not grant.held and "unknown to us" in grant.reason
        assert lock_holders(pg, dbname(pg_dsn)) == []  # the session was ended
        assert (await lease.try_acquire()).held
        assert not backend.misconfigured.is_set() and lease.pooler is None
    finally:
        await backend.close()


async def test_session_pooling_passes_every_check(pg: PgServer, pg_dsn: str,
                                                  pgbouncer: StartBouncer) -> None:
    bouncer = pgbouncer("session", 5)
    dsn = bouncer.dsn_for(dbname(pg_dsn))
    a, b = advisory(dsn, "s-a"), advisory(dsn, "s-b")
    try:
        la, lb = a.lease("jobs"), b.lease("jobs")
        assert (await la.try_acquire()).held
        assert la._link.session is not None and la._link.session.proxied  # a pooler answered
        assert lock_holders(pg, dbname(pg_dsn)) == [la.pid]
        refused = await lb.try_acquire()
        assert not refused.held and refused.holder == "s-a"
        for _ in range(3):
            assert (await la.try_renew()).held
        await la.release()
        await lb.wait_for_change(1.0)  # granted inside the server
        assert (await lb.try_acquire()).held
        assert lock_holders(pg, dbname(pg_dsn)) == [lb.pid]
        for lease in (la, lb):  # the probe after each grant found nothing
            assert lease._probe is not None
            await asyncio.wait_for(lease._probe, 10)
        assert not a.misconfigured.is_set() and not b.misconfigured.is_set()
    finally:
        await a.close()
        await b.close()


async def test_a_grant_that_raced_lock_timeout_is_not_taken_for_a_pooler(
        pg: PgServer, pg_dsn: str, pgbouncer: StartBouncer) -> None:
    """Behind a session pooler our session may hold the key after a lock_timeout (the
    server granted it in the race); that is freed by reconnecting, not refused as a
    transaction pooler. The raced grant is made by hand here (it happens in a few % of
    tight races; see test_postgres_advisory)."""
    bouncer = pgbouncer("session", 5)
    dsn = bouncer.dsn_for(dbname(pg_dsn))
    a, b = advisory(dsn, "t-a"), advisory(dsn, "t-b")
    try:
        la, lb = a.lease("jobs"), b.lease("jobs")
        assert (await la.try_acquire()).held
        await lb.wait_for_change(0.1)  # lock_timeout in the server
        assert lb._link.session is not None and lb._link.session.maybe_holds
        await la.release()
        await lb._link.session.conn.fetchval("select pg_advisory_lock($1)", lb.lock_id)
        grant = await lb.try_acquire()
        assert not grant.held and "raced lock_timeout" in grant.reason
        # The pooler resets the session (DISCARD ALL) once it sees the client gone.
        wait_until(lambda: lock_holders(pg, dbname(pg_dsn)) == [], timeout=5)
        assert (await lb.try_acquire()).held
        assert not b.misconfigured.is_set()
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("pool_size", [1, 5])
async def test_a_lone_holder_on_a_transaction_pool_finds_it_by_itself(
        pg_dsn: str, pgbouncer: StartBouncer, pool_size: int) -> None:
    """No other client shares or swaps its session, so no lock statement can see the
    pooler; the probe after the grant does (a fresh connection gets our session)."""
    bouncer = pgbouncer("transaction", pool_size)
    backend = advisory(bouncer.dsn_for(dbname(pg_dsn)), "alone")
    try:
        lease = backend.lease("jobs")
        assert (await lease.try_acquire()).held
        await asyncio.wait_for(backend.misconfigured.wait(), 10)
        assert backend.misconfiguration and "a fresh connection" in backend.misconfiguration
        assert lease.lost.is_set() and not (await lease.try_renew()).held
    finally:
        await backend.close()


async def test_the_probe_waits_for_the_lease_statement_in_flight(
        pg_dsn: str, pgbouncer: StartBouncer) -> None:
    """Seen in CI on a loaded machine: a heartbeat in flight while the probe after a grant
    ran kept the lease's server session busy; the probe was handed another one, clean,
    found nothing, and the lone holder led on unwarned. The probe now runs its statement
    while the lease's statements are held back, so the pooler hands it our session. The
    statement in flight here is a 0.3 s sleep on the lease's own connection."""
    bouncer = pgbouncer("transaction", 5)
    dsn = bouncer.dsn_for(dbname(pg_dsn))
    connector = Connector(dsn, "probe-race", settings(dsn, "probe-race").timing)
    session = await connector.open()
    try:
        assert session.proxied
        quiet = asyncio.Lock()
        in_flight = asyncio.Event()

        async def lease_statement() -> None:
            async with quiet:
                in_flight.set()
                await session.conn.fetchval("select pg_sleep(0.3)")

        statement = asyncio.create_task(lease_statement())
        await in_flight.wait()
        assert await connector.hands_out_used_sessions(session, quiet) is True
        await statement
    finally:
        await close(session.conn)


async def test_closing_a_standby_ends_its_wait_before_its_queued_probe(
        pg_dsn: str, pgbouncer: StartBouncer) -> None:
    """The probe after a standby's connect waits for the lease's statements, and the
    in-server wait is one of them (up to the elector's retry delay). Closing waited for the
    probe first, up to its timeout, and then cut it off; now the wait ends first and the
    queued probe runs to its end."""
    bouncer = pgbouncer("session", 5)
    dsn = bouncer.dsn_for(dbname(pg_dsn))
    a, b = advisory(dsn, "c-a"), advisory(dsn, "c-b")
    try:
        la, lb = a.lease("jobs"), b.lease("jobs")
        assert (await la.try_acquire()).held
        wait = asyncio.create_task(lb.wait_for_change(30.0))
        await asyncio.sleep(0.5)  # the wait is in the server; the probe queued behind it
        assert lb._waiter is not None and not lb._waiter.done()
        probe = lb._probe
        assert probe is not None and not probe.done()
        started = time.monotonic()
        await b.close()
        elapsed = time.monotonic() - started
        assert probe.done() and not probe.cancelled(), "the probe was cut off"
        assert elapsed < Connector(dsn, "c-b", settings(dsn, "c-b").timing).timeout
        wait.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await wait
    finally:
        await a.close()
        await b.close()


async def test_prepared_statement_errors_betray_the_pooler(pg_dsn: str,
                                                           pgbouncer: StartBouncer) -> None:
    """asyncpg's named statements through a transaction pooler fail with the errors the
    backend reads as a pooler (it never uses named statements itself)."""
    bouncer = pgbouncer("transaction", 1)
    dsn = bouncer.dsn_for(dbname(pg_dsn))
    first, second = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    try:
        assert await first.fetchval("select 1") == 1  # prepared under a name, cached
        caught: BaseException | None = None
        try:
            # Pool size 1: the other client's statement runs on the same server session.
            await second.execute("deallocate all")
            await first.fetchval("select 1")
        except asyncpg.PostgresError as exc:
            caught = exc
        assert caught is not None
        assert pooler_evidence(caught) is not None
    finally:
        await first.close()
        await second.close()


# -- real processes: transaction pooling is refused ----------------------------------------
@pytest.mark.parametrize("pool_size", [1, 5])
@pytest.mark.parametrize("count", [2, 3])
def test_transaction_pooling_is_refused_and_never_two_leaders(
        tmp_path: Path, pg: PgServer, pg_dsn: str, pgbouncer: StartBouncer,
        pool_size: int, count: int) -> None:
    bouncer = pgbouncer("transaction", pool_size)
    procs = start_sidecars(tmp_path, bouncer.dsn_for(dbname(pg_dsn)), count)
    try:
        with ClaimRecorder(procs) as recorder:
            # Bounded: every sidecar has refused, or 15 s passed.
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and any(p.proc.poll() is None for p in procs):
                time.sleep(0.1)
            time.sleep(0.5)
        assert recorder.overlaps() == []
        for proc in procs:
            assert_refused(proc)
    finally:
        stop_all(procs, pg.password)


# A client that takes the lease's lock through the pooler with the idle_session_timeout
# the backend sets (argv[3], ms), says so, and sleeps until killed.
LOCKING_CLIENT = """
import asyncio, sys, asyncpg
async def main():
    conn = await asyncpg.connect(sys.argv[1], statement_cache_size=0)
    await conn.execute("select set_config('idle_session_timeout', '" + sys.argv[3]
                       + "', false), pg_advisory_lock(" + sys.argv[2] + ")")
    print("locked", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@pytest.mark.parametrize("pool_size", [1, 5])
def test_killed_holder_behind_transaction_pooler_is_never_taken_over(
        tmp_path: Path, pg: PgServer, pg_dsn: str, pgbouncer: StartBouncer,
        pool_size: int) -> None:
    """A holder killed while it holds the lock: the pooler's server session keeps the lock,
    the next contenders are handed that session (or share one between them, or find the
    pooler by their own probe) and refuse instead of being granted the lock re-entrantly.
    The lock goes only when the server ends the idle session (``idle_session_timeout``,
    which the backend sets to the lease duration).

    The holder is a plain client (the lease's lock id, taken through the pooler, killed
    with SIGKILL), not a sidecar: a sidecar behind a transaction pooler finds it within
    its first statements, often before it holds anything, and the state under test is the
    lock its killed client left on a pooled server session.

    The session's idle timer starts when the holder's lock statement ends, and restarts
    with each later statement a contender runs on that session (if any lands there): the
    times below count from the lock, the earliest the timer can start."""
    bouncer = pgbouncer("transaction", pool_size)
    dsn = bouncer.dsn_for(dbname(pg_dsn))
    # A long lease, so the session outlives the contenders' start-up by far, on a busy
    # machine too (a loaded CI run saw a 15 s session end 10 s after the kill, most likely
    # because its timer had started at the lock, seconds before the kill, and no contender
    # had run a statement on it; the assertions now count from the lock).
    lease = 20.0
    timing = ["--lease-duration", f"{lease}s", *FAST[2:]]
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCKING_CLIENT, dsn, str(lock_id(StoreSettings().key("jobs"))),
         str(round(lease * 1000))],
        stdout=subprocess.PIPE, text=True)
    contenders: list[SidecarProcess] = []
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        locked = time.monotonic()
        held_by = lock_holders(pg, dbname(pg_dsn))
        assert len(held_by) == 1
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(5) == -signal.SIGKILL
        killed = time.monotonic()
        contenders = start_sidecars(tmp_path, dsn, 2, tag="next", timing=timing)
        with ClaimRecorder(contenders) as recorder:
            wait_until(lambda: all(p.proc.poll() is not None for p in contenders), timeout=10)
            time.sleep(0.3)
        assert recorder.claims == []  # nobody claimed, at any sample
        # The server session that the killed client left behind still holds the lock.
        phases = (f"lock → kill {killed - locked:.1f} s, kill → contenders gone "
                  f"{time.monotonic() - killed:.1f} s")
        assert time.monotonic() - locked < lease - 1, phases
        assert lock_holders(pg, dbname(pg_dsn)) == held_by
        for proc in contenders:
            assert_refused(proc)
        # Until the server ends that idle session: then it is free again.
        wait_until(lambda: lock_holders(pg, dbname(pg_dsn)) == [], timeout=lease + 5)
        assert time.monotonic() - locked >= lease - 1, phases
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(5)
        stop_all(contenders, pg.password)


async def test_refusal_reason_is_in_status(tmp_path: Path, pg: PgServer, pg_dsn: str,
                                           pgbouncer: StartBouncer) -> None:
    """What ``/status`` shows from the moment of detection until the exit (in-process:
    the real process exits within milliseconds of it, too fast to sample)."""
    from sidecar.runtime import Sidecar

    bouncer = pgbouncer("transaction", 1)
    dsn = bouncer.dsn_for(dbname(pg_dsn))

    def sidecar(identity: str) -> Sidecar:
        config = dataclasses.replace(settings(dsn, identity), http_addr=("127.0.0.1", 0),
                                     state_dir=str(tmp_path / identity), pod_label="off")
        return Sidecar(config)

    first, second = sidecar("in-a"), sidecar("in-b")
    try:
        await first.start()
        await second.start()
        for side in (first, second):
            message = await asyncio.wait_for(side.wait_misconfigured(), 10)
            assert message.startswith(POOLER)
            lease = side.status()["leases"][0]
            assert REFUSAL in lease["reason"] and not lease["leader"]
            assert not side.states[0].claim().leader
    finally:
        await first.stop()
        await second.stop()


def test_exec_stops_and_exits_2_behind_transaction_pooler(
        tmp_path: Path, pg: PgServer, pg_dsn: str, pgbouncer: StartBouncer) -> None:
    bouncer = pgbouncer("transaction", 1)
    dsn = bouncer.dsn_for(dbname(pg_dsn))
    [holder] = start_sidecars(tmp_path, dsn, 1, tag="ex")  # refuses on its own, too
    ran = tmp_path / "ran"
    execer = SidecarProcess(tmp_path, "ex-exec", command="exec",
                            args=["--backend", "postgres", "--dsn", dsn, "--name", "jobs",
                                  *FAST, "--", sys.executable, "-c",
                                  f"import pathlib,time; pathlib.Path({str(ran)!r})"
                                  ".write_text('x'); time.sleep(60)"])
    try:
        execer.start()
        assert execer.proc.wait(20) == 2
        assert holder.proc.wait(10) == 2
        assert not ran.exists()  # exec never got to lead
        assert_refused(holder)
        assert_refused(execer)
    finally:
        stop_all([holder, execer], pg.password)


# -- real processes: session pooling works ------------------------------------------------
@pytest.mark.parametrize("pool_size", [1, 5])
@pytest.mark.parametrize("count", [2, 3])
def test_session_pooling_one_leader_and_sigterm_hands_over(
        tmp_path: Path, pg: PgServer, pg_dsn: str, pgbouncer: StartBouncer,
        pool_size: int, count: int) -> None:
    bouncer = pgbouncer("session", pool_size)
    procs = start_sidecars(tmp_path, bouncer.dsn_for(dbname(pg_dsn)), count, tag="sess")
    try:
        with ClaimRecorder(procs) as recorder:
            leader = wait_until(lambda: one_leader(procs), timeout=15)
            time.sleep(1.0)
            assert one_leader(procs) is leader
            leader.signal(signal.SIGTERM)
            sent = time.monotonic()
            rest = [p for p in procs if p is not leader]
            # With pool size 1 the standbys wait for the one server connection in the
            # pooler's queue; they get it once the holder's client has gone.
            successor = wait_until(lambda: one_leader(rest), timeout=LEASE + 10)
            took = time.monotonic() - sent
            assert leader.proc.wait(10) == 0
            time.sleep(0.5)
            assert one_leader(procs) is successor, "\n".join(p.logs() for p in procs)
        assert recorder.overlaps() == [], "\n".join(p.logs() for p in procs)
        assert took < LEASE + 10
        for proc in procs:
            assert refusals(proc) == [], proc.logs()
    finally:
        stop_all(procs, pg.password)


def test_status_command_through_the_pooler(tmp_path: Path, pg: PgServer, pg_dsn: str,
                                           pgbouncer: StartBouncer) -> None:
    bouncer = pgbouncer("session", 5)
    dsn = bouncer.dsn_for(dbname(pg_dsn))
    procs = start_sidecars(tmp_path, dsn, 2, tag="stat")
    try:
        leader = wait_until(lambda: one_leader(procs), timeout=10)
        result = subprocess.run(
            [sys.executable, "-m", "sidecar", "status", "--backend", "postgres", "--dsn", dsn,
             "--name", "jobs", "--json"], capture_output=True, text=True, timeout=30, cwd=REPO)
        assert result.returncode == 0, result.stderr
        [row] = json.loads(result.stdout)["leases"]
        assert row["holder"] == leader.identity
    finally:
        stop_all(procs, pg.password)


async def test_marker_is_a_session_setting_that_a_reset_clears(pg_dsn: str) -> None:
    """The marker lives in the server session: a pooler's reset (DISCARD ALL, as PgBouncer
    runs between clients) clears it, so a reset session never passes for ours."""
    backend = advisory(pg_dsn, "reset")
    try:
        lease = backend.lease("jobs")
        assert (await lease.try_acquire()).held
        session = lease._link.session
        assert session is not None
        value = await session.conn.fetchval(f"select current_setting('{MARKER_SETTING}')")
        assert value == session.marker
        await session.conn.execute("discard all")
        grant = await lease.try_renew()
        assert not grant.held and grant.reason.startswith(POOLER)
    finally:
        await backend.close()
