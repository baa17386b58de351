"""``lease-sidecar exec -- cmd``: run a command only while this contender leads.

The command runs under a guard in its own session (:mod:`sidecar.cli.exec_supervise`); losing the
lease, ``POST /release`` or a terminating signal end it and everything it started, and
only then is the lease released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

from sidecar.base.clock import first_of
from sidecar.base.errors import EXIT_BAD_SETTINGS, EXIT_NOT_ACQUIRED
from sidecar.cli import exec_supervise
from sidecar.publish import claim_body
from sidecar.runtime import Sidecar
from sidecar.settings import Settings
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.cli")



# Signals whose default action would end the supervisor: each stops the job first
# (SIGKILL cannot be caught; the guard handles that case).
EXEC_STOP_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGVTALRM",
    "SIGPROF", "SIGXCPU", "SIGXFSZ", "SIGPWR", "SIGIO") if hasattr(signal, name))


class _JobRelease:
    """``POST /release`` under ``exec`` ends the command first, then releases the lease:
    the work stops while the lease is still ours, never after another holder started."""

    def __init__(self, lease: str) -> None:
        self.lease = lease
        self.requested = asyncio.Event()
        self.job_running = False

    def __call__(self, lease: str) -> bool:
        if self.job_running and lease == self.lease:
            self.requested.set()
            return True
        return False


def _job_env(sidecar: Sidecar, state: LeaseState) -> dict[str, str]:
    """What the command learns of its lease, as ``consul lock`` sets ``CONSUL_LOCK_HELD``.

    The token and the first claim's expiry are a snapshot at start; the token stays right
    for the command's whole life (exec ends the command when the term ends, and a term
    keeps its token). The expiry does not: a command that must honour the live
    ``valid_until`` reads ``LEASE_LEADER_FILE`` or ``LEASE_LEADER_URL``.
    """
    body = claim_body(state, state.claim())
    host, _ = sidecar.settings.http_addr
    port = sidecar.http.bound_port
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


async def run(settings: Settings, cmd: list[str], acquire_timeout: float | None) -> int:
    """Start ``cmd`` once we lead; stop it (and all it started) when we stop leading;
    mirror its exit code."""
    exec_supervise.become_subreaper()
    stop = asyncio.Event()
    kill = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        # A second signal (an impatient Ctrl-C) skips the grace.
        (kill if stop.is_set() else stop).set()

    for sig in EXEC_STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    release = _JobRelease(settings.name)
    # Set while no command runs. A release waits for it: the command may outlive the
    # last claim by its grace, and a release tells the next holder the work is over.
    no_job = asyncio.Event()
    no_job.set()

    async def job_stopped(lease: str) -> None:
        await no_job.wait()

    sidecar = Sidecar(settings, takes_release=release, work_stopped=job_stopped)
    await sidecar.start()
    state = sidecar.states[0]
    deadline = loop.time() + acquire_timeout if acquire_timeout is not None else None
    job: exec_supervise.Job | None = None
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
            await first_of(state.wait_for_change(state.facts.version, 0.05), stop.wait())
        no_job.clear()
        try:
            job = await exec_supervise.Job.start(
                cmd, state.facts.valid_until, settings.exec_grace,
                settings.timing.safety_margin, _job_env(sidecar, state))
        except BaseException:
            no_job.set()
            raise
        release.job_running = True
        log.info("started command", extra={"lease": state.lease, "pid": job.pid,
                                           "fencing_token": state.facts.fencing_token})
        exited = asyncio.ensure_future(job.wait())
        exited.add_done_callback(lambda _: no_job.set())
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
                      "release requested" if release.requested.is_set() else
                      None if leading else "lease lost")
            if reason and stopping is None:
                stopping = reason
                log.warning("stopping command", extra={"pid": job.pid, "reason": reason})
                job.stop()
            if kill.is_set():
                job.kill()
            await first_of(exited, stop.wait(), kill.wait(), release.requested.wait(),
                            state.wait_for_change(state.facts.version,
                                                  settings.timing.claim_horizon / 2))
        code = await exited
        return EXIT_BAD_SETTINGS if misconfigured.done() else code
    finally:
        misconfigured.cancel()
        if job is not None:
            job.close()
        # Only now, with the command and everything it started gone, is the lease released.
        await sidecar.stop()
