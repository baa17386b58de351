"""``lease-sidecar run | exec | schema | status``.

Exit codes: 0 clean stop, 1 the backend failed, 2 bad settings (one line naming the
setting, before anything connects; or, once connected, the ``postgres`` backend
behind a transaction pooler, named in one log line), 3 ``status``: no such lease,
database or table, 75 ``exec --acquire-timeout`` ran out, 126 / 127 ``exec``'s
command is not executable / not found (one line, as shells do), otherwise the
command's own code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import logging
import os
import signal
import sys
from collections.abc import Sequence

from sidecar import cli_status, config, jsonlog, supervise
from sidecar.config import ConfigError, Settings
from sidecar.lease import BackendError, NotFound, backend_module
from sidecar.publish.http import ReleaseOutcome
from sidecar.redact import redact
from sidecar.runtime import Sidecar
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.cli")

EXIT_BAD_SETTINGS = 2
EXIT_NOT_ACQUIRED = 75


def version() -> str:
    """The installed package's version (one source: the package metadata)."""
    try:
        return importlib.metadata.version("lease-sidecar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _command(commands: argparse._SubParsersAction, name: str,
             text: str) -> argparse.ArgumentParser:
    parser = commands.add_parser(name, help=text, description=text)
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

    status = _command(commands, "status",
                      "show who holds which lease (read-only; exit 3: no such lease)")
    status.add_argument("--json", action="store_true",
                        help="one JSON document instead of the table")
    return parser


def _fail(message: str, code: int = EXIT_BAD_SETTINGS) -> int:
    print(f"lease-sidecar: error: {redact(message)}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    flags = vars(args)
    try:
        printing = args.command == "schema" and args.print_ddl
        settings = config.load(flags, dsn_required=not printing)
        jsonlog.setup(_log_level(args.command, settings.log_level))
        if args.command == "run":
            return asyncio.run(_run(settings))
        if args.command == "exec":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                raise ConfigError("exec: no command given (lease-sidecar exec -- CMD ARGS...)")
            unusable = supervise.check_command(cmd[0])
            if unusable is not None:
                code, line = unusable
                return _fail(f"exec: {line}", code=code)
            timeout = (config.parse_duration(args.acquire_timeout)
                       if args.acquire_timeout is not None else None)
            return asyncio.run(_exec(settings, cmd, timeout))
        if args.command == "schema":
            return asyncio.run(_schema(settings, apply=args.apply))
        return asyncio.run(_status(settings, as_json=args.json))
    except ConfigError as exc:
        return _fail(str(exc))
    except NotFound as exc:
        return _fail(str(exc), code=cli_status.EXIT_NOT_FOUND)
    except BackendError as exc:
        return _fail(str(exc), code=1)
    except ValueError as exc:
        return _fail(f"--acquire-timeout: {exc}")


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


async def _start(sidecar: Sidecar) -> None:
    try:
        await sidecar.start()
    except OSError as exc:
        await sidecar.stop()
        raise _start_error(sidecar, exc) from None


def _start_error(sidecar: Sidecar, exc: OSError) -> ConfigError:
    """Name the setting behind a start-up failure: a file error is about the state
    directory (a ``leader`` *directory* in it, say), a socket error about the address."""
    if exc.filename is not None:
        path = os.fsdecode(exc.filename)
        directory = os.fspath(sidecar.state_dir)
        if path == directory or path.startswith(directory.rstrip("/") + "/"):
            return ConfigError(f"LEASE_STATE_DIR / --state-dir: {path}: "
                               f"{exc.strerror or exc}")
        return ConfigError(f"cannot start: {path}: {exc.strerror or exc}")
    host, port = sidecar.settings.http_addr
    return ConfigError(f"LEASE_HTTP_ADDR / --http-addr: cannot listen on {host}:{port}: "
                       f"{exc.strerror or exc}")


async def _run(settings: Settings) -> int:
    stop = asyncio.Event()
    _stop_on_signals(stop)
    sidecar = Sidecar(settings)
    await _start(sidecar)
    stopped = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(sidecar.wait_failed())
    misconfigured = asyncio.ensure_future(sidecar.wait_misconfigured())
    await asyncio.wait([stopped, failed, misconfigured], return_when=asyncio.FIRST_COMPLETED)
    crash = failed.exception() if failed.done() else None
    for waiter in (failed, stopped, misconfigured):
        waiter.cancel()
    await sidecar.stop()
    if crash is not None:
        log.error("elector crashed", exc_info=crash)
        return 1
    if misconfigured.done() and not misconfigured.cancelled():
        # The backend logged the one line naming the problem when it found it.
        return EXIT_BAD_SETTINGS
    log.info("stopped", extra={"identity": settings.identity})
    return 0


# Signals whose default action would end the supervisor: each stops the job first
# (SIGKILL cannot be caught; the guard handles that case).
EXEC_STOP_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM",
    "SIGPROF", "SIGXCPU", "SIGXFSZ", "SIGPWR", "SIGIO") if hasattr(signal, name))


class _ExecSidecar(Sidecar):
    """``POST /release`` under ``exec`` ends the command first, then releases the lease:
    the work stops while the lease is still ours, never after another holder started."""

    def __init__(self, settings: Settings) -> None:
        self.release_requested = asyncio.Event()
        self.job_running = False
        super().__init__(settings)

    def release(self, name: str | None) -> ReleaseOutcome:
        if self.job_running and (name or self.settings.name) == self.settings.name:
            self.release_requested.set()
            return "released"
        return super().release(name)


def _job_env(sidecar: Sidecar, state: LeaseState) -> dict[str, str]:
    """What the command learns of its lease, as ``consul lock`` sets ``CONSUL_LOCK_HELD``.

    The token and the first claim's expiry are a snapshot at start; the token stays right
    for the command's whole life (exec ends the command when the term ends, and a term
    keeps its token). The expiry does not: a command that must honour the live
    ``valid_until`` reads ``LEASE_LEADER_FILE`` or ``LEASE_LEADER_URL``.
    """
    body = state.body(state.claim())
    host, _ = sidecar.settings.http_addr
    port = sidecar.http.bound_port if sidecar.http else sidecar.settings.http_addr[1]
    url_host = f"[{host}]" if ":" in host else host
    return {
        **os.environ,
        "LEASE_HELD": "1",
        "LEASE_NAME": state.lease,
        "LEASE_FENCING_TOKEN": str(body["fencing_token"]),
        "LEASE_VALID_UNTIL": str(body["valid_until"]),
        "LEASE_VALID_UNTIL_MS": str(body["valid_until_ms"]),
        "LEASE_LEADER_FILE": str(sidecar.state_dir / "leader"),
        "LEASE_LEADER_URL": f"http://{url_host}:{port}/leader/{state.lease}",
    }


async def _exec(settings: Settings, cmd: list[str], acquire_timeout: float | None) -> int:
    """Start ``cmd`` once we lead; stop it (and all it started) when we stop leading;
    mirror its exit code."""
    supervise.become_subreaper()
    stop = asyncio.Event()
    kill = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        # A second signal (an impatient Ctrl-C) skips the grace.
        (kill if stop.is_set() else stop).set()

    for sig in EXEC_STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    sidecar = _ExecSidecar(settings)
    await _start(sidecar)
    state = sidecar.states[0]
    deadline = loop.time() + acquire_timeout if acquire_timeout is not None else None
    job: supervise.Job | None = None
    # A backend that finds itself misconfigured stops the command like a signal, but
    # the exit code is 2 (the backend logged why).
    misconfigured = asyncio.ensure_future(sidecar.wait_misconfigured())
    misconfigured.add_done_callback(lambda _: stop.set())
    try:
        while not state.claim().leader:
            if misconfigured.done():
                return EXIT_BAD_SETTINGS
            if stop.is_set():
                return 0
            if deadline is not None and loop.time() >= deadline:
                log.warning("lease not acquired in time", extra={"lease": state.lease})
                return EXIT_NOT_ACQUIRED
            await _wait_any(state.wait_for_change(state.facts.version, 0.05), stop.wait())
        job = await supervise.Job.start(cmd, state.facts.valid_until, settings.exec_grace,
                                        settings.safety_margin, _job_env(sidecar, state))
        sidecar.job_running = True
        log.info("started command", extra={"lease": state.lease, "pid": job.pid,
                                           "fencing_token": state.facts.fencing_token})
        exited = asyncio.ensure_future(job.wait())
        stopping: str | None = None
        # Poll the claim at a fraction of the horizon: a claim can lapse with no state
        # change at all (a renew that hangs until the validity runs out).
        while not exited.done():
            leading = state.claim().leader
            if leading:
                # Also while stopping on request: the lease is still ours, so the
                # command gets its whole grace.
                job.extend(state.facts.valid_until)
            reason = ("signal" if stop.is_set() else
                      "release requested" if sidecar.release_requested.is_set() else
                      None if leading else "lease lost")
            if reason and stopping is None:
                stopping = reason
                log.warning("stopping command", extra={"pid": job.pid, "reason": reason})
                job.stop()
            if kill.is_set():
                job.kill()
            await _wait_any(exited, stop.wait(), kill.wait(), sidecar.release_requested.wait(),
                            state.wait_for_change(state.facts.version,
                                                  settings.claim_horizon / 2))
        code = await exited
        return EXIT_BAD_SETTINGS if misconfigured.done() else code
    finally:
        misconfigured.cancel()
        if job is not None:
            job.close()
        # Only now, with the command and everything it started gone, is the lease released.
        await sidecar.stop()


async def _wait_any(*waitables) -> None:  # type: ignore[no-untyped-def]
    """Wait for the first to finish; cancel the helpers we made, never a shared future."""
    ours = [asyncio.ensure_future(w) for w in waitables if not asyncio.isfuture(w)]
    shared = [w for w in waitables if asyncio.isfuture(w)]
    try:
        await asyncio.wait(ours + shared, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in ours:
            task.cancel()


async def _schema(settings: Settings, apply: bool) -> int:
    module = backend_module(settings.backend)
    if not hasattr(module, "schema_sql"):
        return _fail(f"LEASE_BACKEND / --backend: {settings.backend} has no table to provision")
    if not apply:
        print(module.schema_sql(settings))
        return 0
    await module.apply_schema(settings)
    print(f"schema applied ({settings.backend}, {settings.schema}.{settings.table_name})")
    return 0


async def _status(settings: Settings, as_json: bool) -> int:
    return await cli_status.report(settings, as_json=as_json)
