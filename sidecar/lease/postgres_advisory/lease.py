"""One lease name of the ``postgres`` backend: one dedicated session, one advisory lock."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import asyncpg

from sidecar.base.errors import BackendError
from sidecar.lease import Grant, Holder
from sidecar.lease.pg_session import version_num
from sidecar.lease.pg_timeline import (
    CHECKPOINT,
    OUT_OF_RANGE,
    Timelines,
    checkpoint_age,
    token,
)
from sidecar.lease.postgres_advisory.handover import Hint
from sidecar.lease.postgres_advisory.session import (
    DB_ERRORS,
    POOLER,
    Connector,
    Link,
    Session,
    close,
    pooler_evidence,
)
from sidecar.lease.postgres_advisory.sql import (
    HOLDER,
    HOLDS,
    UNLOCK,
    lock_halves,
    try_lock_sql,
    wait_lock_sql,
)
from sidecar.settings import Timing

log = logging.getLogger("sidecar.lease.postgres")


class AdvisoryLease:
    """One lease name: one dedicated connection, one advisory lock.

    Uncertain lock state never survives: when a lock-changing call fails or times out
    half-way (did the server grant it or not?), the connection is dropped, which frees any
    lock it may hold.
    """

    def __init__(self, name: str, lock_id: int, connector: Connector, timing: Timing,
                 identity: str, on_pooler: Callable[[str, str], None] | None = None,
                 timelines: Timelines | None = None) -> None:
        self.name = name
        # The server timelines this process has seen (shared by the backend's leases).
        self._timelines = timelines or Timelines()
        self._link = Link(connector, name, lock_id)
        # Set the moment the session holding the lock drops; cleared on a grant.
        self.lost = self._link.lost
        # Loop time before which no claim (a server restart or a promotion).
        self._claims_wait_until = 0.0
        self._out_of_range_logged = False
        self.lock_id = lock_id
        self._halves = lock_halves(lock_id)
        self._timing = timing
        self._identity = identity
        self._db = connector
        # One operation at a time on the connection; the in-server wait holds it too.
        self._busy = asyncio.Lock()
        self._message = f"{identity} acquired {name}"
        self._waiter: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        # Once a transaction pooler was seen: the refusal, for good (it never heals).
        self.pooler: str | None = None
        self._on_pooler = on_pooler
        self._hint = Hint(connector, lock_id, self._halves, identity)
        # Sets our session's own name back when a hint we wrote runs out.
        self._hint_expiry: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        """Backend pid of the dedicated session (what pg_locks shows as the holder)."""
        return self._link.pid

    # -- the Lease protocol ----------------------------------------------------------
    async def try_acquire(self) -> Grant:
        await self._settle_waiter()
        async with self._busy:
            if self.pooler:
                return self._refused()
            if self._link.levels and self._link.alive():
                # Granted by the in-server wait, before this call: a round trip now
                # proves the session still holds it, and the validity counts from this
                # call's send time, not from a grant that may be seconds old (a hint read
                # that hung until its timeout came in between).
                return await self._heartbeat()
            loop = asyncio.get_running_loop()
            for attempt in (1, 2):
                reused = self._link.session is not None
                previous, started = self._link.session, loop.time()
                session = await self._link.connect()
                self._start_probe(session)
                if (session is not previous
                        and loop.time() - started > self._timing.renew_deadline / 2):
                    # The grant's validity counts from the elector's send time, before
                    # this slow connect (a session pool with fewer servers than
                    # sidecars queues it): most of it would be spent on arrival and
                    # the term would end before its first heartbeat. Ask on the next
                    # try, on the session we now have.
                    return Grant(held=False, reason="connected slowly; asking for the lock "
                                                    "on the next try")
                try:
                    ours, already, counter, timeline, uptime, _, _ = await session.conn.fetchrow(
                        try_lock_sql(version_num(session.conn)), self.lock_id, self._message,
                        session.marker, *self._halves)
                except DB_ERRORS as exc:
                    self._link.drop()  # granted or not, a dropped session holds nothing
                    if evidence := pooler_evidence(exc):
                        return self.pooler_seen(evidence)
                    # An idle session the server ended (idle_session_timeout): reconnect once.
                    if attempt == 1 and reused and session.conn.is_closed():
                        continue
                    raise self._db.error("acquire", exc) from None
                break
            replied = loop.time()
            self._timelines.saw(timeline, replied)
            refusal = self._check(session, ours, already)
            if refusal is not None:
                return refusal
            if counter is None:
                holder = await self._holder(session.conn)
                return Grant(held=False, holder=holder,
                             reason=f"held by {holder}" if holder else "held by another session")
            return await self._take(session, counter, timeline, uptime, replied) or self._held()

    async def try_renew(self) -> Grant:
        async with self._busy:
            if self.pooler:
                return self._refused()
            if not self._link.levels or not self._link.alive():
                return self._gone()
            return await self._heartbeat()

    async def _heartbeat(self) -> Grant:
        """Does our session still hold the lock? One round trip (the caller holds
        ``_busy``; the session holds grants)."""
        session = self._link.session
        assert session is not None
        self._start_probe(session)
        try:
            ours, holds, _ = await session.conn.fetchrow(HOLDS, *self._halves, session.marker)
        except DB_ERRORS as exc:
            if evidence := pooler_evidence(exc):
                return self.pooler_seen(evidence)
            if session.conn.is_closed():
                return self._gone()
            raise self._db.error("heartbeat", exc) from None
        if not ours:
            return self.pooler_seen("the heartbeat ran on a server session without this "
                                    "connection's marker")
        if not holds:
            # Only our own session can unlock, and the statement ran on it.
            self._link.drop()
            return Grant(held=False, reason="the session no longer holds the lock")
        return self._held()

    async def release(self, record: bool = False) -> None:
        await self._settle_waiter()
        async with self._busy:
            await self._unlock()

    async def _unlock(self) -> None:
        """Give the lock back (the caller holds ``_busy``)."""
        levels = self._link.forget()
        session = self._link.session
        if not levels or session is None or session.conn.is_closed():
            return
        try:
            ours, _ = await session.conn.fetchrow(UNLOCK, self.lock_id, session.marker,
                                                  levels)
        except DB_ERRORS as exc:
            self._link.drop()  # closing the session frees the lock as well
            raise self._db.error("release", exc) from None
        except asyncio.CancelledError:
            self._link.drop()  # cut off: whether it ran is unknown; closing frees the lock
            raise
        if not ours:
            self.pooler_seen("the release ran on a server session without this "
                             "connection's marker")

    async def describe(self) -> Holder:
        session = await self._db.open()
        try:
            return Holder(holder=await self._holder(session.conn))
        finally:
            await close(session.conn)

    async def wait_for_change(self, timeout: float) -> None:
        """Block in the server until the lock is ours or ``timeout`` passes.

        The in-server wait runs as its own task: cancelling this call (the elector does
        when its sleep ends) leaves that wait to finish by its ``lock_timeout``, so a
        grant that races the cancel is still counted, never lost.
        """
        if self._link.levels or self.pooler:
            await asyncio.sleep(timeout)
            return
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.create_task(self._wait_lock(timeout),
                                               name=f"pg-advisory-wait-{self.name}")
        await asyncio.shield(self._waiter)

    # -- the Successor capability (sidecar.lease.Successor) ----------------------------
    async def hand_to(self, identity: str, bound: float) -> None:
        await self._end_hint()
        async with self._busy:
            session = self._link.session
            if not self._link.levels or session is None:
                return  # nothing held: nothing to hand over
            await self._hint.name(session, identity)
        self._hint_expiry = asyncio.create_task(self._unname_after(bound, session),
                                                name=f"pg-advisory-hint-{self.name}")

    async def handing_to_other(self) -> str | None:
        await self._settle_waiter()
        async with self._busy:
            if self.pooler:
                return None
            session = await self._link.connect()
            other = await self._hint.named_other(session)
            if other is not None and self._link.levels:
                # An in-server wait queued before the hint was written was granted at
                # the hand-over's release. The elector asks before an acquire, so it
                # does not know it holds the lock: give it back now, and the named
                # standby, queued behind, has it at once (kept, it stayed with this
                # idle session until idle_session_timeout ended it: 2 s in the
                # benchmark). Asked right after a grant, the elector's release that
                # follows finds nothing left to do. An unlock that fails dropped the
                # session, which frees the lock as well: the grant is gone either way,
                # so the answer is still the named one.
                with contextlib.suppress(BackendError):
                    await self._unlock()
            return other

    async def close(self) -> None:
        await self._end_hint()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            # Ending the session ends the in-server wait (and frees a lock it may just
            # have been granted) instead of letting it run out its lock_timeout. First:
            # a probe queued behind the wait (it waits for the lease's statements) would
            # otherwise hold the shutdown up to its own timeout.
            self._link.drop()
            await waiter
        if self._probe is not None:
            # A probe cut off mid-statement makes a transaction pooler close the server
            # session it ran on, which may be the one a killed holder left holding the
            # lock: let a running statement finish (milliseconds), cancel only a stuck one.
            await asyncio.wait({self._probe}, timeout=self._db.timeout)
            self._probe.cancel()
            with contextlib.suppress(BaseException):
                await self._probe
        with contextlib.suppress(BackendError):
            await self.release()
        async with self._busy:
            await self._link.close()

    def pooler_seen(self, evidence: str) -> Grant:
        """A transaction pooler is in the way: stop claiming at once and for good.

        Dropping the connection ends nothing on the server behind a pooler (the server
        session may keep the lock until the pooler closes it); every other contender
        refuses to take a lock from such a session, so nobody claims meanwhile.
        """
        first = self.pooler is None
        self.pooler = f"{POOLER} ({evidence})"
        self._link.drop()
        self.lost.set()  # wakes a holder's elector, whose next renew is refused
        if first and self._on_pooler is not None:
            self._on_pooler(self.name, self.pooler)
        return self._refused()

    # -- internals -------------------------------------------------------------------
    async def _unname_after(self, bound: float, session: Session) -> None:
        """The hint's bound is over: our session carries our own name again. Where that
        fails on a session that holds nothing, the session is dropped: a hint that
        outlived its bound would keep every other standby out."""
        await asyncio.sleep(bound)
        async with self._busy:
            if self._link.session is not session or session.conn.is_closed():
                return  # the tag went with the session
            try:
                await self._hint.unname(session)
            except DB_ERRORS:
                if not self._link.levels:
                    self._link.drop()

    async def _end_hint(self) -> None:
        expiry, self._hint_expiry = self._hint_expiry, None
        if expiry is not None and not expiry.done():
            expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expiry

    def _start_probe(self, session: Session, again: bool = False) -> None:
        """Behind a proxy, probe a session when it opens, after each grant (``again``) and,
        while the last probe could not tell, at the lease's next statement."""
        if not session.proxied:
            return
        if again:
            session.probe_due = True  # a probe running now reruns when it is done
        if not session.probe_due or (self._probe is not None and not self._probe.done()):
            return
        self._probe = asyncio.create_task(self._probe_pooler(session),
                                          name=f"pg-advisory-probe-{self.name}")

    async def _probe_pooler(self, session: Session) -> None:
        """Behind a proxy: does a fresh connection get a server session of its own, as
        session pooling promises? Runs beside the lease's statements, not before them: the
        checks in every lock statement, not this probe, keep claims apart."""
        while session.probe_due and not self.pooler and not session.conn.is_closed():
            session.probe_due = False
            verdict = await self._db.hands_out_used_sessions(session, self._busy)
            if verdict is None:
                session.probe_due = True  # asked again at the next statement, not in a loop
                return
            if verdict:
                # Once the lease's own statement is done: cutting the connection while a
                # statement runs makes a transaction pooler close the server session it
                # ran on, which may be the one holding another sidecar's lock (freed
                # early, before that holder's claims end).
                async with self._busy:
                    self.pooler_seen("a fresh connection was handed a server session that "
                                     "already carried a connection's marker: a transaction "
                                     "pooler, or a session pool without a server reset")
                return

    def _check(self, session: Session, ours: bool, already: bool) -> Grant | None:
        """The refusal when a lock statement did not run on our own, clean session."""
        if not ours:
            return self.pooler_seen("a lock statement ran on a server session without this "
                                    "connection's marker")
        if not already:
            return None
        if session.proxied and not session.maybe_holds:
            return self.pooler_seen("the server session already held the lock this client "
                                    "never took: it is shared with, or was left by, another "
                                    "client")
        # Our own session holds a lock we have not counted (a grant that raced
        # lock_timeout, or, straight to PostgreSQL, a cause unknown): the state is
        # uncertain, and ending the session frees it (a session pooler resets it).
        reason = ("this session holds the lock it was refused (a grant that raced "
                  "lock_timeout); reconnecting to free it" if session.maybe_holds else
                  "this session held the lock unknown to us; reconnecting to free it")
        log.warning(reason, extra={"lease": self.name, "lock_id": self.lock_id,
                                   "pid": session.backend_pid})
        self._link.drop()
        return Grant(held=False, reason=reason)

    async def _wait_lock(self, timeout: float) -> None:
        async with self._busy:
            if self._link.levels or self.pooler:
                return
            try:
                session = await self._link.connect()
            except BackendError:
                return  # the elector's next try_acquire reports it
            self._start_probe(session)
            wait_ms = f"{max(1, round(timeout * 1000))}ms"
            try:
                # One round trip: lock_timeout ends the wait in the server; the client
                # timeout only guards against a hung server.
                ours, already, counter, timeline, uptime, _, _ = await session.conn.fetchrow(
                    wait_lock_sql(version_num(session.conn)), self.lock_id, self._message,
                    session.marker, *self._halves, wait_ms,
                    timeout=timeout + self._db.timeout)
            except asyncpg.LockNotAvailableError:
                # Still held by someone else, or granted in a race with lock_timeout: the
                # next lock statement's held-key check tells, and frees it.
                session.maybe_holds = True
                return
            except DB_ERRORS as exc:
                self._link.drop()  # timed out or broken: whether it was granted is unknown
                if evidence := pooler_evidence(exc):
                    self.pooler_seen(evidence)
                return
            replied = asyncio.get_running_loop().time()
            self._timelines.saw(timeline, replied)
            if self._check(session, ours, already) is None and counter is not None:
                await self._take(session, counter, timeline, uptime, replied)

    async def _settle_waiter(self) -> None:
        """Let a pending in-server wait finish (it ends by its own lock_timeout)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            await asyncio.shield(waiter)

    async def _take(self, session: Session, counter: int, timeline: int, uptime: float,
                    replied: float) -> Grant | None:
        """Count a grant (None), or give it back when its token would not fit (a refusal).

        A holder from before a server restart or a promotion may not have heard of it
        yet and claims until its last heartbeat + renew_deadline, which was before the
        restart or the promotion: our first claim waits until then, unless the server
        (uptime) and the timeline (:mod:`sidecar.lease.pg_timeline`) are known to be
        older than that.
        """
        fencing_token = token(int(timeline), int(counter), session.era_base)
        if fencing_token is None:
            self._link.drop()  # ending the session gives the lock back
            if not self._out_of_range_logged:  # it never heals: once is enough
                self._out_of_range_logged = True
                log.error(OUT_OF_RANGE, extra={"lease": self.name, "timeline": timeline,
                                               "counter": counter})
            return Grant(held=False, reason=OUT_OF_RANGE)
        age = self._timelines.age(timeline, replied)
        if age < self._timing.renew_deadline:
            age = max(age, await checkpoint_age(lambda: session.conn.fetchrow(CHECKPOINT),
                                                timeline, self._db.where))
        self._granted(fencing_token, min(float(uptime), age))
        return None

    def _granted(self, token: int, known_age: float) -> None:
        """``known_age``: seconds since the server restarted or was promoted, at least."""
        self._link.granted(token)
        self._claims_wait_until = (asyncio.get_running_loop().time()
                                   + self._timing.renew_deadline - known_age)
        if self._link.session is not None:
            self._start_probe(self._link.session, again=True)
        log.debug("advisory lock granted", extra={"lease": self.name, "lock_id": self.lock_id,
                                                  "pid": self.pid, "fencing_token": token})

    def _held(self) -> Grant:
        claim_delay = max(0.0, self._claims_wait_until - asyncio.get_running_loop().time())
        return Grant(held=True, valid_for=self._timing.renew_deadline,
                     fencing_token=self._link.token, holder=self._identity,
                     claim_delay=claim_delay)

    def _gone(self) -> Grant:
        self._link.forget()
        return Grant(held=False, reason="connection to PostgreSQL lost")

    def _refused(self) -> Grant:
        return Grant(held=False, reason=self.pooler or POOLER)

    async def _holder(self, conn: asyncpg.Connection) -> str | None:
        try:
            holder: str | None = await conn.fetchval(HOLDER, *self._halves)
            return holder
        except DB_ERRORS as exc:
            raise self._db.error("look up the holder", exc) from None
