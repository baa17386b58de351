"""``lease-sidecar run | exec | schema | status``.

Exit codes: 0 clean stop, 2 bad settings (one line naming the setting, before anything
connects; or, once connected, the ``postgres`` backend behind a transaction pooler, named
in one log line), 75 ``exec --acquire-timeout`` ran out, otherwise the command's own code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import Sequence

from sidecar import config, jsonlog
from sidecar.config import ConfigError, Settings
from sidecar.lease import BackendError, backend_module, create_backend
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
    print(f"lease-sidecar: error: {message}", file=sys.stderr)
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
        host, port = sidecar.settings.http_addr
        await sidecar.stop()
        raise ConfigError(f"LEASE_HTTP_ADDR / --http-addr: cannot listen on {host}:{port}: "
                          f"{exc.strerror or exc}") from None


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


async def _exec(settings: Settings, cmd: list[str], acquire_timeout: float | None) -> int:
    """Start ``cmd`` once we lead; stop it when we stop leading; mirror its exit code."""
    stop = asyncio.Event()
    _stop_on_signals(stop)
    sidecar = Sidecar(settings)
    await _start(sidecar)
    state = sidecar.states[0]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + acquire_timeout if acquire_timeout is not None else None
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
        child = await asyncio.create_subprocess_exec(*cmd)
        log.info("started command", extra={"lease": state.lease, "pid": child.pid,
                                           "fencing_token": state.facts.fencing_token})
        exited = asyncio.ensure_future(child.wait())
        # Poll the claim at a fraction of the horizon: a claim can lapse with no state
        # change at all (a renew that hangs until the validity runs out).
        while not exited.done():
            if stop.is_set() or not state.claim().leader:
                reason = "signal" if stop.is_set() else "lease lost"
                await _terminate(child, exited, settings.exec_grace, reason)
                break
            await _wait_any(exited, stop.wait(),
                            state.wait_for_change(state.facts.version,
                                                  settings.claim_horizon / 2))
        code = await exited
        if misconfigured.done():
            return EXIT_BAD_SETTINGS
        return 128 - code if code < 0 else code
    finally:
        misconfigured.cancel()
        await sidecar.stop()


async def _terminate(child: asyncio.subprocess.Process, exited: asyncio.Future[int],
                     grace: float, reason: str) -> None:
    log.warning("stopping command", extra={"pid": child.pid, "reason": reason})
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(grace):
            await asyncio.shield(exited)
    except TimeoutError:
        log.warning("command ignored SIGTERM; killing it", extra={"pid": child.pid})
        with contextlib.suppress(ProcessLookupError):
            child.kill()


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
