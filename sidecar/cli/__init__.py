"""``lease-sidecar run | exec | schema | fence-schema | status | handover | operator``.

Exit codes: ``sidecar.base.errors`` (``EXIT_*``), told to users in docs/cli.md's table.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import sidecar
from sidecar import config, fence
from sidecar.base import jsonlog
from sidecar.base.clock import first_of, parse_duration
from sidecar.base.errors import (
    EXIT_BAD_SETTINGS,
    EXIT_FAILED,
    EXIT_NO_SUCH_LEASE,
    BackendError,
    ConfigError,
    NotFound,
)
from sidecar.base.redact import redact
from sidecar.lease import backend_entry
from sidecar.runtime import Sidecar
from sidecar.settings import Settings

log = logging.getLogger("sidecar.cli")


def version() -> str:
    """The one version source; pyproject.toml reads it too (``dynamic``)."""
    return sidecar.__version__


def _command(commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
             text: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(name, help=text, description=text)
    config.add_arguments(parser, name)
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lease-sidecar",
        description="Hold a distributed lease and tell the application whether it leads.")
    parser.add_argument("--version", action="version", version=f"lease-sidecar {version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    _command(commands, "run", "hold the lease and publish it (HTTP, file, label)")

    exe = _command(commands, "exec", "run a command only while holding the lease")
    exe.add_argument("--acquire-timeout", default=None,
                     help="give up (exit 75) if the lease is not ours within this duration")
    exe.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")

    schema = _command(commands, "schema", "print or apply the row-lease table DDL")
    action = schema.add_mutually_exclusive_group(required=True)
    action.add_argument("--print", action="store_true", dest="print_ddl",
                        help="print the DDL (connects to nothing, needs no DSN)")
    action.add_argument("--apply", action="store_true",
                        help="create the schema and table if missing (idempotent)")

    # The guard lives in the application's database: its own few flags, not a backend's.
    guard = commands.add_parser(
        "fence-schema", help="print or apply the fencing guard for the application's "
        "database", description="print or apply the fencing guard (docs/fencing.md)")
    action = guard.add_mutually_exclusive_group(required=True)
    action.add_argument("--print", action="store_true", dest="print_ddl",
                        help="print the SQL (connects to nothing, needs no DSN)")
    action.add_argument("--apply", action="store_true",
                        help="create the table and the routine (idempotent)")
    guard.add_argument("--dialect", choices=fence.DIALECTS, default=None,
                       help="default: from the DSN, else from LEASE_BACKEND")
    guard.add_argument("--dsn", default=None, help="the application's database: "
                       "postgresql:// URL or ODBC connection string [LEASE_DSN]")
    guard.add_argument("--schema", default=None, help="schema of the guard's table and "
                       "routine [LEASE_SCHEMA; default lease]")
    guard.add_argument("--odbc-driver", dest="odbc_driver", default=None,
                       help="ODBC driver name when the DSN names none [LEASE_ODBC_DRIVER]")

    status = _command(commands, "status",
                      "show who holds which lease (read-only; exit 3: no such lease)")
    status.add_argument("--json", action="store_true",
                        help="one JSON document instead of the table")

    handover = _command(commands, "handover",
                        "ask the leader on this host or pod to hand its lease over now")
    handover.add_argument("--to", default=None, metavar="IDENTITY",
                          help="the standby that should lead next (default: the first to "
                               "ask)")

    # Its own flags (sidecar.operator.__main__); listed here for --help only.
    commands.add_parser("operator", add_help=False,
                        help="the admission webhook and the lease-role label reconciler "
                             "(one Deployment; needs the operator image)")
    return parser


def _fail(message: str, code: int = EXIT_BAD_SETTINGS) -> int:
    print(f"lease-sidecar: error: {redact(message)}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["operator"]:
        return _operator(given[1:])
    args = _parser().parse_args(given)
    flags = vars(args)
    try:
        if args.command == "fence-schema":
            from sidecar.cli import fence_schema

            return asyncio.run(fence_schema.run(
                flags, apply=args.apply,
                setup_logs=lambda level: jsonlog.setup(_log_level(args.command, level))))
        # schema --print and handover connect to no backend.
        printing = (args.command == "schema" and args.print_ddl) or args.command == "handover"
        settings = config.load(flags, dsn_required=not printing)
        jsonlog.setup(_log_level(args.command, settings.log_level))
        if args.command == "run":
            return asyncio.run(_run(settings))
        if args.command == "exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                raise ConfigError("exec: no command given (lease-sidecar exec -- CMD ARGS...)")
            from sidecar.cli import exec_command, exec_supervise

            unusable = exec_supervise.check_command(cmd[0])
            if unusable is not None:
                code, line = unusable
                return _fail(f"exec: {line}", code=code)
            timeout = _acquire_timeout(args.acquire_timeout)
            return asyncio.run(exec_command.run(settings, cmd, timeout))
        if args.command == "schema":
            return asyncio.run(_schema(settings, apply=args.apply))
        if args.command == "handover":
            from sidecar.cli import handover

            return handover.run(settings, args.to)
        return asyncio.run(_status(settings, as_json=args.json))
    except ConfigError as exc:
        return _fail(str(exc))
    except NotFound as exc:
        return _fail(str(exc), code=EXIT_NO_SUCH_LEASE)
    except BackendError as exc:
        return _fail(str(exc), code=EXIT_FAILED)
    except ValueError as exc:  # a value found unusable where it is used; it names itself
        return _fail(str(exc))


# What ``lease-sidecar operator`` imports that the sidecar's own install lacks (the
# ``injector`` extra): kopf, the kubernetes client, cryptography.
OPERATOR_MODULES = ("kopf", "kubernetes", "cryptography")


def _operator(argv: list[str]) -> int:
    """``lease-sidecar operator``: its flags (and ``--help``) need nothing extra; running it
    needs the ``injector`` extra, whose absence is one line, never a traceback."""
    from sidecar.injector import flags

    flags.operator_parser().parse_args(argv)  # --help and a bad flag end here
    try:
        # Imported only here: kopf and the kubernetes client never load in the sidecar.
        from sidecar.operator.__main__ import main as operator
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in OPERATOR_MODULES:
            raise
        return _fail(f"operator: needs the injector extra (pip install "
                     f"'lease-sidecar[injector]', or the operator image): no module "
                     f"{exc.name!r}")
    return operator(argv)


def _acquire_timeout(text: str | None) -> float | None:
    try:
        return parse_duration(text) if text is not None else None
    except ValueError as exc:
        raise ConfigError(f"--acquire-timeout: {exc}") from None


def _log_level(command: str, level: str) -> str:
    """``status`` and ``schema`` print for people: the sidecar's info lines (connected,
    ...) would only be noise on their stderr, so they log warnings unless asked for
    debug (or told to keep to errors)."""
    if command in ("run", "exec") or level in ("debug", "error"):
        return level
    return "warning"


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


async def _run(settings: Settings) -> int:
    stop = asyncio.Event()
    _stop_on_signals(stop)
    sidecar = Sidecar(settings)
    await sidecar.start()
    stopped = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(sidecar.wait_failed())
    misconfigured = asyncio.ensure_future(sidecar.wait_misconfigured())
    await first_of(stopped, failed, misconfigured)
    crash = failed.exception() if failed.done() else None
    for waiter in (failed, stopped, misconfigured):
        waiter.cancel()
    await sidecar.stop()
    if crash is not None:
        log.error("elector crashed", exc_info=crash)
        return EXIT_FAILED
    if misconfigured.done() and not misconfigured.cancelled():
        # The backend logged the one line naming the problem when it found it.
        return EXIT_BAD_SETTINGS
    log.info("stopped", extra={"identity": settings.identity})
    return 0


async def _schema(settings: Settings, apply: bool) -> int:
    store = settings.store
    entry = backend_entry(store.backend)
    if entry.schema_sql is None or entry.apply_schema is None:
        return _fail(f"LEASE_BACKEND / --backend: {store.backend} has no table to provision")
    if not apply:
        print(entry.schema_sql(settings))
        return 0
    await entry.apply_schema(settings)
    print(f"schema applied ({store.backend}, {store.schema}.{store.table})")
    return 0


async def _status(settings: Settings, as_json: bool) -> int:
    from sidecar.cli import status

    return await status.report(settings, as_json=as_json)
