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

from collections.abc import Callable

from sidecar.lease.kubernetes.record import Record


def _newer(version: str, than: str) -> bool:
    """Whether ``version`` is a later write than ``than``.

    resourceVersions are opaque, but they are etcd revisions in practice; comparing them
    numerically lets a lagging watch event (older than what a GET already showed) be
    ignored instead of restarting the wait. Non-numeric versions: any difference counts.
    """
    if version.isdigit() and than.isdigit():
        return int(version) > int(than)
    return version != than


class Observer:
    """client-go's skew-tolerant expiry rule, on an injectable monotonic clock.

    Remembers the last record seen and *when this contender saw it change*; the lease is
    free for us once ``leaseDurationSeconds`` have passed since then on our own clock —
    whatever ``renewTime`` says, so a wrong wall clock anywhere cannot shorten the wait.

    A Lease object that disappears while someone holds it (deleted by hand) is not free
    at once either: its holder may still be claiming, so we wait out that holder's
    duration from when we saw it go.
    """

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self.seen = False  # nothing observed yet: the caller must look first
        self.record: Record | None = None
        self.changed_at = 0.0
        self._vanished_wait = 0  # the duration of a holder whose object was deleted

    def observe(self, record: Record | None) -> bool:
        """Note what we read (``None``: no Lease object); True if it changed."""
        if self.seen:
            if record is None and self.record is None:
                return False
            if (record is not None and self.record is not None
                    and not _newer(record.version, self.record.version)):
                return False
        if record is None and self.record is not None and self.record.holder:
            self._vanished_wait = self.record.duration
        elif record is not None:
            self._vanished_wait = 0
        self.seen = True
        self.record = record
        self.changed_at = self._monotonic()
        return True

    def free_in(self, identity: str) -> float:
        """Seconds until ``identity`` may take the lease; 0 when it may now."""
        record = self.record
        if record is None:
            wait = self._vanished_wait
        elif not record.holder or record.holder == identity:
            wait = 0
        else:
            wait = record.duration
        if not self.seen or not wait:
            return 0.0
        return max(0.0, self.changed_at + wait - self._monotonic())
