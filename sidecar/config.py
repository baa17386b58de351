"""Settings from environment variables and flags, checked before anything connects.

Every setting has one ``LEASE_*`` variable and one flag; a flag wins over the variable,
the variable over the default. Two defaults are derived from the lease duration when
unset, as client-go's are (15s lease, 10s renew deadline, 2s retry period): the renew
deadline (2/3 of it) and the renew interval (2/15 of it; on kubernetes, where each renew
is an apiserver request, 1/3 of it less the safety margin: ``BackendEntry.renew_share``),
so ``LEASE_DURATION=3s`` alone works. Loading reports the first bad setting as one line naming
both spellings, the values it compared and which of them were defaults; the CLI exits with
code 2.

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
from typing import Any, NamedTuple

from sidecar.base.clock import format_duration, parse_duration
from sidecar.base.dsn import DsnError
from sidecar.base.errors import ConfigError
from sidecar.base.names import validate_identifier
from sidecar.base.redact import remember_secrets
from sidecar.lease import BACKENDS, BackendEntry, backend_entry, load_driver
from sidecar.publish.shards import SHARDS_FILE
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


# The most shards one set may have: the assignment weighs every (shard, member) pair.
MAX_SHARDS = 4096


def parse_shards(text: str) -> int | tuple[str, ...]:
    """``LEASE_SHARDS``: a count, or the shards' names separated by commas."""
    text = text.strip()
    if text.isdigit():
        count = int(text)
        if not 1 <= count <= MAX_SHARDS:
            raise ValueError(f"{count} shards: give 1 to {MAX_SHARDS}")
        return count
    names = parse_names(text)
    if len(names) > MAX_SHARDS:
        raise ValueError(f"{len(names)} shards: give at most {MAX_SHARDS}")
    return names


def shard_set(spec: int | tuple[str, ...] | None, lease: str,
              names: tuple[str, ...]) -> tuple[str, ...]:
    """The shards' lease names: ``<lease>-0`` … ``<lease>-<count-1>`` for a count, else the
    names given; none of them a lease name too, nor ``leader`` or ``shards`` (files of
    the state directory)."""
    if spec is None:
        return ()
    shards = tuple(f"{lease}-{i}" for i in range(spec)) if isinstance(spec, int) else spec
    for shard in shards:
        if shard in names:
            raise ValueError(f"{shard!r} is a lease name (LEASE_NAME) and a shard")
        if shard in ("leader", SHARDS_FILE):
            raise ValueError(f"{shard!r} cannot be a shard (it is a file of the state "
                             "directory)")
    return shards


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


@dataclass(frozen=True)
class _Choice:
    """A parser that accepts one of ``options`` (which the reference lists)."""

    options: tuple[str, ...]

    def __call__(self, text: str) -> str:
        if text not in self.options:
            raise ValueError(f"{text!r} is not one of {', '.join(self.options)}")
        return text


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
    """One setting. Its meaning is written here once: ``help`` in one line (what ``--help``
    shows), ``details`` whatever the configuration reference adds to it
    (``docs/configuration.md`` is generated from this table by ``python -m scripts.gendocs``).
    """

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
    # The default as the reference and --help tell it, where ``default`` is None but
    # something else applies (the identity; a backend's own default, which the reference
    # lists from the backends' entries).
    shown_default: str | None = None
    # Markdown for the reference only, beyond ``help``: when it applies, links.
    details: str = ""


# ``run`` and ``exec`` hold a lease and take every setting; ``status`` only reads and
# ``schema`` only provisions, so their flags are the few they use. Every command still
# reads every LEASE_* variable: one environment describes one sidecar, and a status run in
# its container sees the same settings (and the same refusals) as the sidecar itself.
COMMANDS = ("run", "exec", "schema", "status", "handover")
_EVERY = frozenset(COMMANDS)
_READS = frozenset({"run", "exec", "status", "handover"})


OPTIONS: tuple[Option, ...] = (
    Option("backend", "LEASE_BACKEND", "--backend", _Choice(BACKENDS), "sqlite",
           "where the lease lives",
           commands=_EVERY,
           details="[Choosing a backend](backends.md)."),
    Option("dsn", "LEASE_DSN", "--dsn", _text, None,
           "backend address: sqlite file path, postgresql:// URL or ODBC connection string",
           commands=_EVERY, shown_default="the backend's own, where it has one",
           details="SQLite also takes `sqlite:////abs/path` and `sqlite:///relative`; unused "
           "by `kubernetes`. Checked before anything starts ([DSNs](#dsns))."),
    Option("replica_dsn", "LEASE_REPLICA_DSN", "--replica-dsn", _text, None,
           "read replica that must confirm an acquisition (row backends)",
           details="`postgres-row`, `sqlserver`: an acquisition counts only once the replica "
           "shows it ([postgres-row](postgres-row.md#replica-confirmation))."),
    Option("replica_timeout", "LEASE_REPLICA_TIMEOUT", "--replica-timeout", parse_duration,
           "5s", "how long to wait for the replica to confirm", (0.01, HOUR)),
    Option("names", "LEASE_NAME", "--name", parse_names, "default",
           "lease name, or several separated by commas (the first is the primary)",
           commands=_READS,
           details="The primary is the one `/leader` and the file `leader` answer for; each "
           "name also has `/leader/{name}` and the file `{name}`."),
    Option("shards", "LEASE_SHARDS", "--shards", parse_shards, None,
           "a shard set beside the lease names: a count (shards <name>-0 … <name>-<count-1> "
           "of the first name) or shard names separated by commas; each member holds about "
           "its fair share", commands=_READS,
           details=f"At most {MAX_SHARDS}. Each shard is a lease of its own (token, claims, "
           "`/leader/{shard}`); the members spread them evenly and move as few as possible "
           "when members come and go; which backends can: [sharding the work]"
           "(sharding.md)."),
    Option("identity", "LEASE_IDENTITY", "--identity", _text, None,
           "this contender's unique id", shown_default="`POD_NAME`, else `host:pid`",
           details=f"At most {MAX_IDENTITY} characters. Two live processes with one identity "
           "are a misconfiguration ([design](design.md#the-safety-model))."),
    Option("key_prefix", "LEASE_KEY_PREFIX", "--key-prefix", _text, "lease-sidecar",
           "namespace for lock ids and row names",
           commands=_READS,
           details="Lock ids, row names and Lease objects are `{prefix}.{name}` (the name "
           "alone with an empty prefix), so services sharing a store never collide."),
    Option("lease_duration", "LEASE_DURATION", "--lease-duration", parse_duration, "15s",
           "TTL of row and Lease backends", (1.0, HOUR),
           details="Also the base of the derived defaults below."),
    Option("renew_interval", "LEASE_RENEW_INTERVAL", "--renew-interval", parse_duration, None,
           "renew / retry / heartbeat period (kubernetes: 1/3 of the lease duration "
           "minus the safety margin unless given, as each renew is an apiserver request)",
           (0.01, HOUR),
           "a faster renew loop only burns CPU",
           details="The elector adds up to 10 % jitter."),
    Option("renew_deadline", "LEASE_RENEW_DEADLINE", "--renew-deadline", parse_duration, None,
           "postgres (advisory lock): step down when no heartbeat succeeded for this long",
           (0.01, HOUR)),
    Option("safety_margin", "LEASE_SAFETY_MARGIN", "--safety-margin", parse_duration, "1s",
           "TTL backends: stop claiming this long before the lease could expire",
           (0.0, HOUR),
           details="Absorbs clock-rate differences; at least `1s` on `kubernetes` "
           "([next to client-go](kubernetes-backend.md#next-to-client-go-electors))."),
    Option("claim_horizon", "LEASE_CLAIM_HORIZON", "--claim-horizon", parse_duration, "250ms",
           "how far ahead a published claim is valid", (0.01, HOUR),
           "the leader file is rewritten every two thirds of a horizon",
           details="Also a new holder's wait before its first claim, and the longest a "
           "stepping-down holder waits before it releases."),
    Option("http_addr", "LEASE_HTTP_ADDR", "--http-addr", parse_addr, "127.0.0.1:8099",
           "host:port of the HTTP endpoint",
           commands=frozenset({"run", "exec", "handover"}),
           details="Port `0` picks a free one ([HTTP API](http-api.md))."),
    Option("state_dir", "LEASE_STATE_DIR", "--state-dir", _text, "/run/lease",
           "directory of the leader file",
           details="Vetted at start: exit 2 naming it if others could write there "
           "([the state directory](security.md#the-state-directory)). If the *default* "
           "cannot be created (non-root on a VM), a private `0700` directory "
           "`lease-sidecar-<uid>` under `$XDG_RUNTIME_DIR` or `/tmp` is used and logged."),
    Option("role", "LEASE_ROLE", "--role", _Choice(ROLES), "all",
           "all | worker (contend) or api (never contend)",
           details="`api` reports `role: api` and the label `lease-role=api`."),
    Option("schema", "LEASE_SCHEMA", "--schema", _identifier, "lease",
           "schema of the row-lease table and of the token era's table",
           commands=_EVERY, details="A plain SQL identifier. The token era's table "
           "(`postgres`, `postgres-row`) keeps fencing tokens growing across a "
           "`pg_upgrade` ([high availability]"
           "(high-availability.md#upgrading-postgresql-pgupgrade))."),
    Option("table", "LEASE_TABLE", "--table", _identifier, None,
           "row-lease table",
           commands=_EVERY, shown_default="the backend's own",
           details="A plain SQL identifier."),
    Option("odbc_driver", "LEASE_ODBC_DRIVER", "--odbc-driver", _text, None,
           "ODBC driver name when the DSN names none",
           commands=_EVERY, shown_default="`FreeTDS`",
           details="Used only when the DSN has no `DRIVER=`."),
    Option("ensure_schema", "LEASE_ENSURE_SCHEMA", "--ensure-schema", _bool, "false",
           "create the backend's tables at start if missing: the lease table "
           "(postgres-row, sqlserver), the token era's (postgres) (idempotent; needs a "
           "role that may create them)",
           details="A role that may not stays \"not leader\" with one line naming why "
           "([creating the table](database-operations.md#creating-the-table))."),
    Option("pod_label", "LEASE_POD_LABEL", "--pod-label", _Choice(POD_LABEL_MODES), "auto",
           "keep the lease-role pod label (auto: when POD_NAME/POD_NAMESPACE are set)",
           details="Also the pod Events ([pod label](pod-label.md))."),
    Option("exec_grace", "LEASE_EXEC_GRACE", "--grace", parse_duration, "10s",
           "exec: time between SIGTERM and SIGKILL of the command on lease loss", (0.0, HOUR),
           commands=frozenset({"exec"}),
           details="Never later than the lease could pass "
           "([exec](cli.md#when-sigkill-comes))."),
    Option("work_stall_after", "LEASE_WORK_STALL_AFTER", "--work-stall-after", parse_duration,
           None, "step down when the application has not POSTed /heartbeat for this long "
           "while leading (unset: no work watchdog)", (0.1, 24 * HOUR),
           "a shorter period leaves no room for the application's heartbeats",
           details="Counted from the term's first claim at the earliest; the step-down is "
           "`POST /release`'s ([heartbeat](http-api.md#post-heartbeat-the-work-watchdog))."),
    Option("app_ready_url", "LEASE_APP_READY_URL", "--app-ready-url", parse_ready_url, None,
           "campaign only while this http:// URL of the application answers 2xx (unset: "
           "always campaign)",
           details="Polled every renew interval; a pod whose application never becomes "
           "ready never leads. Not with `LEASE_APP_READY_CONTAINERS` "
           "([hand-over](handover.md#lead-only-when-the-application-can-work))."),
    Option("app_ready_containers", "LEASE_APP_READY_CONTAINERS", "--app-ready-containers",
           parse_containers, None, "in a pod: campaign only while these containers of the "
           "own pod are Ready (comma-separated names; unset: always campaign)",
           details="Their readiness as kubelet reports it, through a watch of the own pod "
           "(needs the pods `get`/`list`/`watch` rule)."),
    Option("shutdown_handover", "LEASE_SHUTDOWN_HANDOVER", "--shutdown-handover",
           _Choice(SHUTDOWN_HANDOVERS), "off", "in a pod, on SIGTERM: off (release; the "
           "first standby wins) or youngest-ready (hand over to the youngest Ready pod of "
           "the lease group)",
           details="`youngest-ready` moves leadership once per rolling update; it needs the "
           "pod label and the pod name as identity "
           "([hand-over](handover.md#one-hand-over-per-rollout))."),
    Option("app_unready_after", "LEASE_APP_UNREADY_AFTER", "--app-unready-after",
           parse_duration, "10s", "with LEASE_APP_READY_URL or LEASE_APP_READY_CONTAINERS: "
           "a leader whose application has not been ready for this long hands over",
           (0.1, 24 * HOUR),
           "a shorter period leaves no room for one slow readiness answer",
           details="As `POST /handover` does."),
    Option("app_ready_outage_grace", "LEASE_APP_READY_OUTAGE_GRACE",
           "--app-ready-outage-grace", parse_duration, "5m",
           "with LEASE_APP_READY_CONTAINERS: while the own pod cannot be watched (the "
           "apiserver is away), the containers' last readiness seen counts this long",
           (1.0, 24 * HOUR),
           details="An apiserver outage says nothing about the application (kubelet "
           "cannot report either); after this long it counts as not ready. Keeps a "
           "database-backed group's leader through an apiserver outage "
           "([hand-over](handover.md#when-the-apiserver-is-away))."),
    Option("control_token_file", "LEASE_CONTROL_TOKEN_FILE", "--control-token-file", _text,
           None, "opt-in: POST /release, /handover and /heartbeat also need the header "
           "Authorization: Bearer with this file's content (created with a random token "
           "if missing)",
           commands=frozenset({"run", "exec", "handover"}),
           details="For meshes, `kubectl port-forward` and host networking, where "
           "loopback callers may come from outside the pod "
           "([security](security.md#post-release-handover-and-heartbeat)); "
           "`lease-sidecar handover` sends it."),
    Option("log_level", "LEASE_LOG_LEVEL", "--log-level",
           _Choice(("debug", "info", "warning", "error")), "info", "log level"),
)

_BY_FIELD = {option.field: option for option in OPTIONS}

class Share(NamedTuple):
    """A default derived from the lease duration (less the safety margin, where
    ``of_validity``): ``fraction`` of it."""

    fraction: Fraction
    of_validity: bool = False

    def of(self, values: Mapping[str, Any]) -> float:
        base = values["lease_duration"]
        if self.of_validity:
            base -= values["safety_margin"]
        return round(float(base * self.fraction), 3)

    def text(self, env: bool = True) -> str:
        """``2/15 of LEASE_DURATION`` (``env``) or ``2/15 of the lease duration``."""
        base = "LEASE_DURATION" if env else "the lease duration"
        if self.of_validity:
            base += " minus LEASE_SAFETY_MARGIN" if env else " minus the safety margin"
        return f"{self.fraction} of {base}"


# Defaults derived from the lease duration when unset: client-go's ratios (a 15s lease,
# a 10s renew deadline, a 2s retry period).
DERIVED: dict[str, Share] = {
    "renew_deadline": Share(Fraction(2, 3)),
    "renew_interval": Share(Fraction(2, 15)),
}


def derived(entry: BackendEntry) -> dict[str, Share]:
    """The derived defaults a backend uses: :data:`DERIVED`, with the backend's own renew
    interval where it has one (``BackendEntry.renew_share``, of the validity)."""
    if entry.renew_share is None:
        return DERIVED
    return {**DERIVED, "renew_interval": Share(entry.renew_share, of_validity=True)}


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Flags of the settings ``command`` uses; ``None`` default so we can tell 'not given'."""
    for option in OPTIONS:
        if command not in option.commands:
            continue
        default = option.default or option.shown_default
        if option.field in DERIVED:
            default = DERIVED[option.field].text(env=False)
        where = option.env if default is None else f"{option.env}; default {default}"
        where = where.replace("`", "")
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
    try:
        values["shards"] = shard_set(values["shards"], values["names"][0], values["names"])
    except ValueError as exc:
        raise _error("shards", str(exc)) from None
    entry = backend_entry(values["backend"])
    shares = derived(entry)
    for name, share in shares.items():
        if values[name] is None:
            values[name] = share.of(values)
    values["pod_name"] = env.get("POD_NAME") or None
    values["pod_namespace"] = env.get("POD_NAMESPACE") or None
    if not values["identity"]:
        values["identity"] = values["pod_name"] or f"{socket.gethostname()}:{os.getpid()}"
    values["dsn"] = values["dsn"] or entry.default_dsn
    values["table"] = values["table"] or entry.default_table
    # Before any check can fail: every later line that might echo a DSN masks these.
    remember_secrets([values["dsn"], values["replica_dsn"]])
    blame = _Blame(values, frozenset(explicit), shares)
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
    if s.shards and entry.shard_group is None:
        raise _error("shards", f"the {store.backend} backend cannot hold shards")
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

    def __init__(self, values: Mapping[str, Any], explicit: frozenset[str],
                 shares: Mapping[str, Share]) -> None:
        self.values = dict(values)
        self.explicit = explicit
        self.shares = shares

    def describe(self, name: str) -> str:
        text = format_duration(self.values[name])
        if name in self.explicit:
            return text
        if name in self.shares:
            return f"{text} (derived: {self.shares[name].text()})"
        return f"{text} (default)"

    def error(self, candidates: list[str], template: str) -> ConfigError:
        blamed = next((c for c in candidates if c in self.explicit), candidates[0])
        fields = re.findall(r"\{(\w+)\}", template)
        terms = {name: f"{_BY_FIELD[name].env} {self.describe(name)}" for name in fields}
        if fields[0] == blamed:  # the sentence's subject is the setting named up front
            terms[fields[0]] = self.describe(fields[0])
        return _error(blamed, template.format(**terms))
