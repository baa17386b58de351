"""Settings from environment variables and flags, checked before anything connects.

Every setting has one ``LEASE_*`` variable and one flag; a flag wins over the variable,
the variable over the default. Two defaults are derived from the lease duration when
unset, as client-go's are (15s lease, 10s renew deadline, 2s retry period): the renew
deadline (2/3 of it) and the renew interval (2/15 of it), so ``LEASE_DURATION=3s`` alone
works. Loading reports the first bad setting as one line naming both spellings, the
values it compared and which of them were defaults; the CLI exits with code 2.

The rules live where their data does: the timing rules in
:class:`~sidecar.settings.Timing`, a backend's own rules in its
:class:`~sidecar.lease.BackendEntry`. This module only names the settings, parses them,
and says in an error which one to change. Only finite, non-negative durations within each
setting's bounds pass, so every value in :meth:`Settings.public` is plain JSON.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from sidecar.base.clock import format_duration, parse_duration
from sidecar.base.dsn import DsnError
from sidecar.base.errors import ConfigError
from sidecar.base.names import validate_identifier
from sidecar.base.redact import remember_secrets
from sidecar.lease import BACKENDS, BackendEntry, backend_entry, load_driver
from sidecar.settings import MAX_IDENTITY, Settings, StoreSettings, Timing, TimingError

ROLES = ("all", "worker", "api")
POD_LABEL_MODES = ("auto", "on", "off")
SHUTDOWN_HANDOVERS = ("off", "youngest-ready")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
HOUR = 3600.0


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


def parse_ready_url(text: str) -> str:
    """An ``http://host[:port]/path`` the sidecar may GET (no https: it is the app's own
    plain readiness endpoint in the same pod or host)."""
    parts = urllib.parse.urlsplit(text)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"{text!r} is not an http://host[:port]/path URL")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    return text


_CONTAINER_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def parse_containers(text: str) -> tuple[str, ...]:
    """Container names (DNS labels), separated by commas."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    for name in names:
        if not _CONTAINER_NAME.match(name):
            raise ValueError(f"{name!r} is not a container name (a DNS label)")
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


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not true or false")


@dataclass(frozen=True)
class Option:
    field: str
    env: str
    flag: str
    parse: Callable[[str], Any]
    default: str | None
    help: str
    # Durations: the smallest and largest value that can work, in seconds.
    bounds: tuple[float, float] | None = None
    why_low: str = ""
    # The subcommands that offer this flag (and list it in their --help).
    commands: frozenset[str] = frozenset({"run", "exec"})


# ``run`` and ``exec`` hold a lease and take every setting; ``status`` only reads and
# ``schema`` only provisions, so their flags are the few they use. Every command still
# reads every LEASE_* variable: one environment describes one sidecar, and a status run in
# its container sees the same settings (and the same refusals) as the sidecar itself.
COMMANDS = ("run", "exec", "schema", "status", "handover")
_EVERY = frozenset(COMMANDS)
_READS = frozenset({"run", "exec", "status", "handover"})


OPTIONS: tuple[Option, ...] = (
    Option("backend", "LEASE_BACKEND", "--backend", _choice(BACKENDS), "sqlite",
           "where the lease lives",
           commands=_EVERY),
    Option("dsn", "LEASE_DSN", "--dsn", _text, None,
           "backend address: sqlite file path, postgresql:// URL or ODBC connection string",
           commands=_EVERY),
    Option("replica_dsn", "LEASE_REPLICA_DSN", "--replica-dsn", _text, None,
           "read replica that must confirm an acquisition (row backends)"),
    Option("replica_timeout", "LEASE_REPLICA_TIMEOUT", "--replica-timeout", parse_duration,
           "5s", "how long to wait for the replica to confirm", (0.01, HOUR)),
    Option("names", "LEASE_NAME", "--name", parse_names, "default",
           "lease name, or several separated by commas (the first is the primary)",
           commands=_READS),
    Option("identity", "LEASE_IDENTITY", "--identity", _text, None,
           "this contender's unique id (default: POD_NAME, else host:pid)"),
    Option("key_prefix", "LEASE_KEY_PREFIX", "--key-prefix", _text, "lease-sidecar",
           "namespace for lock ids and row names",
           commands=_READS),
    Option("lease_duration", "LEASE_DURATION", "--lease-duration", parse_duration, "15s",
           "TTL of row and Lease backends", (1.0, HOUR)),
    Option("renew_interval", "LEASE_RENEW_INTERVAL", "--renew-interval", parse_duration, None,
           "renew / retry / heartbeat period", (0.01, HOUR),
           "a faster renew loop only burns CPU"),
    Option("renew_deadline", "LEASE_RENEW_DEADLINE", "--renew-deadline", parse_duration, None,
           "postgres (advisory lock): step down when no heartbeat succeeded for this long",
           (0.01, HOUR)),
    Option("safety_margin", "LEASE_SAFETY_MARGIN", "--safety-margin", parse_duration, "1s",
           "TTL backends: stop claiming this long before the lease could expire",
           (0.0, HOUR)),
    Option("claim_horizon", "LEASE_CLAIM_HORIZON", "--claim-horizon", parse_duration, "250ms",
           "how far ahead a published claim is valid", (0.01, HOUR),
           "the leader file is rewritten every half horizon"),
    Option("http_addr", "LEASE_HTTP_ADDR", "--http-addr", parse_addr, "127.0.0.1:8099",
           "host:port of the HTTP endpoint",
           commands=frozenset({"run", "exec", "handover"})),
    Option("state_dir", "LEASE_STATE_DIR", "--state-dir", _text, "/run/lease",
           "directory of the leader file"),
    Option("role", "LEASE_ROLE", "--role", _choice(ROLES), "all",
           "all | worker (contend) or api (never contend)"),
    Option("schema", "LEASE_SCHEMA", "--schema", _identifier, "lease",
           "row-lease schema",
           commands=_EVERY),
    Option("table", "LEASE_TABLE", "--table", _identifier, None,
           "row-lease table (default Leases on sqlserver, leases elsewhere)",
           commands=_EVERY),
    Option("odbc_driver", "LEASE_ODBC_DRIVER", "--odbc-driver", _text, None,
           "ODBC driver name when the DSN names none (default FreeTDS)",
           commands=_EVERY),
    Option("ensure_schema", "LEASE_ENSURE_SCHEMA", "--ensure-schema", _bool, "false",
           "postgres-row, sqlserver: create the lease table at start if missing "
           "(idempotent; needs a role that may create it)"),
    Option("pod_label", "LEASE_POD_LABEL", "--pod-label", _choice(POD_LABEL_MODES), "auto",
           "keep the lease-role pod label (auto: when POD_NAME/POD_NAMESPACE are set)"),
    Option("exec_grace", "LEASE_EXEC_GRACE", "--grace", parse_duration, "10s",
           "exec: time between SIGTERM and SIGKILL of the command on lease loss", (0.0, HOUR),
           commands=frozenset({"exec"})),
    Option("work_stall_after", "LEASE_WORK_STALL_AFTER", "--work-stall-after", parse_duration,
           None, "step down when the application has not POSTed /heartbeat for this long "
           "while leading (unset: no work watchdog)", (0.1, 24 * HOUR),
           "a shorter period leaves no room for the application's heartbeats"),
    Option("app_ready_url", "LEASE_APP_READY_URL", "--app-ready-url", parse_ready_url, None,
           "campaign only while this http:// URL of the application answers 2xx (unset: "
           "always campaign)"),
    Option("app_ready_containers", "LEASE_APP_READY_CONTAINERS", "--app-ready-containers",
           parse_containers, None, "in a pod: campaign only while these containers of the "
           "own pod are Ready (comma-separated names; unset: always campaign)"),
    Option("shutdown_handover", "LEASE_SHUTDOWN_HANDOVER", "--shutdown-handover",
           _choice(SHUTDOWN_HANDOVERS), "off", "in a pod, on SIGTERM: off (release; the "
           "first standby wins) or youngest-ready (hand over to the youngest Ready pod of "
           "the lease group)"),
    Option("app_unready_after", "LEASE_APP_UNREADY_AFTER", "--app-unready-after",
           parse_duration, "10s", "with LEASE_APP_READY_URL: a leader whose application "
           "has not answered 2xx for this long hands over", (0.1, 24 * HOUR),
           "a shorter period leaves no room for one slow readiness answer"),
    Option("log_level", "LEASE_LOG_LEVEL", "--log-level",
           _choice(("debug", "info", "warning", "error")), "info", "log level"),
)

_BY_FIELD = {option.field: option for option in OPTIONS}

# Defaults derived from the lease duration when unset: client-go's ratios (a 15s lease,
# a 10s renew deadline, a 2s retry period).
DERIVED: dict[str, tuple[Fraction, str]] = {
    "renew_deadline": (Fraction(2, 3), "2/3"),
    "renew_interval": (Fraction(2, 15), "2/15"),
}


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Flags of the settings ``command`` uses; ``None`` default so we can tell 'not given'."""
    for option in OPTIONS:
        if command not in option.commands:
            continue
        default = option.default
        if option.field in DERIVED:
            default = f"{DERIVED[option.field][1]} of the lease duration"
        where = option.env if default is None else f"{option.env}; default {default}"
        parser.add_argument(option.flag, dest=option.field, default=None,
                            help=f"{option.help} [{where}]")


def load(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None, *,
         dsn_required: bool = True) -> Settings:
    """Merge flags over environment over defaults; raise ConfigError on the first bad one.

    ``dsn_required=False`` is for commands that never connect (``schema --print``).
    """
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
        _check_bounds(option, values[option.field])
    for name, (fraction, _) in DERIVED.items():
        if values[name] is None:
            values[name] = round(float(values["lease_duration"] * fraction), 3)
    values["pod_name"] = env.get("POD_NAME") or None
    values["pod_namespace"] = env.get("POD_NAMESPACE") or None
    if not values["identity"]:
        values["identity"] = values["pod_name"] or f"{socket.gethostname()}:{os.getpid()}"
    entry = backend_entry(values["backend"])
    values["dsn"] = values["dsn"] or entry.default_dsn
    values["table"] = values["table"] or entry.default_table
    # Before any check can fail: every later line that might echo a DSN masks these.
    remember_secrets([values["dsn"], values["replica_dsn"]])
    blame = _Blame(values, frozenset(explicit))
    try:
        timing = Timing(**{name: values.pop(name) for name in _TIMING_FIELDS},
                        holds_by=entry.holds_by)
    except TimingError as exc:
        raise blame.error(exc.blame, exc.template) from None
    store = StoreSettings(**{name: values.pop(name) for name in _STORE_FIELDS})
    settings = Settings(store=store, timing=timing, **values, explicit=frozenset(explicit))
    _validate(settings, entry, blame, dsn_required=dsn_required)
    return settings


_TIMING_FIELDS = ("lease_duration", "renew_interval", "renew_deadline", "safety_margin",
                  "claim_horizon")
_STORE_FIELDS = ("backend", "dsn", "replica_dsn", "replica_timeout", "key_prefix", "schema",
                 "table", "odbc_driver", "ensure_schema")


def _check_bounds(option: Option, value: Any) -> None:
    if option.bounds is None:
        return
    low, high = option.bounds
    if value < low:
        why = f" ({option.why_low})" if option.why_low else ""
        raise ConfigError(f"{option.env} / {option.flag}: {format_duration(value)} is less than "
                          f"the minimum {format_duration(low)}{why}")
    if value > high:
        raise ConfigError(f"{option.env} / {option.flag}: {format_duration(value)} is more than "
                          f"the maximum {format_duration(high)}")


def _validate(s: Settings, entry: BackendEntry, blame: _Blame, *, dsn_required: bool) -> None:
    """The rules that span groups, then the backend's own; one error per rule."""
    store = s.store
    if dsn_required and entry.needs_dsn and not store.dsn:
        raise _error("dsn", f"the {store.backend} backend needs a DSN")
    if dsn_required:  # a command that connects: its driver must be there
        load_driver(store.backend)
    if store.replica_dsn and not entry.takes_replica:
        raise _error("replica_dsn", "replica confirmation needs a row backend on a server, "
                     f"not {store.backend}")
    if store.ensure_schema and entry.apply_schema is None:
        raise _error("ensure_schema", f"the {store.backend} backend has no table to create")
    if len(s.identity) > MAX_IDENTITY:
        raise _error("identity", f"longer than {MAX_IDENTITY} characters")
    if s.app_ready_containers and s.app_ready_url:
        raise _error("app_ready_containers", "give LEASE_APP_READY_URL or this, not both")
    if s.shutdown_handover != "off":
        if not (s.pod_name and s.pod_namespace):
            raise _error("shutdown_handover", "needs POD_NAME and POD_NAMESPACE (the "
                         "downward API) to find the lease group's pods")
        if s.pod_label == "off":
            raise _error("shutdown_handover", "needs the pod label (LEASE_POD_LABEL not "
                         "off): the group's pods are found by it")
        if s.identity != s.pod_name:
            raise _error("shutdown_handover", "needs the identity to be the pod name "
                         "(LEASE_IDENTITY unset): the successor is named by its pod")
    if s.app_ready_containers and not (s.pod_name and s.pod_namespace):
        raise _error("app_ready_containers", "needs POD_NAME and POD_NAMESPACE (the "
                     "downward API) to find its own pod")
    if entry.min_safety_margin is not None:
        least, why = entry.min_safety_margin
        if s.timing.safety_margin < least:
            raise blame.error(["safety_margin"], "{safety_margin} is less than "
                              f"{format_duration(least)}, the minimum for the {store.backend} "
                              f"backend: {why}")
    if entry.check_dsn is not None:
        for name in ("dsn", "replica_dsn"):
            value = getattr(store, name)
            if value:
                try:
                    entry.check_dsn(value)
                except DsnError as exc:
                    raise _error(name, str(exc)) from None
    if entry.validate is not None:
        entry.validate(s)


def _error(name: str, message: str) -> ConfigError:
    option = _BY_FIELD[name]
    return ConfigError(f"{option.env} / {option.flag}: {message}")


class _Blame:
    """Names a broken rule's setting: the first one the user gave (else the first one),
    and shows every value with its origin: given, default, or derived."""

    def __init__(self, values: Mapping[str, Any], explicit: frozenset[str]) -> None:
        self.values = dict(values)
        self.explicit = explicit

    def describe(self, name: str) -> str:
        text = format_duration(self.values[name])
        if name in self.explicit:
            return text
        if name in DERIVED:
            return f"{text} (derived: {DERIVED[name][1]} of LEASE_DURATION)"
        return f"{text} (default)"

    def error(self, candidates: list[str], template: str) -> ConfigError:
        blamed = next((c for c in candidates if c in self.explicit), candidates[0])
        fields = re.findall(r"\{(\w+)\}", template)
        terms = {name: f"{_BY_FIELD[name].env} {self.describe(name)}" for name in fields}
        if fields[0] == blamed:  # the sentence's subject is the setting named up front
            terms[fields[0]] = self.describe(fields[0])
        return _error(blamed, template.format(**terms))
