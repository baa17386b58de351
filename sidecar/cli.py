"""``lease-sidecar run | exec | schema | status``.

Exit codes: 0 clean stop, 2 bad settings (one line naming the setting, before anything
connects), 75 ``exec --acquire-timeout`` ran out, 126 / 127 ``exec``'s command is not
executable / not found (one line, as shells do), otherwise the command's own code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

from sidecar import config, jsonlog, supervise
from sidecar.config import ConfigError, Settings
from sidecar.lease import BackendError, backend_module, create_backend
from sidecar.publish.http import ReleaseOutcome
from sidecar.redact import redact
from sidecar.runtime import Sidecar

log = logging.getLogger("sidecar.cli")

EXIT_BAD_SETTINGS = 2
EXIT_NOT_ACQUIRED = 75


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lease-sidecar",
        description="Hold a distributed lease and tell the application whether it leads.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="hold the lease and publish it (HTTP, file, label)")
    config.add_arguments(run)

    exe = commands.add_parser("exec", help="run a command only while holding the lease")
    config.add_arguments(exe)
    exe.add_argument("--acquire-timeout", default=None,
                     help="give up (exit 75) if the lease is not ours within this duration")
    exe.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and arguments")

    schema = commands.add_parser("schema", help="print or apply the row-lease table DDL")
    config.add_arguments(schema)
    action = schema.add_mutually_exclusive_group(required=True)
    action.add_argument("--print", action="store_true", dest="print_ddl")
    action.add_argument("--apply", action="store_true")

    status = commands.add_parser("status", help="list who holds which lease")
    config.add_arguments(status)
    return parser


def _fail(message: str, code: int = EXIT_BAD_SETTINGS) -> int:
    print(f"lease-sidecar: error: {redact(message)}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    flags = vars(args)
    try:
        settings = config.load(flags)
        jsonlog.setup(settings.log_level)
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
        return asyncio.run(_status(settings))
    except ConfigError as exc:
        return _fail(str(exc))
    except BackendError as exc:
        return _fail(str(exc), code=1)
    except ValueError as exc:
        return _fail(f"--acquire-timeout: {exc}")


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
    await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
    crash = failed.exception() if failed.done() else None
    failed.cancel()
    stopped.cancel()
    await sidecar.stop()
    if crash is not None:
        log.error("elector crashed", exc_info=crash)
        return 1
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
    try:
        while not state.claim().leader:
            if stop.is_set():
                return 0
            if deadline is not None and loop.time() >= deadline:
                log.warning("lease not acquired in time", extra={"lease": state.lease})
                return EXIT_NOT_ACQUIRED
            await _wait_any(state.wait_for_change(state.facts.version, 0.05), stop.wait())
        job = await supervise.Job.start(cmd, state.facts.valid_until, settings.exec_grace,
                                        settings.safety_margin)
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
        return await exited
    finally:
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


async def _status(settings: Settings) -> int:
    module = backend_module(settings.backend)
    if hasattr(module, "list_holders"):
        rows = await module.list_holders(settings)
    else:
        backend = create_backend(settings)
        rows = []
        try:
            for name in settings.names:
                held = await backend.lease(name).describe()
                rows.append({"lease": name, "holder": held.holder,
                             "fencing_token": held.fencing_token,
                             "expires_at": held.expires_at.isoformat() if held.expires_at
                             else None})
        finally:
            await backend.close()
    for row in rows:
        print(json.dumps(row, default=str))
    return 0
