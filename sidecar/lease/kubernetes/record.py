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

The fencing token is the ``resourceVersion`` of the write that began the term, above
:data:`FENCE_BASE`::

    token = 2**52 + resourceVersion of the acquiring write        (< 2**53 while the
                                                                     revision < 2**52)

The apiserver assigns resourceVersions from etcd's revision, one counter for the whole
cluster that grows with every write and that nobody can set: a later term's acquiring
write has a larger one, whatever anybody wrote by hand in between (a count or any field
edited down, a manifest applied again, the object deleted and re-created). The base puts
every token above those of the earlier layout (``creationTimestamp * 2**20 +
leaseTransitions``, below 2**52 until 2106), so tokens grow across the upgrade too. An
apiserver whose resourceVersions are not numbers gives no token: the lease is refused
with a reason (fail closed). ``leaseTransitions`` still counts terms for client-go and
for people; a sidecar writes it at least :data:`OLD_LAYOUT_LIMIT`, past which sidecars of
the earlier layout refuse to lead, so that during a rolling upgrade none of them can lead
after a newer one with a smaller token. The term's token is also written, for people and
``lease-sidecar status`` only, in the annotation :data:`TOKEN_ANNOTATION`.

Everything in the object a person can write is read defensively (:func:`from_object`):
a value that is not what the field holds is ignored, with one log line naming the
field, so that no hand edit can make a sidecar fail to read its Lease.

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
also sets the annotation :data:`RELEASED_ANNOTATION` to the ended term's identity
(:meth:`Record.term_id`: the object's creation second and the term's count). The next
acquire reads the object it replaces (its write is guarded by that object's
``resourceVersion``), and finds the record true only if the object is released and names
the term the object still counts: then its first claim need not wait a claim horizon
(``Grant.previous_claims_ended``). Our acquire removes the annotation, so
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
import logging
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

log = logging.getLogger("sidecar.lease.kubernetes")

# Fencing tokens are FENCE_BASE + the resourceVersion of the term's acquiring write.
FENCE_BASE = 1 << 52
# The earlier token layout (creationTimestamp * 2**20 + leaseTransitions) refused to lead
# from this count on; a sidecar writes leaseTransitions at least this high (module doc).
OLD_LAYOUT_LIMIT = 1 << 20
INT32_MAX = 2**31 - 1
# The term's token, for people and ``status`` (informative: safety never reads it).
TOKEN_ANNOTATION = "lease-sidecar/fencing-token"
# spec.preferredHolder's stand-in where the apiserver drops the field (see the module doc).
HINT_ANNOTATION = "lease-sidecar/preferred-holder"
HINT_UNTIL_ANNOTATION = "lease-sidecar/preferred-until"
# The release record: the identity of the term released after its claims ran out.
RELEASED_ANNOTATION = "lease-sidecar/released-term"


def fencing_token(version: str) -> int | None:
    """The token of a term whose acquiring write got ``version``; None when the
    apiserver's resourceVersions are not numbers (or too large for a JSON-safe token)."""
    if not version.isdigit() or int(version) >= FENCE_BASE:
        return None
    return FENCE_BASE + int(version)


def next_count(transitions: int) -> int:
    """``leaseTransitions`` of a new term after one counted ``transitions``: one more,
    at least :data:`OLD_LAYOUT_LIMIT`, starting over there before int32 runs out."""
    count = max(transitions + 1, OLD_LAYOUT_LIMIT)
    return count if count <= INT32_MAX else OLD_LAYOUT_LIMIT


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
    duration: int  # leaseDurationSeconds (0: absent)
    transitions: int  # leaseTransitions: the count of terms
    version: str  # metadata.resourceVersion
    acquire_time: str | None = None
    renew_time: str | None = None
    # spec.preferredHolder: someone asks the holder to end its term in this one's favour.
    preferred_holder: str = ""
    # Seconds the preference counts from the write that carries it, where the hint
    # annotations name it (their bound less renewTime, both of the writer's clock); None
    # for the spec field, which carries no bound.
    preference_for: float | None = None
    # metadata.creationTimestamp as Unix seconds: the fencing token's high part.
    created: int = 0
    # The release record's term (RELEASED_ANNOTATION), "" when there is none.
    released_term: str = ""
    # metadata.uid: "" for an object we are about to create.
    uid: str = ""
    # The last term's token as TOKEN_ANNOTATION shows it (informative), None: none.
    shown_token: int | None = None
    # The whole object as the apiserver sent it: a write starts from it, so every field
    # we do not own goes back unchanged. Empty for an object we are about to create.
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> Record:
        """The record of a Lease object as the apiserver sent it. Never raises for a
        value a person wrote: what does not fit its field is ignored (:func:`_ignored`)."""
        metadata = _mapping(obj.get("metadata"), "metadata")
        spec = _mapping(obj.get("spec"), "spec")
        annotations = _mapping(metadata.get("annotations"), "metadata.annotations")
        return cls(holder=_text(spec, "holderIdentity"),
                   duration=_count(spec, "leaseDurationSeconds"),
                   transitions=_count(spec, "leaseTransitions"),
                   version=str(metadata.get("resourceVersion") or ""),
                   acquire_time=_micro(spec, "acquireTime"),
                   renew_time=_micro(spec, "renewTime"),
                   preferred_holder=_text(spec, "preferredHolder") or _hinted(spec,
                                                                               annotations),
                   preference_for=None if _text(spec, "preferredHolder") else
                   _hint_left(spec, annotations),
                   created=_unix_seconds(metadata.get("creationTimestamp")),
                   released_term=_text(annotations, RELEASED_ANNOTATION),
                   uid=str(metadata.get("uid") or ""),
                   shown_token=_token_shown(annotations),
                   source=obj)

    def term_id(self) -> str:
        """The term this object counts, as a release record names it: the object's
        creation second and the count (a new object or a new term changes it)."""
        return str(self.created * OLD_LAYOUT_LIMIT + self.transitions)

    @property
    def released(self) -> bool:
        """Released as our sidecar and client-go's ``ReleaseOnCancel`` release: no holder,
        ``leaseDurationSeconds`` exactly 1, ``acquireTime`` = ``renewTime`` (the release
        time, written by the releasing holder itself). A releasing holder has stopped
        claiming; a holder cleared any other way (by hand — a patch that clears the holder
        and sets the duration to 1 leaves both times alone —, or an object re-created with
        an empty spec) may still be claiming."""
        return (not self.holder and self.duration == 1 and self.renew_time is not None
                and self.acquire_time == self.renew_time)

    def released_after(self, earlier: Record | None) -> bool:
        """Released (:attr:`released`) by a write after ``earlier``'s renewal, the last of
        the term we saw. A release writes its own time into both times, later than any
        renewal of the term it ends (by the same holder's clock). A hand edit that clears
        the holder and sets the duration to 1 on a term never renewed leaves both times
        equal as well, at the term's acquisition: that holder may still be claiming."""
        if not self.released or earlier is None or earlier.renew_time is None:
            return False
        released, renewed = _instant(self.renew_time or ""), _instant(earlier.renew_time)
        return released is not None and renewed is not None and released > renewed

    @property
    def claims_ended(self) -> bool:
        """Released by a sidecar whose release record names the term this object counts:
        that holder's claims had all run out before the release."""
        return self.released and self.released_term == self.term_id()

    def recording_release(self, record: bool) -> Record:
        """This record with the release record set to its own term (``record``) or
        removed (every other write of ours)."""
        term = self.term_id() if record else ""
        if term == self.released_term:
            return self
        source = copy.deepcopy(self.source)
        annotations = source.setdefault("metadata", {}).setdefault("annotations", {})
        if term:
            annotations[RELEASED_ANNOTATION] = term
        else:
            annotations.pop(RELEASED_ANNOTATION, None)
        return replace(self, released_term=term, source=source)

    def showing_token(self, token: int | None) -> Record:
        """This record with :data:`TOKEN_ANNOTATION` naming ``token`` (informative)."""
        if token is None or token == self.shown_token:
            return self
        source = copy.deepcopy(self.source)
        source.setdefault("metadata", {}).setdefault("annotations", {})[
            TOKEN_ANNOTATION] = str(token)
        return replace(self, shown_token=token, source=source)

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
        renewed = _instant(self.renew_time) if self.renew_time else None
        if not self.holder or renewed is None:
            return None
        return renewed + timedelta(seconds=self.duration)


# -- reading what anybody may have written ---------------------------------------------
# (field, value) pairs already logged: a bad value is named once, not at every read.
_LOGGED: set[tuple[str, str]] = set()


def _ignored(name: str, value: object, why: str) -> None:
    """One log line per field and value: the value is not used."""
    shown = repr(value)[:80]
    if (name, shown) in _LOGGED:
        return
    if len(_LOGGED) < 1000:
        _LOGGED.add((name, shown))
    log.warning(f"ignoring the Lease's {name}: {why}", extra={"field": name, "value": shown})


def _mapping(value: object, name: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _ignored(name, value, "not an object")
        return {}
    return value


def _text(mapping: dict[str, Any], key: str) -> str:
    value = mapping.get(key)
    if value is None or isinstance(value, str):
        return value or ""
    _ignored(key, value, "not a string")
    return ""


def _count(mapping: dict[str, Any], key: str) -> int:
    value = mapping.get(key)
    if value is None:
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT32_MAX:
        return value
    _ignored(key, value, "not a count")
    return 0


def _micro(mapping: dict[str, Any], key: str) -> str | None:
    value = mapping.get(key)
    if value is None:
        return None
    if isinstance(value, str) and _instant(value) is not None:
        return value
    _ignored(key, value, "not an RFC 3339 time with a zone")
    return None


def _token_shown(annotations: dict[str, Any]) -> int | None:
    value = annotations.get(TOKEN_ANNOTATION)
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit() and int(value) < 2**53:
        return int(value)
    _ignored(TOKEN_ANNOTATION, value, "not a token")
    return None


def _hinted(spec: dict[str, Any], annotations: dict[str, Any]) -> str:
    """The hint annotation's holder, while it counts (see the module doc); else ""."""
    holder = _text(annotations, HINT_ANNOTATION)
    until_text = _text(annotations, HINT_UNTIL_ANNOTATION)
    renewed_text = spec.get("renewTime")
    if not holder or not until_text or not isinstance(renewed_text, str):
        return ""
    until, renewed = _instant(until_text), _instant(renewed_text)
    if until is None:
        _ignored(HINT_UNTIL_ANNOTATION, until_text, "not an RFC 3339 time with a zone")
        return ""
    if renewed is None:
        return ""
    return holder if renewed <= until else ""


def _hint_left(spec: dict[str, Any], annotations: dict[str, Any]) -> float | None:
    """Seconds from the write to the hint's bound (both times written by the same
    holder, so no two clocks are compared); None without a hint that counts."""
    if not _hinted(spec, annotations):
        return None
    until = _instant(_text(annotations, HINT_UNTIL_ANNOTATION))
    renewed = _instant(str(spec.get("renewTime")))
    if until is None or renewed is None:
        return None
    return (until - renewed).total_seconds()


def _instant(stamp: str) -> datetime | None:
    """An RFC 3339 time with a zone; None for anything else (no zone, not a time)."""
    try:
        parsed = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def _unix_seconds(stamp: object) -> int:
    """An RFC 3339 ``metav1.Time`` (whole seconds) as Unix seconds; 0 when absent."""
    parsed = _instant(stamp) if isinstance(stamp, str) else None
    return int(parsed.timestamp()) if parsed is not None else 0
