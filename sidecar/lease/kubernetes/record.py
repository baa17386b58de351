"""The Lease object on the wire: the five spec fields the election owns.

They are written as client-go v0.37's ``leaderelection`` writes them:

- ``holderIdentity``: the holder, ``""`` once released;
- ``leaseDurationSeconds``: how long others must wait after they last saw it change
  (1 once released);
- ``acquireTime`` / ``renewTime``: MicroTime, informative only (expiry never reads them,
  see :mod:`.expiry`); a new term sets both, a renew only ``renewTime``, a release sets
  both to the release time;
- ``leaseTransitions``: the fencing token. 0 when the object is created, +1 with every
  new term: whenever the holder changes (as client-go counts) and also when the same
  identity starts a new term (a restarted process must not share its predecessor's
  token; client-go would keep the count there). A renew or a release keeps it. Since
  client-go also adds 1 on every takeover and keeps the count on renew and release, the
  count only grows however sidecars and client-go electors alternate, for as long as the
  object exists. The sidecar never deletes the object (its Role has no ``delete``);
  deleting it by hand resets the count.

Every other field is someone else's and survives every write of ours: each write is the
object as last read (or as the apiserver returned our previous write) with only those
five fields changed — labels, annotations, ownerReferences, ``spec.preferredHolder``,
``spec.strategy`` and fields this code has never heard of. (client-go keeps the metadata
but rebuilds the spec, so its own writes drop ``preferredHolder`` and ``strategy``
outside coordinated leader election.)

Every write carries the ``resourceVersion`` it was based on, so two contenders cannot both
win: the apiserver answers ``409 Conflict`` to the slower one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any


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
                   source=obj)

    def body(self, name: str) -> dict[str, Any]:
        """The object to write: the one we read with our five spec fields set.

        ``version`` makes the apiserver refuse a write based on a stale read.
        """
        obj = copy.deepcopy(self.source)
        obj["apiVersion"] = "coordination.k8s.io/v1"
        obj["kind"] = "Lease"
        metadata = obj.setdefault("metadata", {})
        metadata["name"] = name
        # The resourceVersion alone guards the write. With the uid too, a renew based on
        # an object someone deleted by hand would fail (a UID precondition) and the next
        # holder would create a new object with the count back at 0; without it the
        # apiserver re-creates the object (Leases allow create-on-update) with our count.
        metadata.pop("uid", None)
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
