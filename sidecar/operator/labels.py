"""What the ``lease-role`` and group labels of one lease group's pods should say.

Pure decisions, no I/O. Each sidecar writes its own view into its pod's annotation
``lease-sidecar/lease`` (sidecar.publish.pod_label): identity, role, fencing token, the
lease object and the backend. Labels can lie (edited by hand, or left by a sidecar killed
without cleanup); the annotation is what the sidecar itself last said, and the lease's
truth decides between several pods that each still say ``leader``:

- ``kubernetes`` backend: the Lease object. Only the pod whose identity is the Lease's
  ``holderIdentity`` may show ``leader``, and only while the Lease has not expired.
- database backends (no Lease object): the fencing token only grows, so among the pods
  whose annotation says ``leader`` the highest token (then the latest ``valid_until``)
  is the current term; the others are stale.

The group label always follows the annotation's lease object, so a pod whose
``lease-sidecar/group`` label was edited or removed is put back in its group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sidecar.publish.pod_label import ANNOTATION, GROUP_LABEL, ROLE_LABEL, group_value


@dataclass(frozen=True)
class PodView:
    """One pod as the reconciler needs it."""

    namespace: str
    name: str
    version: str  # resourceVersion: every label write is guarded by the version judged
    labels: dict[str, str]
    note: dict[str, Any]  # the parsed annotation

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PodView | None:
        """None for a pod without a well-formed annotation (not a sidecar's, or not yet)."""
        meta = pod.get("metadata") or {}
        try:
            note = json.loads((meta.get("annotations") or {})[ANNOTATION])
            if not isinstance(note, dict) or not isinstance(note.get("object"), str):
                return None
        except (KeyError, TypeError, ValueError):
            return None
        return cls(meta.get("namespace") or "", meta["name"], meta.get("resourceVersion", ""),
                   dict(meta.get("labels") or {}), note)

    @property
    def group(self) -> str:
        return group_value(self.note["object"])

    @property
    def says_leader(self) -> bool:
        return self.note.get("role") == "leader"


@dataclass(frozen=True)
class LeaseTruth:
    """The Lease object of a ``kubernetes`` group: who holds it, and until when."""

    holder: str | None
    expires: float | None  # wall seconds; None: never renewed

    @classmethod
    def of(cls, lease: dict[str, Any] | None) -> LeaseTruth:
        spec = (lease or {}).get("spec") or {}
        renewed = spec.get("renewTime") or spec.get("acquireTime")
        expires = None
        if renewed and spec.get("leaseDurationSeconds"):
            expires = (datetime.fromisoformat(renewed.replace("Z", "+00:00")).timestamp()
                       + float(spec["leaseDurationSeconds"]))
        return cls(spec.get("holderIdentity") or None, expires)

    def holds(self, identity: str, now: float) -> bool:
        return (identity == self.holder and self.expires is not None and now < self.expires)


def term_of(view: PodView) -> tuple[int, str]:
    """How recent the term a ``leader`` annotation names is (database backends)."""
    token = view.note.get("fencing_token")
    return (token if isinstance(token, int) else -1, str(view.note.get("valid_until") or ""))


def needs_lease(pods: list[PodView]) -> bool:
    """Whether deciding this group needs its Lease object read."""
    return any(p.note.get("backend") == "kubernetes" and (
        p.says_leader or p.labels.get(ROLE_LABEL) == "leader") for p in pods)


def desired_labels(pods: list[PodView], lease: LeaseTruth | None,
                   now: float) -> dict[str, dict[str, str]]:
    """{pod name: the labels to patch} for the pods of one group whose labels are wrong.

    ``lease`` is the Lease's truth for a ``kubernetes`` group (None for the database
    backends); ``now`` is wall time, compared with the Lease's expiry.
    """
    leaders = [p for p in pods if p.says_leader]
    if lease is None:
        current = max(leaders, key=term_of, default=None)
        truly = {current.name} if current is not None else set()
    else:
        truly = {p.name for p in leaders if lease.holds(str(p.note.get("identity")), now)}
    changes: dict[str, dict[str, str]] = {}
    for pod in pods:
        role = pod.note.get("role")
        if role == "leader" and pod.name not in truly:
            role = "standby"
        want = {ROLE_LABEL: str(role), GROUP_LABEL: pod.group}
        wrong = {k: v for k, v in want.items() if pod.labels.get(k) != v}
        if wrong:
            changes[pod.name] = wrong
    return changes
