"""Settings: environment variables and matching flags, validated before anything connects.

Every setting has one ``LEASE_*`` variable and one flag; a flag wins over the variable,
the variable over the default. Validation reports the first bad setting as one line
naming both spellings, and the CLI exits with code 2. argparse does the flag parsing;
the duration and address parsers are hand-written because they are a few lines each
and no library spells durations the way these settings do (``250ms``, ``15s``, ``2m``).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sidecar.lease import BACKENDS
from sidecar.lease.rowlease import validate_identifier

ROLES = ("all", "worker", "api")
POD_LABEL_MODES = ("auto", "on", "off")
DEFAULT_SQLITE_PATH = "/var/tmp/lease-sidecar/leases.sqlite3"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class ConfigError(ValueError):
    """One bad setting; ``str()`` is the one line shown to the user."""


def parse_duration(text: str) -> float:
    match = _DURATION.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a duration (use 250ms, 15s, 2m or plain seconds)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_addr(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not host:port (for example 127.0.0.1:8099)")
    return host.strip("[]") or "127.0.0.1", int(port)


def parse_names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise ValueError("no lease name given")
    for name in names:
        if not _NAME.match(name):
            raise ValueError(f"{name!r} is not a valid lease name (letters, digits, . _ -)")
    if len(set(names)) != len(names):
        raise ValueError(f"{text!r} names a lease twice")
    if "leader" in names[1:]:
        raise ValueError("'leader' may only be the first name (it is the first lease's file)")
    return names


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"{text!r} is not one of {', '.join(options)}")
        return text

    return parse


def _identifier(text: str) -> str:
    return validate_identifier("name", text)


def _text(text: str) -> str:
    return text


def redact_dsn(dsn: str | None) -> str | None:
    """Hide passwords in URLs (``user:pw@``) and ODBC strings (``PWD=…;``)."""
    if not dsn:
        return dsn
    dsn = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", dsn)
    dsn = re.sub(r"(?i)\b(pwd|password)=(\{[^}]*\}|[^;]*)", r"\1=***", dsn)
    return re.sub(r"(?i)([?&]password=)[^&]*", r"\1***", dsn)


@dataclass(frozen=True)
class Option:
    field: str
    env: str
    flag: str
    parse: Callable[[str], Any]
    default: str | None
    help: str


OPTIONS: tuple[Option, ...] = (
    Option("backend", "LEASE_BACKEND", "--backend", _choice(BACKENDS), "sqlite",
           "where the lease lives"),
    Option("dsn", "LEASE_DSN", "--dsn", _text, None,
           "backend address: sqlite file path, postgresql:// URL or ODBC connection string"),
    Option("replica_dsn", "LEASE_REPLICA_DSN", "--replica-dsn", _text, None,
           "read replica that must confirm an acquisition (row backends)"),
    Option("replica_timeout", "LEASE_REPLICA_TIMEOUT", "--replica-timeout", parse_duration,
           "5s", "how long to wait for the replica to confirm"),
    Option("names", "LEASE_NAME", "--name", parse_names, "default",
           "lease name, or several separated by commas (the first is the primary)"),
    Option("identity", "LEASE_IDENTITY", "--identity", _text, None,
           "this contender's unique id (default: POD_NAME, else host:pid)"),
    Option("key_prefix", "LEASE_KEY_PREFIX", "--key-prefix", _text, "lease-sidecar",
           "namespace for lock ids and row names"),
    Option("lease_duration", "LEASE_DURATION", "--lease-duration", parse_duration, "15s",
           "TTL of row and Lease backends"),
    Option("renew_interval", "LEASE_RENEW_INTERVAL", "--renew-interval", parse_duration, "2s",
           "renew / retry / heartbeat period"),
    Option("renew_deadline", "LEASE_RENEW_DEADLINE", "--renew-deadline", parse_duration, "10s",
           "advisory locks: step down when no heartbeat succeeded for this long"),
    Option("safety_margin", "LEASE_SAFETY_MARGIN", "--safety-margin", parse_duration, "1s",
           "TTL backends: stop claiming this long before the lease could expire"),
    Option("claim_horizon", "LEASE_CLAIM_HORIZON", "--claim-horizon", parse_duration, "250ms",
           "how far ahead a published claim is valid"),
    Option("http_addr", "LEASE_HTTP_ADDR", "--http-addr", parse_addr, "127.0.0.1:8099",
           "host:port of the HTTP endpoint"),
    Option("state_dir", "LEASE_STATE_DIR", "--state-dir", _text, "/run/lease",
           "directory of the leader file"),
    Option("role", "LEASE_ROLE", "--role", _choice(ROLES), "all",
           "all | worker (contend) or api (never contend)"),
    Option("schema", "LEASE_SCHEMA", "--schema", _identifier, "lease",
           "row-lease schema"),
    Option("table", "LEASE_TABLE", "--table", _identifier, None,
           "row-lease table (default Leases on sqlserver, leases elsewhere)"),
    Option("odbc_driver", "LEASE_ODBC_DRIVER", "--odbc-driver", _text, None,
           "ODBC driver name when the DSN names none (default FreeTDS)"),
    Option("pod_label", "LEASE_POD_LABEL", "--pod-label", _choice(POD_LABEL_MODES), "auto",
           "keep the lease-role pod label (auto: when POD_NAME/POD_NAMESPACE are set)"),
    Option("exec_grace", "LEASE_EXEC_GRACE", "--grace", parse_duration, "10s",
           "exec: time between SIGTERM and SIGKILL of the command on lease loss"),
    Option("log_level", "LEASE_LOG_LEVEL", "--log-level",
           _choice(("debug", "info", "warning", "error")), "info", "log level"),
)


@dataclass(frozen=True)
class Settings:
    backend: str = "sqlite"
    dsn: str | None = None
    replica_dsn: str | None = None
    replica_timeout: float = 5.0
    names: tuple[str, ...] = ("default",)
    identity: str = ""
    key_prefix: str = "lease-sidecar"
    lease_duration: float = 15.0
    renew_interval: float = 2.0
    renew_deadline: float = 10.0
    safety_margin: float = 1.0
    claim_horizon: float = 0.25
    http_addr: tuple[str, int] = ("127.0.0.1", 8099)
    state_dir: str = "/run/lease"
    role: str = "all"
    schema: str = "lease"
    table: str | None = None
    odbc_driver: str | None = None
    pod_label: str = "auto"
    exec_grace: float = 10.0
    log_level: str = "info"
    pod_name: str | None = None
    pod_namespace: str | None = None
    # Which settings the user gave explicitly (so defaults may fall back quietly).
    explicit: frozenset[str] = field(default=frozenset())

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def table_name(self) -> str:
        return self.table or ("Leases" if self.backend == "sqlserver" else "leases")

    def row_name(self, name: str) -> str:
        """Row / Lease-object key, namespaced so services sharing a database never collide."""
        return f"{self.key_prefix}.{name}" if self.key_prefix else name

    def public(self) -> dict[str, Any]:
        """Settings safe to show in /status and logs."""
        return {
            "backend": self.backend,
            "dsn": redact_dsn(self.dsn),
            "replica_dsn": redact_dsn(self.replica_dsn),
            "names": list(self.names),
            "identity": self.identity,
            "key_prefix": self.key_prefix,
            "lease_duration": self.lease_duration,
            "renew_interval": self.renew_interval,
            "renew_deadline": self.renew_deadline,
            "safety_margin": self.safety_margin,
            "claim_horizon": self.claim_horizon,
            "http_addr": f"{self.http_addr[0]}:{self.http_addr[1]}",
            "state_dir": self.state_dir,
            "role": self.role,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every setting; ``None`` default so we can tell 'not given'."""
    for option in OPTIONS:
        parser.add_argument(option.flag, dest=option.field, default=None,
                            help=f"{option.help} [{option.env}; default {option.default}]")


def load(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Merge flags over environment over defaults; raise ConfigError on the first bad one."""
    flags = flags or {}
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    for option in OPTIONS:
        raw = flags.get(option.field)
        if raw is None:
            raw = env.get(option.env) or None
        if raw is not None:
            explicit.add(option.field)
        else:
            raw = option.default
        if raw is None:
            values[option.field] = None
            continue
        try:
            values[option.field] = option.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{option.env} / {option.flag}: {exc}") from None
    values["pod_name"] = env.get("POD_NAME") or None
    values["pod_namespace"] = env.get("POD_NAMESPACE") or None
    if not values["identity"]:
        values["identity"] = values["pod_name"] or f"{socket.gethostname()}:{os.getpid()}"
    if values["backend"] == "sqlite" and not values["dsn"]:
        values["dsn"] = DEFAULT_SQLITE_PATH
    settings = Settings(**values, explicit=frozenset(explicit))
    validate(settings)
    return settings


def validate(s: Settings) -> None:
    """The timing rules between settings, one error per rule (client-go style)."""

    def fail(env: str, flag: str, message: str) -> None:
        raise ConfigError(f"{env} / {flag}: {message}")

    if s.backend in ("postgres", "postgres-row", "sqlserver") and not s.dsn:
        fail("LEASE_DSN", "--dsn", f"the {s.backend} backend needs a DSN")
    if s.backend == "postgres" and s.dsn and not s.dsn.startswith(("postgres://", "postgresql://")):
        fail("LEASE_DSN", "--dsn", "must be a postgresql:// URL for the postgres backend")
    if s.backend == "postgres-row" and s.dsn and not s.dsn.startswith(
        ("postgres://", "postgresql://")
    ):
        fail("LEASE_DSN", "--dsn", "must be a postgresql:// URL for the postgres-row backend")
    if s.replica_dsn and s.backend not in ("postgres-row", "sqlserver"):
        fail("LEASE_REPLICA_DSN", "--replica-dsn",
             f"replica confirmation needs a row backend on a server, not {s.backend}")
    if s.backend == "kubernetes":
        for name in s.names:
            if not _DNS_SUBDOMAIN.match(s.row_name(name)) or len(s.row_name(name)) > 253:
                fail("LEASE_NAME", "--name",
                     f"{s.row_name(name)!r} (key prefix + name) is not a valid Kubernetes "
                     "object name (lowercase letters, digits, '-', '.')")
    if len(s.identity) > 128:
        fail("LEASE_IDENTITY", "--identity", "longer than 128 characters")
    if s.lease_duration < 1:
        fail("LEASE_DURATION", "--lease-duration", "must be at least 1s")
    if s.renew_interval <= 0:
        fail("LEASE_RENEW_INTERVAL", "--renew-interval", "must be greater than 0")
    if s.safety_margin < 0 or s.safety_margin >= s.lease_duration:
        fail("LEASE_SAFETY_MARGIN", "--safety-margin",
             "must be at least 0 and less than the lease duration")
    if s.renew_interval >= s.lease_duration - s.safety_margin:
        fail("LEASE_RENEW_INTERVAL", "--renew-interval",
             "must be less than lease duration minus safety margin, or the claim lapses "
             "between renewals")
    if not s.renew_interval < s.renew_deadline <= s.lease_duration:
        fail("LEASE_RENEW_DEADLINE", "--renew-deadline",
             "must be greater than the renew interval and at most the lease duration")
    if not 0.01 <= s.claim_horizon < s.lease_duration - s.safety_margin:
        fail("LEASE_CLAIM_HORIZON", "--claim-horizon",
             "must be at least 10ms and less than lease duration minus safety margin")
    if s.exec_grace < 0:
        fail("LEASE_EXEC_GRACE", "--grace", "must not be negative")
