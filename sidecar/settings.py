"""What one sidecar is told to do, as plain frozen data grouped by concern.

:class:`Timing` is the only group with rules between its fields, and it checks them when
it is built, as client-go's ``NewLeaderElector`` does: an elector or backend built
directly, without :mod:`sidecar.config`, gets the same refusals. Where the settings come
from (variables, flags, defaults) and how an error names them is :mod:`sidecar.config`'s
job, one layer up.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from sidecar.base.clock import format_duration
from sidecar.base.errors import ConfigError
from sidecar.base.names import prefixed
from sidecar.base.redact import redact

# An identity longer than this would not fit the row backends' owner column.
MAX_IDENTITY = 128
# The elector sleeps the renew interval plus up to this much jitter between renewals.
RENEW_JITTER = 0.1

# ``ttl``: the backend grants a lease until an expiry (rows, Lease objects), so a holder
# may claim until ``lease_duration - safety_margin`` after its last renew was sent.
# ``session``: the lease lives as long as a server session (PostgreSQL's advisory lock)
# and a holder that has not heard from the server for ``renew_deadline`` steps down.
HoldsBy = Literal["ttl", "session"]


class TimingError(ConfigError):
    """A broken timing rule. ``template`` names the settings as ``{field}``; ``blame``
    lists, in order, the settings a user should change (the first given one is named)."""

    def __init__(self, timing: Timing, blame: list[str], template: str) -> None:
        self.blame = blame
        self.template = template
        fields = re.findall(r"\{(\w+)\}", template)
        super().__init__(f"{blame[0]}: " + template.format(
            **{name: f"{name} {format_duration(getattr(timing, name))}" for name in fields}))

    @property
    def fields(self) -> list[str]:
        return re.findall(r"\{(\w+)\}", self.template)


@dataclass(frozen=True)
class Timing:
    """The five durations of one election, in seconds, checked on construction.

    Fields named like a setting mean what its entry in :data:`sidecar.config.OPTIONS`
    says (the one place that is written; ``docs/configuration.md`` is generated from it).
    """

    lease_duration: float = 15.0
    renew_interval: float = 2.0
    renew_deadline: float = 10.0
    safety_margin: float = 1.0
    claim_horizon: float = 0.25
    holds_by: HoldsBy = "ttl"
    """How the backend bounds a holder's validity (see :data:`HoldsBy`)."""

    def __post_init__(self) -> None:
        for name in ("lease_duration", "renew_interval", "renew_deadline", "safety_margin",
                     "claim_horizon"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0 or (value == 0 and name != "safety_margin"):
                raise ConfigError(f"{name}: {value!r} is not a positive, finite duration")
        self._check_rules()

    @property
    def validity(self) -> float:
        """Seconds a holder may claim after the send time of a successful renew."""
        if self.holds_by == "session":
            return self.renew_deadline
        return self.lease_duration - self.safety_margin

    def _check_rules(self) -> None:
        """Renewals come every renew interval plus up to 10 % jitter, and a new holder's
        first claim comes one claim horizon after its acquire, its first renew one renew
        interval after that: both must fit inside the validity, or every term ends
        before its first renew."""
        if self.holds_by == "session":
            if self.renew_deadline > self.lease_duration:
                raise TimingError(self, ["renew_deadline", "lease_duration"],
                                  "{renew_deadline} must be at most {lease_duration}")
            validity_text = "{renew_deadline}"
        else:
            if self.safety_margin >= self.lease_duration:
                raise TimingError(self, ["safety_margin", "lease_duration"],
                                  "{safety_margin} must be less than {lease_duration}")
            validity_text = ("{lease_duration} minus {safety_margin} = "
                             + format_duration(self.validity))
        validity_fields = re.findall(r"\{(\w+)\}", validity_text)
        renew_span = self.renew_interval * (1 + RENEW_JITTER)
        if renew_span >= self.validity:
            raise TimingError(
                self, ["renew_interval", *validity_fields],
                "{renew_interval} plus its 10% jitter (" + format_duration(renew_span)
                + ") must be less than " + validity_text
                + ", or the lease lapses between renewals")
        first_renew = self.claim_horizon + renew_span
        if first_renew >= self.validity:
            raise TimingError(
                self, ["claim_horizon", "renew_interval", *validity_fields],
                "{claim_horizon} plus {renew_interval} with its 10% jitter = "
                + format_duration(first_renew) + " must be less than " + validity_text
                + ": a new holder's first claim comes one claim horizon after its acquire "
                "and its first renew one renew interval (up to +10%) after that, so every "
                "term would end before its first renew")


@dataclass(frozen=True)
class StoreSettings:
    """Where the leases live and how their keys are spelled.

    Fields named like a setting mean what its entry in :data:`sidecar.config.OPTIONS`
    says (the one place that is written; ``docs/configuration.md`` is generated from it).
    """

    backend: str = "sqlite"
    dsn: str | None = None
    replica_dsn: str | None = None
    replica_timeout: float = 5.0
    key_prefix: str = "lease-sidecar"
    schema: str = "lease"
    table: str = "leases"
    odbc_driver: str | None = None
    ensure_schema: bool = False

    def key(self, name: str) -> str:
        """The one key of lease ``name`` in the store: lock id input, row name, object name."""
        return prefixed(self.key_prefix, name)


@dataclass(frozen=True)
class Settings:
    """Everything one sidecar was told; built and checked by :func:`sidecar.config.load`.

    Fields named like a setting mean what its entry in :data:`sidecar.config.OPTIONS`
    says (the one place that is written; ``docs/configuration.md`` is generated from it).
    """

    store: StoreSettings = field(default_factory=StoreSettings)
    """Where the leases live."""
    timing: Timing = field(default_factory=Timing)
    """The durations of the election."""
    names: tuple[str, ...] = ("default",)
    shards: tuple[str, ...] = ()
    """The shard set's lease names (``LEASE_SHARDS`` expanded); empty: no shards."""
    identity: str = ""
    role: str = "all"
    http_addr: tuple[str, int] = ("127.0.0.1", 8099)
    state_dir: str = "/run/lease"
    pod_label: str = "auto"
    pod_name: str | None = None
    """This pod, from the downward API (``POD_NAME``)."""
    pod_namespace: str | None = None
    """This pod's namespace (``POD_NAMESPACE``)."""
    exec_grace: float = 10.0
    work_stall_after: float | None = None
    app_ready_url: str | None = None
    app_ready_containers: tuple[str, ...] | None = None
    shutdown_handover: str = "off"
    app_unready_after: float = 10.0
    app_ready_outage_grace: float = 300.0
    control_token_file: str | None = None
    log_level: str = "info"
    explicit: frozenset[str] = frozenset()
    """Which settings the user gave (so defaults may fall back quietly, and errors say
    which values were defaults)."""

    @property
    def name(self) -> str:
        return self.names[0]

    def public(self) -> dict[str, Any]:
        """Settings safe to show in /status and logs: no password, only finite numbers."""
        t = self.timing
        return {
            "backend": self.store.backend,
            "dsn": redact(self.store.dsn),
            "replica_dsn": redact(self.store.replica_dsn),
            "names": list(self.names),
            "shards": len(self.shards),
            "identity": self.identity,
            "key_prefix": self.store.key_prefix,
            "lease_duration": t.lease_duration,
            "renew_interval": t.renew_interval,
            "renew_deadline": t.renew_deadline,
            "safety_margin": t.safety_margin,
            "claim_horizon": t.claim_horizon,
            "http_addr": f"{self.http_addr[0]}:{self.http_addr[1]}",
            "state_dir": self.state_dir,
            "role": self.role,
            "work_stall_after": self.work_stall_after,
            "app_ready_url": self.app_ready_url,
            "app_ready_containers": (list(self.app_ready_containers)
                                     if self.app_ready_containers else None),
            "app_unready_after": self.app_unready_after,
            "app_ready_outage_grace": self.app_ready_outage_grace,
            "control_token_file": self.control_token_file,
            "shutdown_handover": self.shutdown_handover,
        }
