"""Child processes of the test bed: free ports, logs, start-up and shutdown.

:class:`Processes` is what ``ControlPlane`` (etcd, kube-apiserver) and ``Cluster``
(containerd, the kubelet, controller manager and scheduler) have in common: named
children, each logging to ``<logdir>/<name>.log``, checked while they start and stopped
newest first. :class:`Service` gives a ``start``/``stop`` pair its ``with`` block.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Self

PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it). Another process may take
    it before the caller binds, so servers started on it retry on "address in use"."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """preexec_fn: SIGKILL the child when the process that started it dies (no orphaned
    etcd or kubelet after a killed test run).

    Linux sends it when the spawning *thread* exits, so a child started from a worker
    thread that ends before it must be spawned without it.
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


class Processes:
    """Named child processes, each logging to ``<logdir>/<name>.log``."""

    def __init__(self, logdir: Path, *, stop_timeout: float, append_logs: bool = False,
                 new_session: bool = False) -> None:
        self.logdir = logdir
        self.stop_timeout = stop_timeout
        self.append_logs = append_logs
        # A session of their own: a terminal's Ctrl-C then reaches only pytest.
        self.new_session = new_session
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def __iter__(self) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
        return iter(list(self._procs))

    def log_path(self, name: str) -> Path:
        return self.logdir / f"{name}.log"

    def spawn(self, name: str, args: list[str], *, append: bool | None = None,
              tie_to_parent: bool = True) -> subprocess.Popen[bytes]:
        """Start ``args`` in ``logdir`` with stdout and stderr going to its log, appended
        to or truncated (``append``, default ``append_logs``). ``tie_to_parent`` kills it
        with this process (see :func:`die_with_parent` for when not to)."""
        append = self.append_logs if append is None else append
        with self.log_path(name).open("ab" if append else "wb") as fh:
            proc = subprocess.Popen(
                args,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.logdir,
                start_new_session=self.new_session,
                preexec_fn=die_with_parent if tie_to_parent else None,
            )
        self._procs.append((name, proc))
        return proc

    def stop(self, name: str, *, kill: bool = False) -> None:
        """Stop every process called ``name`` (SIGKILL at once with ``kill``)."""
        for entry in [e for e in self._procs if e[0] == name]:
            proc = entry[1]
            if kill:
                proc.kill()
                proc.wait(timeout=10)
            else:
                terminate(proc, self.stop_timeout)
            self._procs.remove(entry)

    def stop_last(self) -> None:
        """Stop the newest process (one that lost the race for its port)."""
        _, proc = self._procs.pop()
        terminate(proc, self.stop_timeout)

    def stop_all(self) -> None:
        """Stop every process, newest first."""
        for _, proc in reversed(self._procs):
            terminate(proc, self.stop_timeout)
        self._procs.clear()

    def exited(self, lines: int = 40) -> str | None:
        """"<name> exited with <code>" and its log's tail, for the first one that has
        exited; None while all run."""
        for name, proc in self._procs:
            if proc.poll() is not None:
                return f"{name} exited with {proc.returncode}:\n{tail(self.log_path(name), lines)}"
        return None


class Service:
    """``with`` for a test-bed server: ``start()`` on entry, ``stop()`` on exit."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
