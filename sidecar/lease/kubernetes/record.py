"""The Lease object on the wire: the five spec fields the election owns.

They are written as client-go v0.37's ``leaderelection`` writes them:

- ``holderIdentity``: the holder, ``""`` once released;
- ``leaseDurationSeconds``: how long others must wait after they last saw it change
  (1 once released);
- ``acquireTime`` / ``renewTime``: MicroTime, informative only (expiry never reads them,
  see :mod:`.expiry`); a new term sets both, a renew only ``renewTime``, a release sets
  both to the release time;
- ``leaseTransitions``: the count of terms. 0 when the object is created, +1 with every
  new term: whenever the holder changes (as client-go counts) and also when the same
  identity starts a new term (a restarted process must not share its predecessor's
  token; client-go would keep the count there). A renew or a release keeps it.

The fencing token is :meth:`Record.token`, not the count alone: a count restarts at 0
whenever the object is deleted and re-created (by a sidecar, ``helm upgrade`` or
``kubectl``) and anyone can edit it by hand. The token puts the object's
``creationTimestamp`` (Unix seconds, set by the apiserver, later for every re-created
object) above the count::

    token = creationTimestamp * 2**20 + leaseTransitions    (<= 2**53 - 1 until 2242)

so a re-created object's first term outranks every term of the object before it, as
long as that object saw fewer than 2**20 terms and was created at least a second
earlier. A count edited down by hand is outranked by the highest token the contender has
seen (:mod:`.lease` writes the count so its token exceeds it); a count edited to 2**20 or
more would reach into the next second's tokens, so such a term is refused with a reason.
``leaseTransitions`` itself stays a small int32, as client-go reads it.

The next holder a hand-over names lives in ``spec.preferredHolder``, which client-go's
coordinated election reads — but the apiserver keeps that field only with its
CoordinatedLeaderElection gate on (beta, off by default), and silently drops it
otherwise. So the same name also goes into the annotation :data:`HINT_ANNOTATION`, with
:data:`HINT_UNTIL_ANNOTATION` saying until when it counts (the writer's clock): it counts
while the object's ``renewTime`` — written by the same holder when it releases — is not
past that, so a hint left behind by a holder that never clears it (client-go keeps the
metadata) goes stale by itself instead of holding a later release back. The field wins
where the apiserver keeps it.

A release by this sidecar — written only once the holder's claims have all run out —
also sets the annotation :data:`RELEASED_ANNOTATION` to the ended term's fencing token.
The next acquire reads the object it replaces (its write is guarded by that object's
``resourceVersion``), and finds the record true only if the object is released and the
token is that of the term the object still counts: then its first claim need not wait
a claim horizon (``Grant.previous_claims_ended``). Our acquire removes the annotation, so
it never outlives the release it records; client-go keeps it but counts a new term, so
a later release or hand edit never matches it.

Every other field is someone else's and survives every write of ours: each write is the
object as last read (or as the apiserver returned our previous write) with only those
five fields changed — labels, annotations, ownerReferences, ``spec.preferredHolder``,
``spec.strategy`` and fields this code has never heard of. (client-go keeps the metadata
but rebuilds the spec, so its own writes drop ``preferredHolder`` and ``strategy``
unless it runs with coordinated leader election.)

Every write carries the ``resourceVersion`` and ``uid`` it was based on, so two
contenders cannot both win (the apiserver answers ``409 Conflict`` to the slower one) and
a renew never re-creates an object deleted by hand (Leases allow create-on-update).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

# The fencing token's low part: leaseTransitions must stay below 2**TOKEN_COUNT_BITS.
TOKEN_COUNT_BITS = 20
TOKEN_COUNT_LIMIT = 1 << TOKEN_COUNT_BITS
# spec.preferredHolder's stand-in where the apiserver drops the field (see the module doc).
HINT_ANNOTATION = "lease-sidecar/preferred-holder"
HINT_UNTIL_ANNOTATION = "lease-sidecar/preferred-until"
# The release record: the fencing token of the term released after its claims ran out.
RELEASED_ANNOTATION = "lease-sidecar/released-term"


def micro_time(wall: float) -> str:
    """RFC 3339 with exactly six fractional digits: the apiserver's MicroTime format.

    (The generated client's ``datetime.isoformat()`` drops the fraction when it is zero,
    which MicroTime then rejects, so we send strings we formatted ourselves.)
    """
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Record:
    """The parts of a Lease object the election reads, and the object they came from."""

    holder: str  # "" when released
    duration: int  # leaseDurationSeconds
    transitions: int  # leaseTransitions: the fencing token
    version: str  # metadata.resourceVersion
    acquire_time: str | None = None
    renew_time: str | None = None
    # spec.preferredHolder: someone asks the holder to end its term in this one's favour.
    preferred_holder: str = ""
    # metadata.creationTimestamp as Unix seconds: the fencing token's high part.
    created: int = 0
    # The release record's token (RELEASED_ANNOTATION), "" when there is none.
    released_term: str = ""
    # The whole object as the apiserver sent it: a write starts from it, so every field
    # we do not own goes back unchanged. Empty for an object we are about to create.
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> Record:
        spec = obj.get("spec") or {}
        return cls(holder=spec.get("holderIdentity") or "",
                   duration=int(spec.get("leaseDurationSeconds") or 0),
                   transitions=int(spec.get("leaseTransitions") or 0),
                   version=str(obj["metadata"]["resourceVersion"]),
                   acquire_time=spec.get("acquireTime"), renew_time=spec.get("renewTime"),
                   preferred_holder=spec.get("preferredHolder") or _hinted(obj),
                   created=_unix_seconds(obj["metadata"].get("creationTimestamp")),
                   released_term=str((obj["metadata"].get("annotations") or {}).get(
                       RELEASED_ANNOTATION) or ""),
                   source=obj)

    def token(self, transitions: int | None = None) -> int:
        """The fencing token of the term counted ``transitions`` (default: this
        record's) on this object; see the module's doc for the layout."""
        count = self.transitions if transitions is None else transitions
        return self.created * TOKEN_COUNT_LIMIT + count

    @property
    def released(self) -> bool:
        """Released as our sidecar and client-go's ``ReleaseOnCancel`` release: no holder,
        ``leaseDurationSeconds`` 1. A releasing holder has stopped claiming; a holder
        cleared any other way (by hand) may still be claiming."""
        return not self.holder and self.duration <= 1

    @property
    def claims_ended(self) -> bool:
        """Released by a sidecar whose release record names the term this object counts:
        that holder's claims had all run out before the release."""
        return self.released and self.released_term == str(self.token())

    def recording_release(self, record: bool) -> Record:
        """This record with the release record set to its own term (``record``) or
        removed (every other write of ours)."""
        term = str(self.token()) if record else ""
        if term == self.released_term:
            return self
        source = copy.deepcopy(self.source)
        annotations = source.setdefault("metadata", {}).setdefault("annotations", {})
        if term:
            annotations[RELEASED_ANNOTATION] = term
        else:
            annotations.pop(RELEASED_ANNOTATION, None)
        return replace(self, released_term=term, source=source)

    @property
    def never_held(self) -> bool:
        """No holder and no renewTime: as ``helm`` or ``kubectl`` create it."""
        return not self.holder and not self.renew_time

    def body(self, name: str) -> dict[str, Any]:
        """The object to write: the one we read with our five spec fields set.

        ``version`` makes the apiserver refuse a write based on a stale read.
        """
        obj = copy.deepcopy(self.source)
        obj["apiVersion"] = "coordination.k8s.io/v1"
        obj["kind"] = "Lease"
        metadata = obj.setdefault("metadata", {})
        metadata["name"] = name
        # The uid (kept from the object read) guards against create-on-update: a renew of
        # an object someone deleted must fail, so its holder stops, rather than quietly
        # bring it back while a newcomer counts a deleted object as a vanished holder.
        if self.version:
            metadata["resourceVersion"] = self.version
        else:
            metadata.pop("resourceVersion", None)
        spec = obj.get("spec") or {}
        obj["spec"] = spec
        spec.update(holderIdentity=self.holder, leaseDurationSeconds=self.duration,
                    leaseTransitions=self.transitions, acquireTime=self.acquire_time,
                    renewTime=self.renew_time)
        return obj

    def expires_at(self) -> datetime | None:
        """The holder's own idea of its expiry (wall clock): for ``status`` only."""
        if not self.holder or not self.renew_time:
            return None
        renewed = datetime.fromisoformat(self.renew_time.replace("Z", "+00:00"))
        return renewed + timedelta(seconds=self.duration)


def _hinted(obj: dict[str, Any]) -> str:
    """The hint annotation's holder, while it counts (see the module doc); else ""."""
    annotations = obj["metadata"].get("annotations") or {}
    holder, until = annotations.get(HINT_ANNOTATION), annotations.get(HINT_UNTIL_ANNOTATION)
    renewed = (obj.get("spec") or {}).get("renewTime")
    if not holder or not until or not renewed:
        return ""
    try:
        fresh = _instant(renewed) <= _instant(until)
    except ValueError:
        return ""  # a hand edit: no hint
    return str(holder) if fresh else ""


def _instant(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _unix_seconds(stamp: str | None) -> int:
    """An RFC 3339 ``metav1.Time`` (whole seconds) as Unix seconds; 0 when absent."""
    if not stamp:
        return 0
    return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp())
