"""``kubernetes``: a ``coordination.k8s.io/v1`` Lease, the way client-go's leader election
uses one — no database at all.

The Lease object is named ``StoreSettings.key(name)``, ``{key_prefix}.{name}`` (it must be a DNS
subdomain, :mod:`sidecar.base.names`), and lives in ``POD_NAMESPACE`` (else the kubeconfig's
namespace, else ``default``). The parts, one job each:

- :mod:`.record`: the five spec fields we own and how a write keeps everyone else's;
- :mod:`.expiry`: client-go's skew-tolerant expiry rule, on our own monotonic clock;
- :mod:`.transport`: the Lease calls and the watch (:mod:`sidecar.kubeapi`, aiohttp);
- :mod:`.lease`: one contender's acquire, renew, release and wait;
- this module: the backend, ``lease-sidecar status`` and the registry entry.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from fractions import Fraction

from sidecar.base.clock import Clock, SystemClock
from sidecar.base.errors import ConfigError
from sidecar.base.names import object_name_problem
from sidecar.lease import Backend, BackendEntry, LeaseInfo, ShardGroup
from sidecar.lease.kubernetes.lease import KubeLease
from sidecar.lease.kubernetes.record import Record
from sidecar.lease.kubernetes.transport import Connection
from sidecar.settings import Settings, StoreSettings


def check_name(store: StoreSettings, name: str) -> None:
    """``ConfigError`` (exit 2) unless lease ``name`` can be a Lease object."""
    problem = object_name_problem(store.key_prefix, name)
    if problem:
        raise ConfigError(f"LEASE_NAME / --name: {problem}")


def validate(settings: Settings) -> None:
    for name in settings.names:
        check_name(settings.store, name)
    for shard in settings.shards:
        problem = object_name_problem(settings.store.key_prefix, shard)
        if problem:
            raise ConfigError(f"LEASE_SHARDS / --shards: {problem}")
    if settings.shards:
        # The member Leases: the group's key, ".member-" and a 16-digit digest.
        problem = object_name_problem(settings.store.key_prefix,
                                      f"{settings.name}.member-{'0' * 16}")
        if problem:
            raise ConfigError(f"LEASE_NAME / --name: the shard group's member Leases: "
                              f"{problem}")


class KubeBackend:
    """Lease objects in one namespace, reached through one lazily made connection."""

    # Nothing found once connected can make this backend unsafe.
    misconfigured: asyncio.Event | None = None
    misconfiguration: str | None = None

    def __init__(self, settings: Settings, clock: Clock) -> None:
        validate(settings)  # a bad name is a settings error (exit 2), also when built directly
        self._settings = settings
        self._clock = clock
        self._connection = Connection(settings)
        self._leases: list[KubeLease] = []

    @property
    def connection(self) -> Connection:
        """The backend's one connection (a shard group's member Leases use it too)."""
        return self._connection

    def lease(self, name: str) -> KubeLease:
        check_name(self._settings.store, name)
        lease = KubeLease(name, object_name=self._settings.store.key(name),
                          identity=self._settings.identity, timing=self._settings.timing,
                          clock=self._clock, api=self._connection.api)
        self._leases.append(lease)
        return lease

    async def close(self) -> None:
        for lease in self._leases:
            lease.stop_watch()
        await self._connection.close()


def create(settings: Settings, clock: Clock) -> KubeBackend:
    return KubeBackend(settings, clock)


async def list_leases(settings: Settings, names: tuple[str, ...] | None) -> list[LeaseInfo]:
    """``lease-sidecar status``: the named Leases, each read with ``get`` (which the Role's
    ``resourceNames`` allow), or with no names every Lease of this key prefix in the
    namespace (``list``, which needs a Role without ``resourceNames``); never created. A
    Lease whose holder is empty or whose term ran out on this host's clock exists but is
    free."""
    clock = SystemClock()  # a one-shot command: no elector's clock to share
    connection = Connection(settings)
    try:
        api = await connection.api()
        prefix = settings.store.key("")
        now = datetime.fromtimestamp(clock.wall(), UTC)
        if names:
            found = [(name, await api.get(settings.store.key(name))) for name in names]
            records = [(name, record) for name, record in found if record is not None]
        else:
            records = [(obj["metadata"]["name"][len(prefix):], Record.from_object(obj))
                       for obj in await api.list()
                       if obj["metadata"]["name"].startswith(prefix)]
        rows = []
        for name, record in records:
            expires = record.expires_at()
            live = bool(record.holder) and expires is not None and expires > now
            where = f"{api.namespace}/{settings.store.key(name)}"
            rows.append(LeaseInfo(lease=name, holder=record.holder if live else None,
                                  fencing_token=record.shown_token, expires_at=expires,
                                  details={"object": where}))
        return rows
    finally:
        await connection.close()


def shard_group(backend: Backend, settings: Settings, clock: Clock,
                group_key: str) -> ShardGroup:
    """The shard group: member Leases beside a Lease per shard (:mod:`.group`, imported
    only where LEASE_SHARDS is set)."""
    from sidecar.lease.kubernetes.group import make_kube_group

    return make_kube_group(backend, settings, clock, group_key)


async def list_members(settings: Settings, group_key: str) -> list[str]:
    from sidecar.lease.kubernetes.group import list_members as members

    return await members(settings, group_key)


ENTRY = BackendEntry(
    create=create, validate=validate, list_leases=list_leases,
    shard_group=shard_group, list_members=list_members,
    # Each renew is a PUT to the apiserver, the only request an idle group makes besides
    # one watch per sidecar (standbys follow the watch: a crashed holder is taken over at
    # the lease's expiry, whatever the renew period). A third of the validity (4.67s for
    # a 15s lease) still leaves two renew attempts before a claim ends, and costs the
    # apiserver about 12 PUTs a minute, not 30 (docs/kubernetes-backend.md#renew-interval).
    renew_share=Fraction(1, 3),
    min_safety_margin=(1.0, "client-go electors on the same Lease observe its changes at "
                            "one-second granularity and may take over up to 1s before its "
                            "nominal expiry"))
