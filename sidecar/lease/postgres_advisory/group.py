"""The shard group of the ``postgres`` backend: one session per member holds every shard
lock it wins, and is the member's record.

Per shard, the advisory lock's rules are the backend's own (:mod:`.lease`): the lock is
taken with ``pg_try_advisory_lock`` by a statement that checks it runs on our own marked
session and that the session does not hold the key yet; the fencing token is a
transaction id drawn after the grant and committed durably, above the server's timeline
(and token era); a grant on a server that restarted or was promoted less than a renew
deadline ago waits that out before its first claim; a renew proves the session still
holds the lock, and is valid for the renew deadline from its send time. What differs:

- One session, not one per shard: a member holding 256 shards keeps one connection, and
  one heartbeat statement a renew interval reads every lock the session holds
  (``pg_locks``): the renew of every shard at once (:mod:`sidecar.lease.beats`). The
  statements of the group take turns on the session, and the acquires that wait for it
  together go in one lock statement (one round trip, one durable commit, one token for
  every shard it wins: :func:`~.sql.try_lock_many_sql`).
- The session's ``application_name`` is the member record: ``lease-shards <group> <id>``
  while the member is one (visible to every role in ``pg_stat_activity``, as the lock
  holder's name is); the live members are the sessions showing the group's prefix. A
  member that dies takes its record and its locks with its session, at once.
- No in-server wait: a standby of a shard tries the lock when the shard may have become
  free — a release sends ``NOTIFY`` on the group's channel with the lock id, which the
  session listens to, and wakes that shard's standby only — or at its next retry (a
  member that died: its session ends, its locks pass, and the assignment's next member
  campaigns within a renew interval).
- No hand-over hint (a session has one ``application_name``, and it is the member
  record): only the member the assignment names campaigns for a shard, so a released
  shard goes to it anyway.
- Whatever makes the session's lock state uncertain (a lock or unlock statement that
  failed half-way) drops the session, and with it every shard: that is the price of one
  session, and it fails closed. A connection through a proxy (a pooler's session mode
  included) is refused for shards: the backend's pooler probe watches one lease's
  session, and a refusal here keeps that case out rather than half-checked.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import asyncpg

from sidecar.base.clock import Clock, Wakeups
from sidecar.base.errors import BackendError
from sidecar.lease import Backend, Grant, Holder
from sidecar.lease.beats import BeatingGroup, Beats
from sidecar.lease.pg_session import version_num
from sidecar.lease.pg_timeline import CHECKPOINT, OUT_OF_RANGE, Timelines, checkpoint_age, token
from sidecar.lease.postgres_advisory.session import (
    DB_ERRORS,
    Connector,
    Session,
    application_name,
    close,
)
from sidecar.lease.postgres_advisory.sql import (
    MARKER_SETTING,
    lock_id,
    try_lock_many_sql,
)
from sidecar.settings import Settings

log = logging.getLogger("sidecar.lease.postgres")

PREFIX = "lease-shards "
# Our session (marker $1): every advisory lock it holds, its member record set to $2, the
# other sessions of this database whose application_name starts with $3.
BEAT = f"""select current_setting('{MARKER_SETTING}', true) is not distinct from $1::text,
       array(select (l.classid::int8 << 32) | l.objid::int8 from pg_locks l
             where l.locktype = 'advisory' and l.granted and l.objsubid = 1
               and l.pid = pg_backend_pid()),
       set_config('application_name', $2, false),
       array(select a.application_name from pg_stat_activity a
             where a.datname = current_database() and a.pid <> pg_backend_pid()
               and left(a.application_name, length($3)) = $3)"""
# Give the grants of $1 (distinct keys) back on our session (marker $2), and wake each
# key's standby (channel $3; the key is the payload).
UNLOCK = f"""with me as (select current_setting('{MARKER_SETTING}', true)
                         is not distinct from $2::text as ours)
select me.ours,
       case when me.ours then array(select k from unnest($1::int8[]) k
                                    where pg_advisory_unlock(k)) end,
       (select count(pg_notify($3, k::text)) from unnest($1::int8[]) k)
from me"""
MEMBERS = """select application_name from pg_stat_activity
             where datname = current_database() and left(application_name, length($1)) = $1"""
PROXY = ("LEASE_SHARDS on the postgres backend needs a connection straight to PostgreSQL: "
         "the session that holds every shard lock was answered through a proxy or pooler")


def group_tag(group_key: str) -> str:
    """The members' ``application_name`` prefix of a group: a digest, so any key fits."""
    return f"{PREFIX}{hashlib.sha256(group_key.encode()).hexdigest()[:8]} "


def member_name(group_key: str, identity: str) -> str:
    """A member's name as others see it: its identity, cut where PostgreSQL cuts the
    ``application_name`` (63 bytes with the prefix)."""
    prefix = group_tag(group_key)
    return application_name(prefix + identity)[len(prefix):]


def holder_name(session_name: str) -> str:
    """The holder a lock's session names: a shard group's session carries the member
    record's prefix before the member's name."""
    if session_name.startswith(PREFIX):
        return session_name[len(PREFIX):].partition(" ")[2]
    return session_name


class AdvisoryShardGroup(BeatingGroup):
    """A :class:`~sidecar.lease.ShardGroup` on one advisory-lock session (module doc)."""

    def __init__(self, settings: Settings, clock: Clock, group_key: str) -> None:
        store = settings.store
        self._db = Connector(store.dsn, settings.identity, settings.timing, store.schema,
                             store.ensure_schema)
        self._timing = settings.timing
        self._clock = clock
        self._identity = settings.identity
        self._prefix = group_tag(group_key)
        self.member = member_name(group_key, settings.identity)
        self._own_name = application_name(settings.identity)
        self._channel = self._prefix.strip()
        self._key = settings.store.key
        self._session: Session | None = None
        self._busy = asyncio.Lock()  # one statement at a time on the session
        # Acquires, and releases, that wait for the session together share a statement.
        self._acquires: _Turns[_Ask, Grant] = _Turns(self._busy, self._take_all)
        self._releases: _Turns[tuple[SharedLease, Session], None] = _Turns(
            self._busy, self._give_back_all)
        # Per lock id (the NOTIFY's payload): a release wakes the standby of its own shard
        # only. Waking every standby of the member made each send a lock statement, and
        # the one that could win queued behind the rest (hundreds of ms per move).
        self._freed: Wakeups[int] = Wakeups()  # on the clock's monotonic time
        self._timelines = Timelines()
        self._refusal: str | None = None
        self._leases: dict[str, SharedLease] = {}
        # Releases that go on after their caller stopped waiting (SharedLease.release).
        self.releasing: set[asyncio.Future[Any]] = set()
        self._beats = Beats(self._round_trip, settings.timing, clock, group_key)

    # -- ShardGroup --------------------------------------------------------------------
    def lease(self, name: str) -> SharedLease:
        if name not in self._leases:
            self._leases[name] = SharedLease(self, name, lock_id(self._key(name)))
        return self._leases[name]

    def retire(self, name: str) -> None:
        """Nothing to close: the lease keeps nothing open of its own."""

    async def close(self) -> None:
        await self._beats.close()
        async with self._busy:
            session, self._session = self._session, None
            if session is not None:
                await close(session.conn)  # ends the session: every lock and the record

    # -- the session ---------------------------------------------------------------------
    async def session(self) -> Session:
        """The group's session (the caller holds ``_busy``), opened when there is none."""
        if self._refusal is not None:
            raise BackendError(self._refusal)
        session = self._session
        if session is not None and not session.conn.is_closed():
            return session
        self._gone()
        session = await self._db.open(era=True)
        if session.proxied:
            self._refusal = PROXY
            log.error(PROXY, extra={"dsn": self._db.where})
            session.conn.terminate()
            raise BackendError(PROXY)
        try:
            await session.conn.add_listener(self._channel, self._notified)
        except DB_ERRORS as exc:
            session.conn.terminate()
            raise self._db.error("listen", exc) from None
        session.conn.add_termination_listener(self._terminated)
        self._session = session
        return session

    def drop(self) -> None:
        """End the session (its locks with it): its lock state is uncertain."""
        session, self._session = self._session, None
        if session is not None and not session.conn.is_closed():
            session.conn.terminate()
        self._gone()

    def _gone(self) -> None:
        for lease in self._leases.values():
            lease.session_ended()

    def _terminated(self, conn: asyncpg.Connection) -> None:
        if self._session is not None and self._session.conn is conn:
            self._session = None
            self._gone()

    def _notified(self, conn: object, pid: int, channel: str, payload: object) -> None:
        try:
            key = int(str(payload))
        except ValueError:
            return  # not ours: the channel's releases carry their lock id
        self._freed.announce(key, self._clock.monotonic())

    async def wait_for_free(self, key: int, timeout: float, since: float) -> None:
        """Until the release of lock ``key`` is announced, or ``timeout``; at once if one
        was since ``since`` (the caller's last try: a release between that try and this
        wait must not be slept through)."""
        await self._freed.wait(key, timeout, since)

    # -- the round trip ----------------------------------------------------------------
    async def _round_trip(self, held: Mapping[str, Any],
                          advertise: bool) -> tuple[Mapping[str, Any], tuple[str, ...]]:
        """Every lock the session holds, this member's record, the other members."""
        async with self._busy:
            session = await self.session()
            name = (self._prefix + self._identity) if advertise else self._identity
            try:
                ours, locks, _, others = await session.conn.fetchrow(
                    BEAT, session.marker, application_name(name), self._prefix)
            except DB_ERRORS as exc:
                if session.conn.is_closed():
                    self._terminated(session.conn)
                elif isinstance(exc, TimeoutError):
                    self.drop()  # see below
                raise self._db.error("heartbeat", exc) from None
            except asyncio.CancelledError:
                # Cut off by the round trip's bound (a lease's validity): a session that
                # does not answer that long may sit on a connection whose server is gone
                # without a word (a failover that moved the address), where every later
                # statement waits as well, until TCP gives up many minutes later. Every
                # shard's renew has run out by now anyway; a new session next time.
                self.drop()
                raise
            if not ours:
                self._refuse("the heartbeat ran on a server session without this "
                             "connection's marker")
                raise BackendError(self._refusal or PROXY)
        holding = set(locks or ())
        renewed = {key: value for key, value in held.items() if value in holding}
        members = {str(other)[len(self._prefix):] for other in others or ()}
        if advertise:
            members.add(self.member)
        return renewed, tuple(sorted(members))

    def _refuse(self, evidence: str) -> None:
        if self._refusal is None:
            self._refusal = f"{PROXY} ({evidence})"
            log.error(self._refusal, extra={"dsn": self._db.where})
        self.drop()

    async def take(self, lease: SharedLease) -> Grant:
        """One attempt at ``lease``'s lock (its acquire). It runs to its end even when
        the caller stops waiting (the manager stops the electors of shards that move):
        a lock statement cancelled after the server granted it left a lock the group
        did not count on its live session, and the shard's next acquire, finding it,
        dropped the session and every shard with it, over and over in a busy group
        of 1,024 shards. An abandoned attempt gives a grant back at once instead, still
        in its turn on the session, so no later attempt sees the lock counted."""
        ask = _Ask(lease, asyncio.Event())
        attempt = asyncio.ensure_future(self._acquires(ask))
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            ask.abandoned.set()
            self.releasing.add(attempt)
            attempt.add_done_callback(self._abandoned_done)
            raise

    def _abandoned_done(self, attempt: asyncio.Future[Any]) -> None:
        self.releasing.discard(attempt)
        if not attempt.cancelled() and (error := attempt.exception()) is not None:
            log.warning("an abandoned shard acquire failed; the session dropped",
                        extra={"error": str(error)})

    async def _take_all(self, calls: list[_Call[_Ask, Grant]]) -> None:
        """One lock statement for every acquire queued (the caller holds ``_busy``):
        :func:`~.sql.try_lock_many_sql`; answers each."""
        live: dict[int, _Call[_Ask, Grant]] = {}
        for call in calls:
            ask = call.item
            if ask.abandoned.is_set():
                call.answer.set_result(Grant(held=False,
                                             reason="the acquire's caller stopped waiting"))
            elif ask.lease.lock_id in live:  # not seen: one elector per shard at a time
                call.answer.set_result(Grant(
                    held=False, reason="another acquire of the shard is in flight"))
            else:
                live[ask.lease.lock_id] = call
        if not live:
            return
        session = await self.session()
        conn = session.conn
        sent = self._clock.monotonic()
        first = next(iter(live.values())).item.lease.name
        try:
            ours, already, got, counter, timeline, uptime, _, _ = await conn.fetchrow(
                try_lock_many_sql(version_num(conn)), list(live),
                f"{self._identity} acquired {first} ({len(live)} asked)", session.marker)
        except DB_ERRORS as exc:
            self.drop()  # granted or not: a dropped session holds nothing
            raise self._db.error("acquire", exc) from None
        replied = self._clock.monotonic()
        self._timelines.saw(int(timeline), replied)
        refused: str | None = None
        if not ours:
            self._refuse("a lock statement ran on a server session without this "
                         "connection's marker")
            refused = self._refusal or PROXY
        elif already:
            # Our session holds a lock we do not count (a release that failed half-way):
            # its state is uncertain, and only ending the session frees it.
            log.warning("the shard group's session held a lock unknown to it; "
                        "reconnecting to free it (every shard of the group goes)",
                        extra={"lease": live[already[0]].item.lease.name,
                               "lock_id": already[0]})
            self.drop()
            refused = "the session held the lock unknown to us"
        won = [live[key].item for key in got or ()]
        fencing_token = None if refused or not won else \
            token(int(timeline), int(counter), session.era_base)
        if won and not refused and fencing_token is None:
            await self._unlock(session, [ask.lease for ask in won])
            log.error(OUT_OF_RANGE, extra={"lease": first, "timeline": timeline})
            refused = OUT_OF_RANGE
        delay = 0.0
        if fencing_token is not None:
            age = self._timelines.age(int(timeline), replied)
            if age < self._timing.renew_deadline:
                age = max(age, await checkpoint_age(lambda: conn.fetchrow(CHECKPOINT),
                                                    int(timeline), self._db.where))
            delay = max(0.0, self._timing.renew_deadline - min(float(uptime), age))
        granted = {ask.lease.lock_id for ask in won}
        for key, call in live.items():
            lease = call.item.lease
            if refused:
                call.answer.set_result(Grant(held=False, reason=refused))
            elif key not in granted:
                call.answer.set_result(Grant(held=False, reason="held by another session"))
            elif call.item.abandoned.is_set():  # nobody claims with it: give it back now
                await self._unlock(session, [lease])
                call.answer.set_result(Grant(held=False,
                                             reason="the acquire's caller stopped waiting"))
            else:
                assert fencing_token is not None
                lease.granted(session, fencing_token)
                # The grant proves the lock from the statement's send, not from the
                # caller's ask: the turn it waited for (behind other statements) does
                # not shorten its validity. ``_tried`` is read after the elector's own
                # send time.
                queued = max(0.0, sent - lease._tried)
                call.answer.set_result(Grant(
                    held=True, valid_for=self._timing.renew_deadline + queued,
                    fencing_token=fencing_token, holder=self._identity, claim_delay=delay))

    async def give_back(self, lease: SharedLease, session: Session) -> None:
        """Unlock ``lease`` on ``session`` if that is still the group's session; the
        releases that wait for the session together go in one statement (a member that
        stops gives every shard back at once)."""
        await self._releases((lease, session))

    async def _give_back_all(self, calls: list[_Call[tuple[SharedLease, Session], None]]
                             ) -> None:
        session = self._session
        leases = [lease for lease, held_on in (call.item for call in calls)
                  if held_on is session]
        if session is not None and leases and not session.conn.is_closed():
            await self._unlock(session, leases)
        for call in calls:
            call.answer.set_result(None)

    async def _unlock(self, session: Session, leases: list[SharedLease]) -> None:
        try:
            ours, _, _ = await session.conn.fetchrow(
                UNLOCK, [lease.lock_id for lease in leases], session.marker, self._channel)
        except DB_ERRORS as exc:
            self.drop()  # closing the session frees the locks as well
            raise self._db.error("release", exc) from None
        if not ours:
            self._refuse("the release ran on a server session without this connection's "
                         "marker")


T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Call(Generic[T, R]):
    item: T
    answer: asyncio.Future[R]


class _Turns(Generic[T, R]):
    """Calls that wait for the group's session together go in one statement: whoever
    gets the turn first sends every call queued until the session is its own (``send``
    answers each), so a burst costs one round trip, not one each. One batch at a time
    waits for the session, so the heartbeat (the renew of every shard) waits behind one
    at most: a member taking 1,024 free shards once queued 1,024 lock statements ahead of
    it, and every shard's renew ran out."""

    def __init__(self, busy: asyncio.Lock,
                 send: Callable[[list[_Call[T, R]]], Awaitable[None]]) -> None:
        self._turn = asyncio.Lock()
        self._busy = busy
        self._send = send
        self._queue: list[_Call[T, R]] = []

    async def __call__(self, item: T) -> R:
        call: _Call[T, R] = _Call(item, asyncio.get_running_loop().create_future())
        self._queue.append(call)
        async with self._turn:
            if not call.answer.done():
                calls: list[_Call[T, R]] = []
                try:
                    async with self._busy:  # every call queued until the session is ours
                        calls, self._queue = self._queue, []
                        await self._send(calls)
                except Exception as exc:  # every call of the statement sees it
                    for each in calls:
                        if not each.answer.done():
                            each.answer.set_exception(exc)
                finally:  # cancelled (the loop ends): the others are too
                    for each in calls:
                        each.answer.cancel()
        return call.answer.result()


@dataclass
class _Ask:
    """One shard's acquire, waiting for a lock statement to carry it."""

    lease: SharedLease
    abandoned: asyncio.Event  # its caller stopped waiting: a grant goes back at once


class SharedLease:
    """One shard's lock on the group's session: the :class:`~sidecar.lease.Lease`
    protocol, renewed with the group."""

    def __init__(self, group: AdvisoryShardGroup, name: str, key: int) -> None:
        self.name = name
        self.lock_id = key
        self._group = group
        self._session: Session | None = None  # the session our lock is on
        self._token: int | None = None
        self._registration = 0
        self._tried = float("-inf")  # monotonic: our last acquire's send time
        self._releasing: asyncio.Future[None] | None = None  # our unlock, while in flight
        # Set the moment the session holding our lock ends: the elector renews at once.
        self.lost: asyncio.Event | None = asyncio.Event()

    def granted(self, session: Session, fencing_token: int) -> None:
        self._session, self._token = session, fencing_token
        self._registration = self._group._beats.register(self.name, self.lock_id)
        assert self.lost is not None
        self.lost.clear()

    def session_ended(self) -> None:
        if self._session is not None:
            self._session, self._token = None, None
            assert self.lost is not None
            self.lost.set()

    async def try_acquire(self) -> Grant:
        if self._session is not None:
            return await self.try_renew()
        self._tried = self._group._clock.monotonic()
        if self._releasing is not None and not self._releasing.done():
            # Our last unlock still waits for its turn on the session (its caller gave up
            # waiting): a lock statement now would find the lock on the session, not
            # counted, and drop the session with every shard. Its NOTIFY wakes us.
            return Grant(held=False, reason="the shard's last release is still in flight")
        return await self._group.take(self)

    async def try_renew(self) -> Grant:
        """From the group's heartbeat: valid for the renew deadline from the send time
        of the heartbeat that saw our lock (:mod:`sidecar.lease.beats`)."""
        group = self._group
        asked = group._clock.monotonic()
        if self._session is None:
            return Grant(held=False, reason="connection to PostgreSQL lost")
        value, sent = await group._beats.renewed(self.name, self._registration, asked)
        if value is None or self._session is None:
            self._session, self._token = None, None
            return Grant(held=False, reason="the session no longer holds the lock")
        return Grant(held=True, valid_for=max(0.0, group._timing.renew_deadline - (asked - sent)),
                     fencing_token=self._token, holder=group._identity)

    async def release(self, record: bool = False) -> None:
        session, self._session, self._token = self._session, None, None
        if session is None:
            return
        # The unlock runs to its end even when the caller stops waiting (the elector
        # bounds a release, and the unlock queues behind the session's other statements):
        # a lock left on the group's live session kept the shard from every member for as
        # long as that session lived (found by the simulator). Meanwhile nothing claims:
        # the elector stopped claiming before it released.
        task = asyncio.ensure_future(self._give_up(session))
        self._releasing = task
        self._group.releasing.add(task)
        task.add_done_callback(self._released)
        await asyncio.shield(task)

    def _released(self, task: asyncio.Future[None]) -> None:
        self._group.releasing.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            # Seen by the caller too, unless it stopped waiting; the session dropped.
            log.warning("shard release failed; its lock went with the session",
                        extra={"lease": self.name, "error": str(error)})

    async def _give_up(self, session: Session) -> None:
        await self._group._beats.forget(self.name, self._registration)
        await self._group.give_back(self, session)

    async def describe(self) -> Holder:
        return Holder(holder=self._group._identity if self._session is not None else None,
                      fencing_token=self._token)

    async def wait_for_change(self, timeout: float) -> None:
        await self._group.wait_for_free(self.lock_id, timeout, self._tried)


def make_advisory_group(backend: Backend, settings: Settings, clock: Clock,
                        group_key: str) -> AdvisoryShardGroup:
    """``BackendEntry.shard_group`` of ``postgres``: a session of the group's own, apart
    from the backend's per-lease sessions."""
    return AdvisoryShardGroup(settings, clock, group_key)


async def list_members(settings: Settings, group_key: str) -> list[str]:
    """The live members of a shard group (``lease-sidecar status``), from
    ``pg_stat_activity``: read only."""
    db = Connector(settings.store.dsn, settings.identity, settings.timing)
    session = await db.open()
    prefix = group_tag(group_key)
    try:
        rows = await session.conn.fetch(MEMBERS, prefix)
    except DB_ERRORS as exc:
        raise db.error("list members", exc) from None
    finally:
        await close(session.conn)
    return [str(row[0])[len(prefix):] for row in rows]

