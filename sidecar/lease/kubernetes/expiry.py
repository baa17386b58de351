"""When a Lease held by someone else is free: client-go's skew-tolerant rule.

Expiry never compares wall clocks: a contender notes, on its *own monotonic clock*, when
it last saw the record change (any new ``resourceVersion``), and may take the lease over
only once ``leaseDurationSeconds`` have passed since then without a change. The holder's
claim ends ``lease_duration - safety_margin`` after it *sent* its last successful write.
A standby can only have seen that write after it was sent, so its wait starts later and
lasts longer than the holder's claim: the two never overlap as long as the two clocks'
*rates* differ by less than ``safety_margin / lease_duration`` — their offsets do not
matter at all.

client-go's standbys see less: they compare the record with ``renewTime`` cut to whole
seconds (``metav1.Time`` in JSON), so two renews within one wall-clock second look like
one, and they may date our last renew up to one second too early and take over up to 1 s
before our lease's nominal end. A safety margin of at least one second covers that.

After a release the lease passes at once; the elector keeps the claims apart (the old
holder unpublishes and waits out the claims it handed out before it releases, and a new
term waits one claim horizon before its first claim).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from sidecar.lease.kubernetes.record import Record


def newer(version: str, than: str) -> bool:
    """Whether ``version`` is a later write than ``than``.

    resourceVersions are opaque, but they are etcd revisions in practice; comparing them
    numerically lets a lagging watch event (older than what a GET already showed) be
    ignored instead of restarting the wait. Non-numeric versions: any difference counts.
    """
    if version.isdigit() and than.isdigit():
        return int(version) > int(than)
    return version != than


class Observer:
    """client-go's skew-tolerant expiry rule, made safe against hand edits, on an
    injectable monotonic clock.

    Remembers the last record seen and *when this contender saw it change*; the lease is
    free for us once the holder's duration has passed since then on our own clock —
    whatever ``renewTime`` says, so a wrong wall clock anywhere cannot shorten the wait.

    Hand edits cannot shorten it either. The duration waited is the *longest*
    ``leaseDurationSeconds`` seen during the current holder's term (an edit to 1 s does
    not count), and when a holder's term ends by anything but a proper release — its
    holder cleared or changed by hand, the object deleted or replaced — that holder may
    still be claiming until ``guard_until``: the moment we *saw* the ending write plus
    that longest duration (capped at ``cap``, our own lease duration, so an edit to an
    hour stalls nobody for an hour). Not the last time we saw the holder renew: a watch
    that stalled, lagged or was down may have missed renewals since, and the holder's
    last renewal came before the write that ended its term, never after. A term we win
    before then waits for it before its first claim (``claim_delay``).

    A proper release is one with our release record, or one written after the last
    renewal of the term we saw: a hand edit that clears the holder and sets the duration
    to 1 on a term never renewed looks like a release too (found by the simulator).

    What we cannot have watched, we assume the worst of. A first look that finds no
    object, or one nobody ever held, may follow a deleted object whose holder still
    claims; one cleared by hand, or released with no release record of ours (client-go's
    release, or a hand edit that looks like one), may follow a holder that claims still;
    a holder found there — even one with our own identity, which is another process's (a
    restart, or a second pod with our name) — may have set its duration as low as anyone
    likes by hand: each counts at least ``cap`` from now.
    """

    def __init__(self, monotonic: Callable[[], float], cap: float) -> None:
        self._monotonic = monotonic
        self._cap = cap
        self.seen = False  # nothing observed yet: the caller must look first
        self.record: Record | None = None
        self.changed_at = -math.inf
        # The current holder's term as we saw it: who, when its record last changed,
        # the longest duration it carried.
        self._term_holder = ""
        self._term_seen_at = -math.inf
        self._term_longest = 0
        self._term_found_first = False  # that term was there before our first look
        self.guard_until = -math.inf  # no claim of ours before this (monotonic)

    def observe(self, record: Record | None, took_over: bool = False) -> bool:
        """Note what we read (``None``: no Lease object); True if it changed.
        ``took_over``: ``record`` is our own write, which replaced exactly the record we
        saw last (the write is guarded by its resourceVersion)."""
        if self.seen:
            if record is None and self.record is None:
                return False
            if (record is not None and self.record is not None
                    and not newer(record.version, self.record.version)):
                return False
        now = self._monotonic()
        if not self.seen:
            self._first_look(record, now)
        else:
            self._follow(record, now, took_over)
        self.seen = True
        self.record = record
        self.changed_at = now
        return True

    def _first_look(self, record: Record | None, now: float) -> None:
        # A record that looks released but names no release record of ours (client-go's
        # release, or a hand edit that looks like one) tells nothing of when: its holder
        # may be claiming still.
        if record is None or (not record.holder and not record.claims_ended):
            self._guard(now + self._cap)
        elif record.holder:
            self._start_term(record, longest=max(record.duration, self._cap))
            self._term_found_first = True

    def _follow(self, record: Record | None, now: float, took_over: bool) -> None:
        holder = record.holder if record is not None else ""
        same_object = (record is not None and self.record is not None
                       and record.uid == self.record.uid)
        if self._term_holder and holder == self._term_holder and same_object \
                and not took_over:
            assert record is not None
            self._term_seen_at = now
            self._term_longest = max(self._term_longest, record.duration)
            return
        if self._term_holder and not (same_object and record is not None and (
                record.claims_ended or record.released_after(self.record))):
            # The term ended by a write that is no release: its holder may claim until
            # its last renewal plus its duration. Our own takeover replaced exactly the
            # record we saw, so that renewal is the last one we saw; any other write (a
            # hand edit, the object deleted or replaced) may follow renewals our view
            # missed (a watch stalled, lagging or down), and came after all of them.
            since = self._term_seen_at if took_over else now
            self._guard(since + min(self._term_longest, self._cap))
        self._term_holder = ""
        if record is not None and record.holder:
            self._start_term(record, longest=record.duration)

    def _start_term(self, record: Record, longest: float) -> None:
        self._term_holder = record.holder
        self._term_found_first = False
        self._term_seen_at = self._monotonic()
        self._term_longest = math.ceil(longest)

    def _guard(self, until: float) -> None:
        self.guard_until = max(self.guard_until, until)

    def claim_delay(self) -> float:
        """Seconds from now before a term we win may claim (0: one horizon is enough)."""
        return max(0.0, self.guard_until - self._monotonic())

    def free_in(self, identity: str) -> float:
        """Seconds until ``identity`` may take the lease; 0 when it may now.

        A record naming ``identity`` (asked by a contender that does not hold the lease)
        is another process's. Found on our first look, it is an earlier process's under
        our name (a restart, or a twin such as a StatefulSet pod re-created while the old
        one still runs) and is waited out like anyone's: taken over at once, its claims
        would still have to run out before ours began, and the takeover, a fresh write,
        would make every standby wait for our term too, so a restarted leader would cost
        the group its restart and a lease duration (the kubernetes chaos run's gaps); a
        live twin keeps its lease, as on the row backends. Written while we watched (a
        hand edit that names us), it may be taken over at once: the takeover ends that
        term like any other (``took_over``), so our first claim waits until its claims
        can have run out.
        """
        record = self.record
        if not self.seen or record is None:
            return 0.0
        if record.holder == identity and not self._term_found_first:
            return 0.0
        if record.holder:
            # The record's duration (a peer's own, longer than ours, counts), and never
            # less than the longest of the term up to our own: an edit down to 1 s does
            # not shorten the wait, and an edit up to an hour stalls the group only
            # until somebody writes it back.
            wait = float(max(record.duration, min(self._term_longest, self._cap)))
        elif record.preferred_holder not in ("", identity):
            # Free, but someone is preferred: give it one (capped) lease duration to come
            # and take it, as client-go's non-preferred candidates do; a sidecar's hint
            # only as long as its own bound (a named pod that never comes, a typo, costs
            # the group that much, not a lease duration).
            wait = self._cap if record.preference_for is None else min(
                self._cap, max(0.0, record.preference_for))
        else:
            return 0.0
        return max(0.0, self.changed_at + wait - self._monotonic())
