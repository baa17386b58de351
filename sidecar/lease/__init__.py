"""Where a lease lives: one small protocol, one module per backend.

A backend knows nothing about HTTP, files or pods. It answers three questions for one
lease name: may I take it (``try_acquire``), do I still have it (``try_renew``), and
give it back (``release``); ``describe`` reports the current holder for ``/status``.

What a backend promises in a :class:`Grant`: if ``held`` is true, nobody else can hold
the lease for ``valid_for`` seconds counted from the moment the request was *sent*
(the elector records that moment on its own monotonic clock). The elector, not the
backend, turns that into the fail-closed claim.

Backends are imported lazily by name, so running on SQLite never imports asyncpg,
pyodbc, kopf or the kubernetes client.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from fractions import Fraction
from typing import Any, Protocol

from sidecar.base.clock import Clock
from sidecar.base.errors import ConfigError
from sidecar.settings import HoldsBy, Settings


@dataclass(frozen=True)
class Grant:
    """The outcome of one acquire or renew round trip."""

    held: bool
    # Seconds, from the send time of the request, during which nobody else can hold
    # the lease. Meaningless when ``held`` is false.
    valid_for: float = 0.0
    # Only grows across holders of one lease; downstream systems reject smaller ones.
    fencing_token: int | None = None
    # The current holder's identity, where the backend can tell.
    holder: str | None = None
    # Why the attempt did not hold, for logs and /status ("held by pod-b", ...).
    reason: str = ""
    # Seconds from the reply before the first claim, when the backend knows the previous
    # holder may claim longer than one claim horizon (a server that just restarted or
    # was just promoted: sidecar.lease.pg_timeline).
    claim_delay: float = 0.0
    # With ``held`` true: the acquire replaced a term that its holder ended with a
    # release *recorded* in the lease (see :meth:`Lease.release`), so all of that term's
    # claims had run out before this acquire was sent: the first claim need not wait a
    # claim horizon (``claim_delay`` still applies). False wherever the backend cannot
    # prove it: a lease deleted, cleared or edited by hand, run out, released by
    # client-go or an older version, or a backend that keeps no record.
    previous_claims_ended: bool = False
    # With ``held`` false: the holder is asked to end its term cooperatively (Kubernetes'
    # ``preferredHolder``), so it steps down as on SIGTERM — unpublish, wait out its
    # claims, then ``release`` — instead of just stopping.
    release: bool = False
    # With ``held`` false: a live holder has this contender's identity (a second process
    # with the same identity; identities must be unique). The elector counts these into
    # the state: the metric ``lease_sidecar_duplicate_identity_total``.
    duplicate_identity: bool = False


@dataclass(frozen=True)
class Holder:
    """What the backend says about a lease right now (for ``/status``)."""

    holder: str | None
    fencing_token: int | None = None
    expires_at: datetime | None = None


@dataclass(frozen=True)
class LeaseInfo:
    """One lease that exists in the backend, as ``lease-sidecar status`` shows it."""

    lease: str
    # The live holder; None when the lease exists but nobody holds it (released, expired).
    holder: str | None
    # The holder's fencing token (or the last holder's), where the backend stores it.
    fencing_token: int | None = None
    # When the current (or last) term ends; None where a lease has no expiry.
    expires_at: datetime | None = None
    # Backend specifics for ``status --json`` (lock id, session pid, object name, ...).
    details: dict[str, Any] = field(default_factory=dict)


class Lease(Protocol):
    """One named lease as seen by one contender."""

    name: str

    # Set by a backend that learns of a loss without being asked (a dropped session): the
    # elector then steps down at once instead of at the next renew. None: no such signal.
    # Read-only here, so a backend may declare it as a plain Event.
    @property
    def lost(self) -> asyncio.Event | None: ...

    async def try_acquire(self) -> Grant: ...

    async def try_renew(self) -> Grant: ...

    async def release(self, record: bool = False) -> None:
        """Give the lease back. The elector calls it only once every claim of the term
        has run out (or none was handed out). ``record`` True: the term also reached its
        first claim, so no claim of an *earlier* term can still run either; a backend may
        then record the release in the lease, in the same write, for the next acquire
        to find (``previous_claims_ended``) — a record that the next holder can tie to
        *this* term, so that a release by anyone else, or a hand edit, never passes for
        one. False (a term given back before its first claim): write no record."""
        ...

    async def describe(self) -> Holder: ...

    async def wait_for_change(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds; return early when the lease may be free.

        Backends with a wake-up channel (LISTEN/NOTIFY, a Kubernetes watch, a blocking
        advisory lock) use it so standbys take over at once; others just sleep.
        """
        ...


class Successor(Protocol):
    """Optional capability of a :class:`Lease`: a "next holder" hint beside the lease,
    for a deliberate hand-over (``POST /handover``, ``lease-sidecar handover --to``).

    The holder names its successor just before it steps down the usual way (unpublish,
    wait out its claims, release); standbys that are not named stay out of the race
    while the hint is live, so the named one wins. The hint lives at most ``bound``
    seconds by the backend's own clock (the elector passes one lease duration), so a
    named standby that is dead delays the others by no more than that — no longer than
    a crashed leader's lease would. The hint only ever keeps contenders *out*; safety
    still rests on the lease alone. Homes: a side row for the row backends
    (:mod:`sidecar.lease.rowlease`), a session's ``application_name`` for the advisory
    lock (:mod:`sidecar.lease.postgres_advisory.handover`).
    """

    async def hand_to(self, identity: str, bound: float) -> None:
        """Holder: name ``identity`` the next holder for at most ``bound`` seconds."""
        ...

    async def handing_to_other(self) -> str | None:
        """Standby: the identity a live hint names, when it is not this contender's;
        None when there is no live hint or it names us."""
        ...


def successor_of(lease: Lease) -> Successor | None:
    """The lease's :class:`Successor` capability, or None where its backend has none."""
    if callable(getattr(lease, "hand_to", None)) and callable(
            getattr(lease, "handing_to_other", None)):
        return lease  # type: ignore[return-value]  # the checks above are the Protocol
    return None


class ShardGroup(Protocol):
    """Optional, made by a backend's :attr:`BackendEntry.shard_group`: the leases of one
    shard set (``LEASE_SHARDS``) and the set's members, in the backend's own store.

    Each member keeps a record of itself there with an expiry of one lease duration (a
    row, a session's ``application_name``, a Lease object), renewed by :meth:`run` once a
    renew interval, in the same round trip that renews every shard lease the group
    handed out and holds (on the database backends; a Kubernetes Lease is renewed by its
    own write). A shard lease's ``try_renew`` answers from that round trip when it was
    sent recently enough (its ``valid_for`` counts from that send time, so the promise is
    the round trip's), and asks for one at once otherwise: the cost per renew interval
    does not grow with the number of shards. Membership is liveness only: which member
    campaigns for a shard; every shard stays a :class:`Lease` under the usual rules.
    """

    # This contender's name among the members (its identity, where the record holds it
    # whole): what the assignment gives shards to.
    member: str

    def lease(self, name: str) -> Lease:
        """The lease of shard ``name`` (one per name; renewed with the group)."""
        ...

    def retire(self, name: str) -> None:
        """Nobody here campaigns for shard ``name`` any more (its elector has stopped):
        what its lease keeps open (a watch) may close; :meth:`lease` makes it anew."""
        ...

    def advertise(self, member: bool) -> None:
        """Whether this contender is a member: False drops its record at the next round
        trip (stopping, or its application is not ready), True puts it back."""
        ...

    async def next_beat(self) -> tuple[str, ...]:
        """Wait for the next round trip; the identities of the live members, this
        contender's among them while it is one. Raises BackendError when it failed."""
        ...

    async def run(self) -> None:
        """The round trips, one per renew interval (more only when a lease asks)."""
        ...

    async def close(self) -> None:
        """Stop :meth:`run`; this member's record, if any, runs out by itself."""
        ...


class Backend(Protocol):
    """A connection to where leases live; hands out one :class:`Lease` per name."""

    # Set when the backend finds, once connected, that it is set up in a way that can
    # never be safe (the advisory lock behind a transaction pooler); by then its leases
    # refuse to be held, ``misconfiguration`` says why in one line, and ``lease-sidecar``
    # exits with 2. None: the backend has no such check. Read-only here, so a backend may
    # declare them as a plain Event and str.
    @property
    def misconfigured(self) -> asyncio.Event | None: ...

    @property
    def misconfiguration(self) -> str | None: ...

    def lease(self, name: str) -> Lease: ...

    async def close(self) -> None: ...


ListLeases = Callable[[Settings, "tuple[str, ...] | None"], Awaitable["list[LeaseInfo]"]]
# (the backend ``create`` made, its settings, its clock, the group's key: the store key of
# the first lease name) -> the shard group of LEASE_SHARDS in that backend's store.
MakeShardGroup = Callable[[Backend, Settings, Clock, str], ShardGroup]
# (settings, the group's key) -> the identities of the group's live members, read only
# (``lease-sidecar status``).
ListMembers = Callable[[Settings, str], Awaitable["list[str]"]]


@dataclass(frozen=True)
class BackendEntry:
    """What a backend module offers, as its module-level ``ENTRY``.

    Only ``create`` is required. ``lease-sidecar schema`` works where ``schema_sql`` and
    ``apply_schema`` are given, ``lease-sidecar status`` where ``list_leases`` is.
    """

    create: Callable[[Settings, Clock], Backend]
    # How the backend bounds a holder's validity: picks the timing rules that apply.
    holds_by: HoldsBy = "ttl"
    # Extra rules on the settings, checked by config loading before anything connects;
    # raises ConfigError naming the setting.
    validate: Callable[[Settings], None] | None = None
    # True where an empty LEASE_DSN cannot work.
    needs_dsn: bool = False
    # What an empty LEASE_DSN means, where the backend has a default store.
    default_dsn: str | None = None
    # The lease table's name when LEASE_TABLE is unset (backends with a table).
    default_table: str = "leases"
    # True where LEASE_REPLICA_DSN means something (row leases on a server).
    takes_replica: bool = False
    # The syntax check of LEASE_DSN and LEASE_REPLICA_DSN; raises sidecar.base.dsn.DsnError.
    check_dsn: Callable[[str], None] | None = None
    # (seconds, why): the least safety margin that is safe against this backend's peers.
    min_safety_margin: tuple[float, str] | None = None
    # The renew interval when LEASE_RENEW_INTERVAL is unset, as a share of the validity
    # (lease duration less safety margin), where the election's 2/15 of the lease does
    # not suit the backend; None: 2/15.
    renew_share: Fraction | None = None
    # The DDL of the lease table, and applying it (idempotent).
    schema_sql: Callable[[Settings], str] | None = None
    apply_schema: Callable[[Settings], Awaitable[None]] | None = None
    # Read only: a LeaseInfo for each lease that exists (every lease under the key prefix
    # when names is None, where the backend can list them); raises NotFound when the store
    # itself does not exist.
    list_leases: ListLeases | None = None
    # Imports the client library the backend connects with, where the module defining
    # ENTRY leaves it out so that ``schema --print`` works without it; ImportError when it
    # is missing. Called by config loading for every command that connects.
    load_driver: Callable[[], object] | None = None
    # Where LEASE_SHARDS works: the shard group of a backend this entry created, and the
    # live members as ``lease-sidecar status`` reads them (:class:`ShardGroup`).
    shard_group: MakeShardGroup | None = None
    list_members: ListMembers | None = None


# backend name -> (module under sidecar.lease defining ENTRY, pip extra it needs)
_MODULES: dict[str, tuple[str, str | None]] = {
    "sqlite": ("sqlite", None),
    "postgres": ("postgres_advisory", "postgres"),
    "postgres-row": ("postgres_row", "postgres"),
    "sqlserver": ("sqlserver", "sqlserver"),
    "kubernetes": ("kubernetes", None),  # sidecar.kubeapi: aiohttp, a core dependency
}

BACKENDS = tuple(_MODULES)


def backend_entry(backend: str) -> BackendEntry:
    """The entry of one backend, imported on first use: running on SQLite never imports
    asyncpg, pyodbc or the kubernetes client.

    A backend whose library is missing raises ConfigError naming the extra to install.
    """
    module, _ = _MODULES[backend]
    try:
        entry: BackendEntry = importlib.import_module(f"sidecar.lease.{module}").ENTRY
    except ImportError as exc:
        raise _cannot_load(backend, exc) from None
    return entry


def load_driver(backend: str) -> None:
    """Import the library ``backend`` connects with, before anything connects: ConfigError
    naming the extra to install when it is missing."""
    load = backend_entry(backend).load_driver
    if load is not None:
        try:
            load()
        except ImportError as exc:
            raise _cannot_load(backend, exc) from None


def _cannot_load(backend: str, exc: ImportError) -> ConfigError:
    extra = _MODULES[backend][1]
    return ConfigError(f"LEASE_BACKEND / --backend: the {backend} backend cannot load "
                       f"({exc}); install lease-sidecar[{extra or 'all'}]")


def create_backend(settings: Settings, clock: Clock) -> Backend:
    return backend_entry(settings.store.backend).create(settings, clock)
