"""``exec``'s side of process supervision: start the guard, feed it the lease validity.

The command runs under :mod:`sidecar.cli.exec_guard` (see there for the process tree and why).
This module starts the guard, tells it how long the lease is proven ours (``extend``),
asks it to stop the job (``stop``, ``kill``) and reports the command's exit code. If the
guard itself is killed, the supervisor — a child subreaper too — inherits the job's
processes and ends them the same way (:func:`end_tree`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from sidecar.base.errors import EXIT_CANNOT_EXECUTE, EXIT_COMMAND_NOT_FOUND
from sidecar.cli import exec_guard

log = logging.getLogger("sidecar.exec")

GUARD_SCRIPT = Path(exec_guard.__file__).resolve()


def check_command(argv0: str) -> tuple[int, str] | None:
    """``(exit code, one line)`` when ``argv0`` cannot run, as a shell would say it.

    Checked before contending for the lease: a typo must not take the lease and then
    fail; the guard checks again (the file may change in between).
    """
    if "/" not in argv0:
        if shutil.which(argv0) is None:
            return EXIT_COMMAND_NOT_FOUND, f"{argv0}: command not found"
        return None
    if not os.path.exists(argv0):
        return EXIT_COMMAND_NOT_FOUND, f"{argv0}: No such file or directory"
    if os.path.isdir(argv0):
        return EXIT_CANNOT_EXECUTE, f"{argv0}: Is a directory"
    if not os.access(argv0, os.X_OK):
        return EXIT_CANNOT_EXECUTE, f"{argv0}: Permission denied"
    return None


def become_subreaper() -> None:
    if not exec_guard.set_child_subreaper():
        log.warning("cannot become a child subreaper (not Linux?); a job whose guard is "
                    "killed may leave orphans")


class Job:
    """The command under its guard. ``wait()`` gives the command's exit code."""

    def __init__(self, proc: asyncio.subprocess.Process, control: int, grace: float,
                 margin: float) -> None:
        self.proc = proc
        self._control: int | None = control
        self._grace = grace
        self._margin = margin
        self._valid_until = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(cls, cmd: list[str], valid_until: float, grace: float,
                    margin: float, env: dict[str, str] | None = None) -> Job:
        read_end, write_end = os.pipe()  # both non-inheritable (PEP 446)
        try:
            os.set_blocking(write_end, False)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", str(GUARD_SCRIPT), str(read_end), repr(grace),
                repr(margin), repr(valid_until), "--", *cmd,
                pass_fds=(read_end,), start_new_session=True, env=env)
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        job = cls(proc, write_end, grace, margin)
        job._valid_until = valid_until
        return job

    def _send(self, line: str) -> None:
        if self._control is None:
            return
        # A full pipe means a frozen guard: dropping an extension only makes it stop the
        # job earlier. A broken one means it is gone; wait() handles that.
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(self._control, line.encode() + b"\n")

    def extend(self, valid_until: float) -> None:
        """The lease is proven ours until ``valid_until`` (monotonic)."""
        if valid_until > self._valid_until:
            self._valid_until = valid_until
            self._send(f"T {valid_until!r}")

    def stop(self) -> None:
        self._send("S")

    def kill(self) -> None:
        self._send("K")

    async def wait(self) -> int:
        code = await self.proc.wait()
        if code < 0:
            log.error("the command's guard was killed; ending the job from here",
                      extra={"pid": self.pid, "signal": -code})
            code = 128 - code
        # Normally empty; after a killed guard, its orphans were re-parented to us.
        deadline = self._valid_until + self._margin
        await asyncio.to_thread(end_tree, self._grace, deadline)
        return code

    def close(self) -> None:
        if self._control is not None:
            os.close(self._control)
            self._control = None


def end_tree(grace: float, deadline: float) -> None:
    """SIGTERM every live descendant of this process, SIGKILL them after the grace (or
    at ``deadline``, monotonic, if sooner), reaping our own children; return when none
    is left. Blocking: run it in a thread."""
    me = os.getpid()
    termed: set[int] = set()
    kill_at = min(time.monotonic() + grace, deadline)
    while True:
        left = exec_guard.live_descendants(me)
        for pid in _own_children(me):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        if not left:
            return
        now = time.monotonic()
        for pid in left:
            if now >= kill_at:
                exec_guard.send_signal(pid, signal.SIGKILL)
            elif pid not in termed:
                termed.add(pid)
                exec_guard.send_signal(pid, signal.SIGTERM)
        time.sleep(exec_guard.TICK if now >= kill_at else exec_guard.SCAN_INTERVAL)


def _own_children(me: int) -> list[int]:
    """Exited children of ours that nobody else reaps (orphans re-parented to us)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    stat = fh.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2:].split()
            if fields[0] == b"Z" and int(fields[1]) == me:
                found.append(int(entry))
    return found
