"""The guard: a tiny process between ``lease-sidecar exec`` and the command it runs.

``exec`` must never leave work running that nobody holds the lease for, even when the
supervisor itself is killed (SIGKILL cannot be caught) or frozen. So the command does
not run under the supervisor directly but under this guard, in a session of its own::

    lease-sidecar exec (subreaper)
      └─ guard (new session, child subreaper)       <- this file
           └─ CMD (its own process group)
                └─ whatever CMD starts (``sh -c 'worker & worker'``, double forks...)

The guard ends the whole tree — SIGTERM, then SIGKILL after the grace — when

- the supervisor says so over the control pipe (lease lost, a signal, ``POST /release``),
- the control pipe reaches end-of-file: the supervisor died, however it died (the kernel
  closes a dead process's descriptors, and only the supervisor holds the write end),
- the lease validity the supervisor last reported passes without an extension (the
  supervisor is frozen, or lost the lease without being able to say so),
- the command itself exits (what it left running is part of the job).

SIGKILL comes at ``stop + grace``, but never later than ``valid_until + safety margin``:
by this host's clock the lease cannot run out for another contender before that instant,
and that contender waits one claim horizon more before it publishes (``exec`` starts its
command only then), so the SIGKILL lands before any other holder's command can start. A
release, which can pass the lease sooner (and spare the next holder its horizon), waits
for the job to exit while the supervisor lives (``work_stopped`` in
:mod:`sidecar.cli.exec_command`).

Both the guard and the supervisor are *child subreapers* (``prctl``): a descendant
whose parent dies is re-parented to the nearest one instead of PID 1, so "no children
left" means "no descendants left", which is how the guard knows the job is really gone.

Why a separate interpreter and not ``fork()``: the supervisor is a multi-threaded asyncio
process, where forking and running Python in the child can deadlock on locks held by
other threads. The guard is started as ``python -I -S exec_guard.py`` (stdlib only, no site
packages, ignores ``PYTHON*`` variables): about 20 ms, once per ``exec``.

Control protocol (supervisor → guard, one ASCII line each): ``T <monotonic>`` the lease
validity now ends at that ``CLOCK_MONOTONIC`` instant (shared by all processes on the
host); ``S`` stop the job (grace applies); ``K`` kill it now.

Exit status: the command's (``128 + N`` if a signal N ended it); 127 / 126 with one line
on stderr when it cannot be started (not found / not executable), as shells do.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import signal
import sys
import time
from collections.abc import Callable

PR_SET_CHILD_SUBREAPER = 36

# Signals that make the guard stop the job (as the supervisor's death would).
STOP_SIGNALS = tuple(getattr(signal, name) for name in (
    "SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGPWR")
    if hasattr(signal, name))

# sidecar.base.errors.EXIT_CANNOT_EXECUTE / EXIT_COMMAND_NOT_FOUND: this file runs as a
# stdlib-only script (python -I -S) and cannot import them; a unit test holds them equal.
EXIT_CANNOT_EXECUTE = 126
EXIT_COMMAND_NOT_FOUND = 127
TICK = 0.02  # how often SIGKILL is repeated until the tree is gone
# How often the tree is re-scanned for descendants outside the group during the grace (a
# full /proc scan; exits of our children wake us at once through SIGCHLD anyway).
SCAN_INTERVAL = 0.1


def set_child_subreaper() -> bool:
    """``prctl(PR_SET_CHILD_SUBREAPER, 1)`` via ctypes (Linux only; False elsewhere).

    Hand-written because the standard library has no ``prctl`` and the one call does not
    justify a dependency (python-prctl needs a C compiler and libcap headers).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        status: int = libc.prctl(PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1), ctypes.c_ulong(0),
                                 ctypes.c_ulong(0), ctypes.c_ulong(0))
        return status == 0
    except (OSError, AttributeError):
        return False


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, process group) of every live (non-zombie) process."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue  # exited while we looked
        # The command name may hold spaces and parentheses; fields resume after the last ')'.
        fields = stat[stat.rfind(b")") + 2:].split()
        if fields and fields[0] != b"Z":
            table[int(entry)] = (int(fields[1]), int(fields[2]))
    return table


def live_descendants(root: int) -> dict[int, int]:
    """pid -> process group of every live descendant of ``root``."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = table[child][1]
                todo.append(child)
    return found


def send_signal(pid: int, sig: int, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(pid, sig)


def reap_children(on_reaped: Callable[[int, int], None]) -> bool:
    """Reap every exited child; False once we have no children at all."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        on_reaped(pid, status)


def log(level: str, msg: str, **fields: object) -> None:
    """One JSON line on stderr, in the shape of the sidecar's own log lines."""
    import json

    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    print(json.dumps({"ts": stamp, "level": level, "logger": "sidecar.cli.exec_guard", "msg": msg,
                      **fields}), file=sys.stderr, flush=True)


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class Guard:
    def __init__(self, control: int, grace: float, margin: float, valid_until: float,
                 cmd: list[str]) -> None:
        self.control: int | None = control
        self.grace = grace
        self.margin = margin
        self.valid_until = valid_until
        self.cmd = cmd
        self.worker: int | None = None
        self.status: int | None = None  # the command's exit code, once reaped
        self.stop_at: float | None = None
        self.kill_now = False
        self.killing = False
        self._next_scan = 0.0
        self.termed: set[int] = set()
        self._buffer = b""

    # -- setup ---------------------------------------------------------------------------
    def start(self) -> int | None:
        """Start the command; an exit code if it cannot be started."""
        set_child_subreaper()
        self._wake_r, wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        # Python-level handlers (not SIG_IGN): the byte lands on the wake-up pipe, and the
        # command gets default dispositions back on exec.
        for sig in (*STOP_SIGNALS, signal.SIGCHLD):
            signal.signal(sig, lambda *_: None)
        assert self.control is not None
        os.set_inheritable(self.control, False)  # the command must not keep it open
        try:
            # Its own process group, so a group signal reaches the job and not the guard.
            # posix_spawn, not subprocess: same exec-error reporting, a third of the
            # start-up time (subprocess's imports), and nothing else is inheritable.
            self.worker = os.posix_spawnp(self.cmd[0], self.cmd, os.environ, setpgroup=0)
        except OSError as exc:
            code = EXIT_COMMAND_NOT_FOUND if exc.errno == errno.ENOENT else EXIT_CANNOT_EXECUTE
            reason = exc.strerror or str(exc)
            if code == EXIT_COMMAND_NOT_FOUND and "/" not in self.cmd[0]:
                reason = "command not found"  # as shells word it for a PATH lookup
            print(f"lease-sidecar: exec: {self.cmd[0]}: {reason}", file=sys.stderr)
            return code
        return None

    # -- events --------------------------------------------------------------------------
    def _begin_stop(self, why: str | None = None) -> None:
        if self.stop_at is None:
            if why:  # the guard's own decision (else exec asked and logged it)
                log("warning", f"stopping the command: {why}", pid=self.worker)
            self.stop_at = time.monotonic()
            assert self.worker is not None
            # One signal to the whole group at once (no race with a forking member);
            # the members are then marked so that none gets a second SIGTERM.
            send_signal(self.worker, signal.SIGTERM, group=True)
            self.termed.update(pid for pid, group in live_descendants(os.getpid()).items()
                               if group == self.worker)

    def _read_control(self) -> bool:
        """Act on what the supervisor wrote; False once it is gone (the pipe closed)."""
        assert self.control is not None
        try:
            data = os.read(self.control, 4096)
        except BlockingIOError:
            return True
        if not data:  # the supervisor is gone
            os.close(self.control)
            self.control = None
            self._begin_stop("lease-sidecar exec is gone")
            return False
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            word, _, arg = line.decode("ascii", "replace").partition(" ")
            if word == "T":
                self.valid_until = max(self.valid_until, float(arg))
            elif word == "S":
                self._begin_stop()
            elif word == "K":
                self._begin_stop()
                self.kill_now = True
        return True

    def _read_wakeups(self) -> None:
        try:
            data = os.read(self._wake_r, 4096)
        except BlockingIOError:
            return
        if any(sig in STOP_SIGNALS for sig in data):
            self._begin_stop("the guard got a signal")

    def _reaped(self, pid: int, status: int) -> None:
        if pid == self.worker:
            self.status = exit_code(status)
            self._begin_stop()  # what the command left behind goes with it

    def kill_deadline(self) -> float:
        assert self.stop_at is not None
        if self.kill_now:
            return self.stop_at
        return min(self.stop_at + self.grace, self.valid_until + self.margin)

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> int:
        poller = select.poll()
        assert self.control is not None
        poller.register(self.control, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            if not reap_children(self._reaped) and self.stop_at is not None:
                break  # no children: with a subreaper, no descendants either
            now = time.monotonic()
            if self.stop_at is None and now >= self.valid_until:
                self._begin_stop("the lease validity passed with no word from exec")
            if self.stop_at is not None:
                self._signal_tree(now)
                timeout = TICK if self.killing else min(
                    SCAN_INTERVAL, max(self.kill_deadline() - now, 0.0))
            else:
                timeout = min(max(self.valid_until - now, 0.0), 3600.0)
            for fd, _ in poller.poll(timeout * 1000 + 1):
                if fd == self.control:
                    if not self._read_control():
                        poller.unregister(fd)
                elif fd == self._wake_r:
                    self._read_wakeups()
        return self.status if self.status is not None else 128 + signal.SIGKILL

    def _signal_tree(self, now: float) -> None:
        assert self.worker is not None
        if now >= self.kill_deadline():
            if not self.killing:
                self.killing = True
                log("warning", "the job did not end in time; SIGKILL", pid=self.worker)
            send_signal(self.worker, signal.SIGKILL, group=True)
            for pid in live_descendants(os.getpid()):
                send_signal(pid, signal.SIGKILL)
            return
        if now < self._next_scan:
            return
        self._next_scan = now + SCAN_INTERVAL
        # Descendants outside the group (setsid, double fork) get SIGTERM too, once.
        for pid in set(live_descendants(os.getpid())) - self.termed:
            self.termed.add(pid)
            send_signal(pid, signal.SIGTERM)


def main(argv: list[str]) -> int:
    control, grace, margin, valid_until, sep, *cmd = argv
    if sep != "--" or not cmd:
        print("usage: exec_guard.py CONTROL_FD GRACE MARGIN VALID_UNTIL -- CMD...", file=sys.stderr)
        return 2
    os.set_blocking(int(control), False)
    guard = Guard(int(control), float(grace), float(margin), float(valid_until), cmd)
    failed = guard.start()
    return failed if failed is not None else guard.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
