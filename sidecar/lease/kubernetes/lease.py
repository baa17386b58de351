"""One Lease object as seen by one contender: acquire, renew, release, describe, wait.

Every contender watches the Lease once connected.

- Standbys take a release (``holderIdentity`` cleared and ``leaseDurationSeconds`` set to
  1, like client-go's ``ReleaseOnCancel``) over at once, and a holder that died the moment
  its lease runs out on the standby's clock (:mod:`.expiry`) — not at the next retry.
- The holder believes its watch. A write to the Lease that is not its own (a newer
  ``resourceVersion`` than its last write returned) wakes its elector through ``lost``,
  and the next renew, at once, answers by what the write did:

  * holder changed or cleared, or the object deleted: the term is over; step down
    without writing (someone else's write decides the object now);
  * ``preferredHolder`` set to someone else during our term: a cooperative end of term,
    as client-go's coordinated leader election asks — unpublish, wait out the claims,
    release (the ``release`` of the refusing :class:`~sidecar.lease.Grant`);
  * still ours but edited (a duration or count changed by hand): renew now, writing our
    own fields back, before a client-go standby can act on the edit.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Awaitable, Callable
from dataclasses import replace

from sidecar.base.clock import Clock
from sidecar.base.errors import Forbidden
from sidecar.lease import Grant, Holder
from sidecar.lease.kubernetes.expiry import Observer, newer
from sidecar.lease.kubernetes.record import (
    HINT_ANNOTATION,
    HINT_UNTIL_ANNOTATION,
    Record,
    fencing_token,
    micro_time,
    next_count,
)
from sidecar.lease.kubernetes.transport import Conflict, LeaseApi, LeaseWatch
from sidecar.settings import Timing

NO_TOKEN = ("the apiserver's resourceVersion {!r} is not a number: no fencing token can be "
            "derived from it, so the lease is not taken (docs/kubernetes-backend.md)")


class KubeLease:
    """Lease ``name``, stored as the Lease object ``object_name``, contended for by
    ``identity``; ``api`` connects (once, on first use) and returns the Lease calls."""

    def __init__(self, name: str, *, object_name: str, identity: str, timing: Timing,
                 clock: Clock, api: Callable[[], Awaitable[LeaseApi]]) -> None:
        self.name = name
        self._object = object_name
        self._identity = identity
        self._clock = clock
        self._connect = api
        self._api: LeaseApi | None = None
        # Whole seconds on the wire; rounding up only makes others wait longer.
        self._duration = max(1, math.ceil(timing.lease_duration))
        self._valid_for = timing.validity
        self._observer = Observer(clock.monotonic, cap=self._duration)
        self._mine: Record | None = None  # our last successful write in this term
        # Set when the watch shows a write to our Lease that is not ours: wakes a
        # holder's elector, whose renew then says what it meant (see the module doc).
        self.lost: asyncio.Event | None = asyncio.Event()
        self._ended = ""  # why the term is over, as the watch showed it
        self._preferred_at_start = ""  # a preferredHolder already set when we took it
        self._token: int | None = None  # this term's fencing token (record.fencing_token)
        self._taking_over = False  # an acquiring write is out
        self._changed = asyncio.Event()
        self._watch: LeaseWatch | None = None

    # -- the Lease protocol ------------------------------------------------------------
    async def try_acquire(self) -> Grant:
        api = await self._connected()
        watched = self._observer.record
        if watched is not None and self._watch is not None and (
                self._watch.up or self._observer.free_in(self._identity) == 0):
            # A standby reads the Lease once, then follows the watch: while the watch is
            # up, what it delivered is the Lease as it is, and no GET is sent (it polls
            # only while the watch is down). And when the watch just showed the lease
            # free (a release, or it ran out), the GET is skipped anyway, saving a round
            # trip on every handover. A stale view costs nothing but a 409, because the
            # write is guarded by the version we saw.
            current: Record | None = watched
        else:
            current = await self._read(api)
        wait = self._observer.free_in(self._identity)
        if wait > 0:
            assert current is not None
            if current.holder:
                return Grant(held=False, holder=current.holder,
                             reason=f"held by {current.holder} (free in {wait:.1f}s unless "
                                    "renewed)")
            return Grant(held=False, reason=f"deferring to preferredHolder "
                                            f"{current.preferred_holder} for {wait:.1f}s")
        if current is not None and fencing_token(current.version) is None:
            return Grant(held=False, reason=NO_TOKEN.format(current.version))
        # A new term every time — also when the record names us (a restarted process
        # with the same identity, or a hand edit): the token is the resourceVersion of
        # this very write (record.fencing_token), larger than every earlier term's.
        now = micro_time(self._clock.wall())
        if current is None:
            wanted = Record(holder=self._identity, duration=self._duration,
                            transitions=next_count(-1), version="", acquire_time=now,
                            renew_time=now)
        else:
            # The release record goes: it speaks of the term this write ends.
            wanted = replace(current.recording_release(False), holder=self._identity,
                             duration=self._duration, transitions=next_count(
                                 current.transitions), acquire_time=now, renew_time=now)
        # While the write is out, a record naming us is our takeover (or a twin's, based
        # on the same record: then ours fails), even when the watch shows it before the
        # reply comes back.
        self._taking_over = True
        try:
            if current is None:
                written = await api.create(self._object, wanted)
            else:
                written = await api.replace(self._object, wanted)
        except Conflict:
            # Lost the race: read the winner's record so our wait counts from it.
            winner = await self._read(api)
            holder = winner.holder if winner else None
            return Grant(held=False, holder=holder or None,
                         reason=f"lost the race to {holder or 'another contender'}")
        finally:
            self._taking_over = False
        token = fencing_token(written.version)
        if token is None:  # a create answered with a version that is no number
            self._mine = written
            await self.release()
            return Grant(held=False, reason=NO_TOKEN.format(written.version))
        self._token = token
        self._ended = ""
        assert self.lost is not None
        self.lost.clear()
        self._preferred_at_start = written.preferred_holder
        grant = self._holding(written, took_over=True)
        # ``current`` is exactly the object this write replaced (the write is guarded by
        # its resourceVersion), so its release record speaks of the term before ours.
        return replace(grant, claim_delay=self._observer.claim_delay(),
                       previous_claims_ended=current is not None and current.claims_ended)

    async def try_renew(self) -> Grant:
        mine = self._mine
        if mine is None:
            return Grant(held=False, reason="not holding")
        assert self.lost is not None
        self.lost.clear()
        if self._ended:
            self._mine = None
            return Grant(held=False, reason=self._ended)
        latest = self._latest_ours(mine)
        if latest.preferred_holder not in ("", self._identity, self._preferred_at_start):
            # Keep _mine: the elector releases after it has waited out our claims.
            return Grant(held=False, release=True,
                         reason=f"preferredHolder set to {latest.preferred_holder}")
        api = await self._connected()
        try:
            written = await api.replace(self._object, self._renewed(latest, mine))
        except Forbidden as exc:
            # Our own Lease refused to us (the Role changed, or the object is gone and
            # re-creating it would need create): we cannot hold it any longer.
            self._mine = None
            return Grant(held=False, reason=str(exc))
        except Conflict:
            # Something else wrote the object; it is still ours only if it still names
            # us in the same term.
            current = await self._read(api)
            if self._ended or not self._is_ours(current, mine):
                self._mine = None
                holder = current.holder if current else None
                return Grant(held=False, holder=holder or None, reason=self._ended or (
                    f"taken over by {holder}" if holder else "lease released or deleted "
                    "by someone else"))
            assert current is not None
            try:
                written = await api.replace(self._object, self._renewed(current, mine))
            except Conflict:
                self._mine = None
                return Grant(held=False, reason="lost the race while renewing")
        return self._holding(written)

    async def release(self, record: bool = False) -> None:
        """Give the lease back as client-go's ``ReleaseOnCancel`` does: holder ``""``,
        ``leaseDurationSeconds`` 1, ``acquireTime`` = ``renewTime`` = now, the count
        kept; standbys of either kind take over at once. With ``record`` the same write
        records the release (:data:`.record.RELEASED_ANNOTATION`). A term that has not
        waited out an earlier one yet passes the wait on instead (below)."""
        mine, self._mine = self._mine, None
        if mine is None or self._ended:
            return
        api = await self._connected()
        base = self._unpreferred(self._latest_ours(mine))
        # A term given back while it still waited for an earlier term's claims to run
        # out (one ended by a hand edit, say) hands that wait on: holder cleared with the
        # seconds left as its duration, and its own acquireTime kept, so that no standby
        # reads a release and claims at once (a fresh one, that never saw the earlier
        # term, least of all).
        waiting = 0.0 if record else self._observer.claim_delay()
        for _ in range(2):
            now = micro_time(self._clock.wall())
            duration, acquired = (1, now) if waiting <= 0 else (
                math.ceil(waiting), mine.acquire_time)
            released = replace(base, holder="", duration=duration,
                               transitions=mine.transitions, acquire_time=acquired,
                               renew_time=now).recording_release(record)
            try:
                self._observe(await api.replace(self._object, released))
                return
            except Conflict:
                current = await self._read(api)
                if not self._is_ours(current, mine):
                    return  # already someone else's: nothing of ours to give back
                assert current is not None
                base = self._unpreferred(current)

    # -- the Successor capability (sidecar.lease.Successor) ----------------------------
    async def hand_to(self, identity: str, bound: float) -> None:
        """Name the next holder in ``spec.preferredHolder`` of our own Lease, the field
        client-go's coordinated election reads. The release keeps it, and standbys of
        either kind that it does not name defer to it for at most one lease duration
        (:meth:`.expiry.Observer.free_in`; that is ``bound`` here). The apiserver drops
        the field unless its CoordinatedLeaderElection gate is on; the hint annotations,
        counting for ``bound``, keep sidecar standbys deferring then (:mod:`.record`)."""
        mine = self._mine
        if mine is None or self._ended:
            return
        api = await self._connected()
        until = micro_time(self._clock.wall() + bound)
        named = preferring(self._latest_ours(mine), identity, until)
        self._preferred_at_start = identity  # our own wish, not a request to end our term
        self._holding(await api.replace(self._object, self._renewed(named, mine)))

    async def handing_to_other(self) -> str | None:
        """None: ``try_acquire`` itself defers to a ``preferredHolder`` that names someone
        else, whoever wrote it (a client-go coordinator or a sidecar's hand-over)."""
        return None

    def _unpreferred(self, record: Record) -> Record:
        """A release clears a ``preferredHolder`` naming us: it has been served, and left
        in place it would hold every standby back for a lease duration."""
        return preferring(record, "") if record.preferred_holder == self._identity else record

    async def describe(self) -> Holder:
        record = await self._read(await self._connected())
        if record is None:
            return Holder(holder=None)
        return Holder(holder=record.holder or None, fencing_token=record.shown_token,
                      expires_at=record.expires_at())

    async def wait_for_change(self, timeout: float) -> None:
        """Return when the lease may be ours: released, gone, or run out on our clock.

        When it already looks free (we are here after a failed call), any change the
        watch shows is worth another try — the apiserver is back — but nothing else is.
        """
        self._ensure_watch()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        free_at_start = self._observer.free_in(self._identity) <= 0
        while True:
            left = deadline - loop.time()
            free_in = self._observer.free_in(self._identity)
            if left <= 0 or (free_in <= 0 and not free_at_start):
                return
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left if free_in <= 0
                                       else min(left, free_in))
            except TimeoutError:
                continue
            if free_at_start:
                return

    def stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()

    # -- internals ---------------------------------------------------------------------
    async def _connected(self) -> LeaseApi:
        self._api = await self._connect()
        self._ensure_watch()
        return self._api

    async def _read(self, api: LeaseApi) -> Record | None:
        record = await api.get(self._object)
        self._observe(record)
        return record

    def _observe(self, record: Record | None, took_over: bool = False) -> None:
        took_over = took_over or (self._taking_over and record is not None
                                  and record.holder == self._identity)
        if not self._observer.observe(record, took_over):
            return
        mine = self._mine
        if mine is not None and (record is None or newer(record.version, mine.version)):
            self._foreign_write(record, mine)
        self._changed.set()
        self._changed = asyncio.Event()

    def _foreign_write(self, record: Record | None, mine: Record) -> None:
        """A write to our Lease, while we hold it, that is not ours (or the watch's echo
        of our own write, arriving before its reply: then nothing differs)."""
        if record is None:
            self._ended = "the Lease object was deleted by someone else"
        elif record.holder != self._identity:
            self._ended = (f"holder changed to {record.holder} by someone else"
                           if record.holder else "holder cleared by someone else")
        elif not self._same_term(record, mine):
            self._ended = "another process started a term under our identity"
        elif (record.duration, record.transitions, record.preferred_holder) == (
                mine.duration, mine.transitions, mine.preferred_holder):
            return  # our own renew, or an edit of fields that are not ours
        assert self.lost is not None
        self.lost.set()

    def _latest_ours(self, mine: Record) -> Record:
        """The newest record we saw of our term: ours, or a foreign edit of it."""
        seen = self._observer.record
        if (seen is not None and seen.holder == self._identity
                and newer(seen.version, mine.version)):
            return seen
        return mine

    def _holding(self, written: Record, took_over: bool = False) -> Grant:
        self._mine = written  # first: the observer must not take our write for a foreign one
        self._observe(written, took_over)
        return Grant(held=True, valid_for=self._valid_for, fencing_token=self._token,
                     holder=self._identity)

    def _renewed(self, base: Record, mine: Record) -> Record:
        """``base`` (the object as last seen) with our term's fields written back, and
        the term's token shown (:data:`.record.TOKEN_ANNOTATION`)."""
        return replace(base.showing_token(self._token), holder=self._identity,
                       duration=self._duration, transitions=mine.transitions,
                       acquire_time=mine.acquire_time,
                       renew_time=micro_time(self._clock.wall()))

    def _is_ours(self, current: Record | None, mine: Record) -> bool:
        return (current is not None and current.holder == self._identity
                and self._same_term(current, mine))

    @staticmethod
    def _same_term(current: Record, mine: Record) -> bool:
        """Our term, though perhaps edited: a new term (of a second process under our
        identity) changes both the count and acquireTime, a hand edit rarely both."""
        return (current.transitions == mine.transitions
                or current.acquire_time == mine.acquire_time)

    def _ensure_watch(self) -> None:
        # Not before a call has connected: until then nothing was observed to wait for.
        if self._watch is not None or self._api is None:
            return
        # The watch is a task on our event loop: it hands records to the observer directly.
        self._watch = self._api.watch(self._object, self._observe)


def preferring(record: Record, holder: str, until: str = "") -> Record:
    """``record`` with ``spec.preferredHolder`` set to ``holder`` ("" removes it) and the
    same in the hint annotations, counting until MicroTime ``until`` (the apiserver drops
    the field without its CoordinatedLeaderElection gate; see :mod:`.record`). The
    apiserver wants a ``strategy`` beside the field; ours is client-go's only one."""
    source = copy.deepcopy(record.source)
    spec = source.setdefault("spec", {})
    metadata = source.setdefault("metadata", {})
    if holder:
        spec["preferredHolder"] = holder
        spec.setdefault("strategy", "OldestEmulationVersion")
        metadata.setdefault("annotations", {}).update(
            {HINT_ANNOTATION: holder, HINT_UNTIL_ANNOTATION: until})
    else:
        spec.pop("preferredHolder", None)
        for key in (HINT_ANNOTATION, HINT_UNTIL_ANNOTATION):
            (metadata.get("annotations") or {}).pop(key, None)
    return replace(record, preferred_holder=holder, source=source)
