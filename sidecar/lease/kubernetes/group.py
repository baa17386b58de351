"""The shard group of the ``kubernetes`` backend: one Lease object per shard, as for any
lease name, and one *member Lease* per member.

Each shard is an ordinary Lease (:mod:`.lease`) with its own watch, renewed by its own
write: the apiserver keeps no multi-object write, so a shard's renew cannot share a
request with another's without giving up what makes one Lease safe (its guarded writes,
its expiry on every contender's own clock, client-go's conventions next to it). What a
member adds is its record: the Lease ``{group key}.member-{digest of its identity}``,
labelled ``lease-sidecar/member-of=<group>``, holding the member's identity and a
``renewTime`` it writes once a renew interval. One round trip is two requests, that
write (an update, or a create the first time) and a list of the group's member Leases;
the other members of a member's view are the records with a holder whose
``resourceVersion`` changed within one lease duration on the viewer's own monotonic
clock (as a standby judges a Lease: no clock of another host is read). A member that
stops clears its record's holder; one that dies leaves it to run out.

The cost per renew interval is therefore two requests per member plus one write per
shard (by its holder): it grows with the number of shards. docs/sharding.md has the
measured figures.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from sidecar.base.clock import Clock
from sidecar.base.errors import BackendError, Forbidden
from sidecar.kubeapi import KubeError
from sidecar.lease import Backend
from sidecar.lease.beats import BeatingGroup, Beats
from sidecar.lease.kubernetes import KubeBackend
from sidecar.lease.kubernetes.lease import KubeLease
from sidecar.lease.kubernetes.record import micro_time
from sidecar.lease.kubernetes.transport import Connection
from sidecar.settings import Settings

GROUP_LABEL = "lease-sidecar/member-of"
IDENTITY_ANNOTATION = "lease-sidecar/member"


def member_object(group_key: str, identity: str) -> str:
    """The member Lease's name: the group's key and a digest (any identity fits)."""
    return f"{group_key}.member-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def group_label(group_key: str) -> str:
    """The label value naming the group: the key's digest (a key may be longer than a
    label value may)."""
    return hashlib.sha256(group_key.encode()).hexdigest()[:32]


def leases_path(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace)}/leases"


class KubeShardGroup(BeatingGroup):
    """A :class:`~sidecar.lease.ShardGroup` of Lease objects (see the module doc)."""

    def __init__(self, backend: KubeBackend, connection: Connection, settings: Settings,
                 clock: Clock, group_key: str) -> None:
        self._backend = backend
        self._connection = connection
        self._clock = clock
        self.member = settings.identity
        self._object = member_object(group_key, settings.identity)
        self._label = group_label(group_key)
        self._duration = max(1, math.ceil(settings.timing.lease_duration))
        self._leases: dict[str, KubeLease] = {}
        # member Lease name -> (resourceVersion, monotonic time we first saw it)
        self._seen: dict[str, tuple[str, float]] = {}
        self._advertised = False
        self._version: str | None = None  # our record's resourceVersion, as last seen
        self._beats = Beats(self._round_trip, settings.timing, clock, group_key)

    def lease(self, name: str) -> KubeLease:
        if name not in self._leases:
            self._leases[name] = self._backend.lease(name)
        return self._leases[name]

    def retire(self, name: str) -> None:
        """Nobody campaigns for ``name`` here any more: its watch stops."""
        lease = self._leases.pop(name, None)
        if lease is not None:
            lease.stop_watch()

    async def _round_trip(self, held: Mapping[str, Any],
                          advertise: bool) -> tuple[Mapping[str, Any], tuple[str, ...]]:
        api = await self._connection.api()
        client = api.client
        base = leases_path(api.namespace)
        try:
            if advertise or self._advertised:
                await self._write(client, base, advertise)
            listed = await client.list(base, labelSelector=f"{GROUP_LABEL}={self._label}")
            for item in listed.get("items") or []:
                meta = item.get("metadata") or {}
                if meta.get("name") == self._object:
                    self._version = meta.get("resourceVersion")
        except KubeError as exc:
            if exc.status == 403:
                raise Forbidden(f"kubernetes: forbidden to keep the shard group's member "
                                f"Leases in namespace {api.namespace}: {exc}") from None
            raise BackendError(f"kubernetes: shard group members: {exc}") from None
        return {}, self._live(listed.get("items") or [], advertise)

    async def _write(self, client: Any, base: str, advertise: bool) -> None:
        """Our record, renewed (or, leaving, with no holder): an update on the version
        last seen (the apiserver takes no unconditional update of a Lease), a create
        where there is none yet. Only the verbs a Lease holder has anyway (update,
        create), so a Role that lets the sidecar hold any Lease of its namespace (the
        chart's ``rbac.anyLease``) covers it. A lost race (409) skips this round trip's
        write: the list that follows gives the version for the next."""
        spec = {"holderIdentity": self.member if advertise else "",
                "leaseDurationSeconds": self._duration,
                "renewTime": micro_time(self._clock.wall())}
        meta: dict[str, Any] = {"name": self._object, "labels": {GROUP_LABEL: self._label},
                                "annotations": {IDENTITY_ANNOTATION: self.member}}
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": spec}
        try:
            if self._version is None:
                if not advertise:
                    return  # nothing of ours to clear
                written = await client.post(base, body)
            else:
                meta["resourceVersion"] = self._version
                written = await client.put(f"{base}/{quote(self._object)}", body)
        except KubeError as exc:
            if exc.status == 409:
                self._version = None
                return
            if exc.status != 404:
                raise
            self._version = None
            if not advertise:
                return
            written = await client.post(base, body)
        self._version = (written.get("metadata") or {}).get("resourceVersion")
        self._advertised = advertise

    def _live(self, items: list[dict[str, Any]], advertise: bool) -> tuple[str, ...]:
        """The members whose record changed within its duration, on our clock."""
        now = self._clock.monotonic()
        seen: dict[str, tuple[str, float]] = {}
        members = {self.member} if advertise else set()
        for item in items:
            meta = item.get("metadata") or {}
            name, version = str(meta.get("name", "")), str(meta.get("resourceVersion", ""))
            spec = item.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            duration = spec.get("leaseDurationSeconds") or self._duration
            earlier = self._seen.get(name)
            since = earlier[1] if earlier is not None and earlier[0] == version else now
            seen[name] = (version, since)
            if name == self._object:
                continue  # our own: what we just wrote (or dropped) decides
            if holder and now - since < float(duration):
                members.add(str(holder))
        self._seen = seen
        return tuple(sorted(members))


def make_kube_group(backend: Backend, settings: Settings, clock: Clock,
                    group_key: str) -> KubeShardGroup:
    """``BackendEntry.shard_group`` of ``kubernetes``."""
    assert isinstance(backend, KubeBackend)
    return KubeShardGroup(backend, backend.connection, settings, clock, group_key)


async def list_members(settings: Settings, group_key: str) -> list[str]:
    """The group's live members for ``lease-sidecar status``: member Leases whose
    ``renewTime`` plus duration is after this host's now (a one-shot read has no earlier
    view to compare with)."""
    connection = Connection(settings)
    try:
        api = await connection.api()
        listed = await api.client.list(leases_path(api.namespace),
                                       labelSelector=f"{GROUP_LABEL}={group_label(group_key)}")
    except KubeError as exc:
        raise BackendError(f"kubernetes: shard group members: {exc}") from None
    finally:
        await connection.close()
    now = datetime.now(UTC)
    members = []
    for item in listed.get("items") or []:
        spec = item.get("spec") or {}
        renewed = _instant(spec.get("renewTime"))
        duration = spec.get("leaseDurationSeconds") or 0
        if spec.get("holderIdentity") and renewed is not None \
                and renewed.timestamp() + duration > now.timestamp():
            members.append(str(spec["holderIdentity"]))
    return members


def _instant(stamp: object) -> datetime | None:
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return None
