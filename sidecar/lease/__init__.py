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

import importlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sidecar.config import Settings


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
    # holder may claim longer than one claim horizon (a server that just restarted).
    claim_delay: float = 0.0


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
    """One named lease as seen by one contender.

    A backend that learns of a loss without being asked (a dropped session) may also
    expose ``lost: asyncio.Event``; the elector then steps down the moment it is set
    instead of at the next renew.
    """

    name: str

    async def try_acquire(self) -> Grant: ...

    async def try_renew(self) -> Grant: ...

    async def release(self) -> None: ...

    async def describe(self) -> Holder: ...

    async def wait_for_change(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds; return early when the lease may be free.

        Backends with a wake-up channel (LISTEN/NOTIFY, a Kubernetes watch, a blocking
        advisory lock) use it so standbys take over at once; others just sleep.
        """
        ...


class Backend(Protocol):
    """A connection to where leases live; hands out one :class:`Lease` per name.

    A backend that can find, once connected, that it is set up in a way that can never
    be safe (the advisory lock behind a transaction pooler) may also expose
    ``misconfigured: asyncio.Event`` and ``misconfiguration: str | None``; by the time
    the event is set its leases refuse to be held, and ``lease-sidecar`` exits with 2.
    """

    def lease(self, name: str) -> Lease: ...

    async def close(self) -> None: ...


# (identity, lease) -> acquire attempts that found a live lease under our identity while
# we did not hold it: a second process with the same identity. Exported as the metric
# ``lease_sidecar_duplicate_identity_total`` by :mod:`sidecar.metrics`.
duplicate_identity: Counter[tuple[str, str]] = Counter()


class BackendError(Exception):
    """The backend could not be reached or answered with an error.

    The message is one clear line and never contains a password.
    """


class NotFound(BackendError):
    """What a read-only command asked for does not exist: no database file, no lease
    table, no such lease. Never a reason to create it."""


# backend name -> module under sidecar.lease; each module defines ``create(settings)``.
_MODULES = {
    "sqlite": "sqlite",
    "postgres": "postgres_advisory",
    "postgres-row": "postgres_row",
    "sqlserver": "sqlserver",
    "kubernetes": "kubernetes",
}

BACKENDS = tuple(_MODULES)


def backend_module(backend: str) -> ModuleType:
    """The module of one backend; optional extras: ``schema_sql``, ``apply_schema``
    (``lease-sidecar schema``) and ``list_leases(settings, names)`` (``status``).

    ``list_leases`` only reads: it returns a :class:`LeaseInfo` for each lease that exists
    (every lease under the key prefix when ``names`` is None, where the backend can list
    them), and raises :class:`NotFound` when the store itself does not exist.
    """
    return importlib.import_module(f"sidecar.lease.{_MODULES[backend]}")


def create_backend(settings: Settings) -> Backend:
    return backend_module(settings.backend).create(settings)
