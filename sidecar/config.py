"""Settings: environment variables and matching flags, validated before anything connects.

Every setting has one ``LEASE_*`` variable and one flag; a flag wins over the variable,
the variable over the default. Two defaults are derived from the lease duration when
unset, as client-go's are (15s lease, 10s renew deadline, 2s retry period): the renew
deadline (2/3 of it) and the renew interval (2/15 of it), so ``LEASE_DURATION=3s`` alone
works. Validation reports the first bad setting as one line naming both spellings, the
values it compared and which of them were defaults; the CLI exits with code 2.

Durations are Go's (``time.ParseDuration``, as client-go users write them): ``250ms``,
``1.5s``, ``1m30s``, ``1h2m``, also ``us``/``µs``/``ns``, or plain seconds. Only finite,
non-negative values within each setting's bounds pass, so every value in
:meth:`Settings.public` is plain JSON.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any

from sidecar.dsn import DsnError
from sidecar.lease import BACKENDS, backend_module
from sidecar.lease.rowlease import validate_identifier
from sidecar.names import object_name_problem, prefixed
from sidecar.redact import redact, remember_secrets

# The name the backend modules import; the one redaction function (sidecar.redact).
redact_dsn = redact

ROLES = ("all", "worker", "api")
POD_LABEL_MODES = ("auto", "on", "off")
DEFAULT_SQLITE_PATH = "/var/tmp/lease-sidecar/leases.sqlite3"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")

# Go's duration syntax: one or more <number><unit>; a lone number is seconds here.
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_PART = re.compile(rf"({_NUMBER})(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")
_PARTS = re.compile(rf"(?:{_PART.pattern})+")
_PLAIN = re.compile(_NUMBER)
_UNITS = {"ns": Decimal("1e-9"), "us": Decimal("1e-6"), "\u00b5s": Decimal("1e-6"),
          "\u03bcs": Decimal("1e-6"), "ms": Decimal("0.001"), "s": Decimal(1),
          "m": Decimal(60), "h": Decimal(3600)}
# Far beyond any bound below; keeps every parsed value a finite float.
MAX_DURATION = Decimal(10**9)
HOUR = 3600.0
# The elector sleeps the renew interval plus up to this much jitter between renewals.
RENEW_JITTER = 0.1
# client-go electors observe Lease record changes at one-second granularity.
KUBE_MIN_SAFETY_MARGIN = 1.0


class ConfigError(ValueError):
    """One bad setting; ``str()`` is the one line shown to the user."""


def _quoted(text: str) -> str:
    """The user's text in an error, cut short (a value can be 400 characters of nines)."""
    return repr(text) if len(text) <= 24 else f"{text[:12]!r}… ({len(text)} characters)"


def parse_duration(text: str) -> float:
    """Go's duration syntax (``1m30s``, ``250ms``, ``1.5h``) or plain seconds → seconds."""
    raw = text.strip()
    if raw.startswith("-"):
        raise ValueError(f"{_quoted(text)} is not a duration: it is negative")
    body = raw[1:] if raw.startswith("+") else raw
    if _PLAIN.fullmatch(body):
        total = Decimal(body)
    elif _PARTS.fullmatch(body):
        total = sum((Decimal(number) * _UNITS[unit] for number, unit in _PART.findall(body)),
                    Decimal(0))
    else:
        raise ValueError(f"{_quoted(text)} is not a duration (use 250ms, 1.5s, 1m30s, 2h or "
                         "plain seconds)")
    if total > MAX_DURATION:
        raise ValueError(f"{_quoted(text)} is too large (more than {MAX_DURATION} seconds)")
    return float(total)


def format_duration(seconds: float) -> str:
    """Seconds as Go would write them, shortest form: ``250ms``, ``1.5s``, ``1m30s``."""
    if seconds == 0:
        return "0s"
    if seconds < 0.001:
        return f"{round(seconds * 1e6, 3):g}\u00b5s"
    if seconds < 1:
        return f"{round(seconds * 1e3, 3):g}ms"
    hours, rest = divmod(round(seconds * 1000), 3_600_000)
    minutes, millis = divmod(rest, 60_000)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else ""]
    if millis or not any(parts):
        parts.append(f"{millis / 1000:g}s")
    return "".join(parts)


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
    commands: frozenset[str] = field(default=frozenset({"run", "exec"}))


# ``run`` and ``exec`` hold a lease and take every setting; ``status`` only reads and
# ``schema`` only provisions, so their flags are the few they use. Every command still
# reads every LEASE_* variable: one environment describes one sidecar, and a status run in
# its container sees the same settings (and the same refusals) as the sidecar itself.
COMMANDS = ("run", "exec", "schema", "status")
_EVERY = frozenset(COMMANDS)
_READS = frozenset({"run", "exec", "status"})


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
           "host:port of the HTTP endpoint"),
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
    Option("pod_label", "LEASE_POD_LABEL", "--pod-label", _choice(POD_LABEL_MODES), "auto",
           "keep the lease-role pod label (auto: when POD_NAME/POD_NAMESPACE are set)"),
    Option("exec_grace", "LEASE_EXEC_GRACE", "--grace", parse_duration, "10s",
           "exec: time between SIGTERM and SIGKILL of the command on lease loss", (0.0, HOUR),
           commands=frozenset({"exec"})),
    Option("work_stall_after", "LEASE_WORK_STALL_AFTER", "--work-stall-after", parse_duration,
           None, "step down when the application has not POSTed /heartbeat for this long "
           "while leading (unset: no work watchdog)", (0.1, 24 * HOUR),
           "a shorter period leaves no room for the application's heartbeats"),
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
    work_stall_after: float | None = None
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
        return prefixed(self.key_prefix, name)

    def public(self) -> dict[str, Any]:
        """Settings safe to show in /status and logs: no password, only finite numbers."""
        return {
            "backend": self.backend,
            "dsn": redact(self.dsn),
            "replica_dsn": redact(self.replica_dsn),
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
            "work_stall_after": self.work_stall_after,
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
    if values["backend"] == "sqlite" and not values["dsn"]:
        values["dsn"] = DEFAULT_SQLITE_PATH
    # Before any check can fail: every later line that might echo a DSN masks these.
    remember_secrets([values["dsn"], values["replica_dsn"]])
    settings = Settings(**values, explicit=frozenset(explicit))
    validate(settings, dsn_required=dsn_required)
    return settings


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


def check_dsn(settings: Settings, check: Callable[[str], None]) -> None:
    """Run one backend's DSN check on ``LEASE_DSN`` and ``LEASE_REPLICA_DSN``."""
    for name in ("dsn", "replica_dsn"):
        value = getattr(settings, name)
        if value:
            try:
                check(value)
            except DsnError as exc:
                option = _BY_FIELD[name]
                raise ConfigError(f"{option.env} / {option.flag}: {exc}") from None


_EXTRAS = {"postgres": "postgres", "postgres-row": "postgres", "sqlserver": "sqlserver",
           "kubernetes": "kubernetes"}


def validate(s: Settings, *, dsn_required: bool = True) -> None:
    """The rules between settings, then the backend's own checks; one error per rule."""

    def fail(env: str, flag: str, message: str) -> None:
        raise ConfigError(f"{env} / {flag}: {message}")

    if dsn_required and s.backend in ("postgres", "postgres-row", "sqlserver") and not s.dsn:
        fail("LEASE_DSN", "--dsn", f"the {s.backend} backend needs a DSN")
    if s.replica_dsn and s.backend not in ("postgres-row", "sqlserver"):
        fail("LEASE_REPLICA_DSN", "--replica-dsn",
             f"replica confirmation needs a row backend on a server, not {s.backend}")
    if s.backend == "kubernetes":
        for name in s.names:
            problem = object_name_problem(s.key_prefix, name)
            if problem:
                fail("LEASE_NAME", "--name", problem)
    if len(s.identity) > 128:
        fail("LEASE_IDENTITY", "--identity", "longer than 128 characters")
    validate_timing(s)
    _validate_backend(s)


def validate_timing(s: Settings) -> None:
    """The timing rules, checked only for the backend that uses each setting.

    The holder's validity after a successful acquire or renew is ``lease_duration -
    safety_margin`` (TTL backends) or ``renew_deadline`` (``postgres``, the advisory
    lock), counted from the request's send time. Renewals come every renew interval
    plus up to 10 % jitter, and a new holder's first claim comes one claim horizon
    after its acquire, its first renew one renew interval after that: both must fit
    inside the validity, or every term ends before its first renew.
    """
    rule = _Rule(s)
    if s.backend == "postgres":
        if s.renew_deadline > s.lease_duration:
            rule.fail(["renew_deadline", "lease_duration"],
                      "{renew_deadline} must be at most {lease_duration}")
        validity, validity_text = s.renew_deadline, "{renew_deadline}"
    else:
        if s.safety_margin >= s.lease_duration:
            rule.fail(["safety_margin", "lease_duration"],
                      "{safety_margin} must be less than {lease_duration}")
        if s.backend == "kubernetes" and s.safety_margin < KUBE_MIN_SAFETY_MARGIN:
            rule.fail(["safety_margin"],
                      "{safety_margin} is less than 1s, the minimum for the kubernetes backend: "
                      "client-go electors on the same Lease observe its changes at one-second "
                      "granularity and may take over up to 1s before its nominal expiry")
        validity = s.lease_duration - s.safety_margin
        validity_text = ("{lease_duration} minus {safety_margin} = "
                         + format_duration(validity))
    renew_span = s.renew_interval * (1 + RENEW_JITTER)
    if renew_span >= validity:
        rule.fail(["renew_interval", *rule.fields(validity_text)],
                  "{renew_interval} plus its 10% jitter (" + format_duration(renew_span)
                  + ") must be less than " + validity_text
                  + ", or the lease lapses between renewals")
    first_renew = s.claim_horizon + renew_span
    if first_renew >= validity:
        rule.fail(["claim_horizon", "renew_interval", *rule.fields(validity_text)],
                  "{claim_horizon} plus {renew_interval} with its 10% jitter = "
                  + format_duration(first_renew) + " must be less than " + validity_text
                  + ": a new holder's first claim comes one claim horizon after its acquire "
                  "and its first renew one renew interval (up to +10%) after that, so every "
                  "term would end before its first renew")


class _Rule:
    """Builds a rule's error: blames the first setting the user gave (else the first
    one), and shows every value with its origin: given, default, or derived."""

    def __init__(self, s: Settings) -> None:
        self.s = s

    @staticmethod
    def fields(template: str) -> list[str]:
        return re.findall(r"\{(\w+)\}", template)

    def describe(self, name: str) -> str:
        text = format_duration(getattr(self.s, name))
        if name in self.s.explicit:
            return text
        if name in DERIVED:
            return f"{text} (derived: {DERIVED[name][1]} of LEASE_DURATION)"
        return f"{text} (default)"

    def fail(self, candidates: list[str], template: str) -> None:
        blamed = next((c for c in candidates if c in self.s.explicit), candidates[0])
        terms = {name: f"{_BY_FIELD[name].env} {self.describe(name)}"
                 for name in self.fields(template)}
        first = self.fields(template)[0]
        if first == blamed:  # the sentence's subject is the setting named up front
            terms[first] = self.describe(first)
        option = _BY_FIELD[blamed]
        raise ConfigError(f"{option.env} / {option.flag}: {template.format(**terms)}")


def _validate_backend(s: Settings) -> None:
    """The backend module's own ``validate_settings`` (DSN syntax, name lengths, ...).

    Imported here, not at the top: running on SQLite must not import asyncpg, pyodbc or
    the kubernetes client, and a missing extra is a setting error, not a traceback.
    """
    try:
        module = backend_module(s.backend)
    except ImportError as exc:
        raise ConfigError(f"LEASE_BACKEND / --backend: the {s.backend} backend cannot load "
                          f"({exc}); install lease-sidecar[{_EXTRAS.get(s.backend, 'all')}]"
                          ) from None
    check = getattr(module, "validate_settings", None)
    if check is not None:
        check(s)
