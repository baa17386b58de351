"""A real PgBouncer in front of the PostgreSQL test bed, for pooler tests.

``PgBouncer`` writes a config into a temp dir and runs Debian's ``pgbouncer`` binary in the
foreground on a free 127.0.0.1 port::

    with PgBouncer(pg, pool_mode="transaction", pool_size=1) as bouncer:
        bouncer.dsn_for("mydb")     # postgresql://lease:<password>@127.0.0.1:<port>/mydb
        bouncer.admin("show pools") # the admin console, as the test role

Every database of the server is reachable through it (a ``*`` fallback entry), with the
test role's password (SCRAM, as the server asks). PgBouncer refuses to run as root, so as
root it runs as the ``postgres`` OS user (the one the server runs as).

The binary comes from Debian's ``pgbouncer`` package (``scripts/test`` installs it);
:func:`find_binary` fails clearly when it is missing instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from testkit.procs import free_port
from testkit.testbed.postgres import HOST, TEST_ROLE, PgError, PgServer

CANDIDATES = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer")


class PgBouncerError(RuntimeError):
    """The pooler could not be found, started or queried."""


def find_binary() -> str:
    found = shutil.which("pgbouncer") or next(
        (path for path in CANDIDATES if os.access(path, os.X_OK)), None)
    if not found:
        raise PgBouncerError("pgbouncer not found: install Debian's `pgbouncer` package "
                             "(scripts/test does)")
    return found


def version(binary: str | None = None) -> str:
    """``1.18.0`` (the first line of ``pgbouncer --version``)."""
    out = subprocess.run([binary or find_binary(), "--version"], capture_output=True,
                         text=True, timeout=10).stdout
    return out.split()[1] if out.startswith("PgBouncer ") else out.strip()


class PgBouncer:
    """One pgbouncer process with its own config, log and port."""

    def __init__(self, server: PgServer, pool_mode: str = "transaction", pool_size: int = 1,
                 extra: dict[str, str] | None = None) -> None:
        if pool_mode not in ("session", "transaction", "statement"):
            raise ValueError(f"pool_mode {pool_mode!r}")
        self.server = server
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.extra = extra or {}
        self.binary = find_binary()
        self.root = Path(tempfile.mkdtemp(prefix="lease-pgbouncer-"))
        self.config = self.root / "pgbouncer.ini"
        self.logfile = self.root / "pgbouncer.log"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    # -- addresses -----------------------------------------------------------------------
    def dsn_for(self, dbname: str) -> str:
        return (f"postgresql://{TEST_ROLE}:{self.server.password}@{HOST}:{self.port}/"
                f"{dbname}")

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 20.0) -> PgBouncer:
        for attempt in range(3):
            self._write_config()
            self._spawn()
            try:
                self._wait_listening(timeout)
                return self
            except PgBouncerError:
                log = self.log_text()
                self._kill()
                # Someone took our free port between picking it and binding: pick again.
                if attempt < 2 and "Address already in use" in log:
                    self.port = free_port()
                    continue
                raise
        raise AssertionError("unreachable")

    def stop(self, timeout: float = 10.0) -> None:
        """Immediate shutdown (SIGTERM in PgBouncer 1.18: close every connection)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.destroy()

    # -- inspection ----------------------------------------------------------------------
    def admin(self, command: str) -> list[dict[str, str]]:
        """Run a ``SHOW …`` on the admin console; rows as dicts of text."""
        out = self._psql("pgbouncer", command, header=True)
        lines = [line for line in out.splitlines() if line]
        if not lines:
            return []
        head = lines[0].split("|")
        return [dict(zip(head, line.split("|"), strict=False)) for line in lines[1:]]

    def psql(self, dbname: str, sql: str) -> str:
        """Run SQL through the pooler as the test role (unaligned, tuples only)."""
        return self._psql(dbname, sql)

    def log_text(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    # -- helpers -------------------------------------------------------------------------
    def _write_config(self) -> None:
        settings = {
            "listen_addr": HOST,
            "listen_port": str(self.port),
            "unix_socket_dir": "",
            "auth_type": "scram-sha-256",
            "auth_file": str(self.root / "userlist.txt"),
            "admin_users": TEST_ROLE,
            "pool_mode": self.pool_mode,
            "default_pool_size": str(self.pool_size),
            "min_pool_size": "0",
            "reserve_pool_size": "0",
            "max_client_conn": "200",
            # The defaults, spelled out because the tests depend on them: a client that
            # goes away in session mode has its server session reset (advisory locks
            # included); in transaction mode nothing is reset.
            "server_reset_query": "DISCARD ALL",
            "server_reset_query_always": "0",
            "ignore_startup_parameters": "extra_float_digits",
            # A client waiting for a server gives up after this (the default is 120 s,
            # longer than any test should hang).
            "query_wait_timeout": "15",
            "pidfile": str(self.root / "pgbouncer.pid"),
            **self.extra,
        }
        body = "[databases]\n" f"* = host={HOST} port={self.server.port}\n\n[pgbouncer]\n"
        body += "".join(f"{key} = {value}\n" for key, value in settings.items())
        self.config.write_text(body)
        # A plain-text password lets PgBouncer answer the client's SCRAM exchange and
        # run its own against the server.
        (self.root / "userlist.txt").write_text(
            f'"{TEST_ROLE}" "{self.server.password}"\n')
        user = self.server.os_user
        if user is not None:
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, user.pw_uid, user.pw_gid)
            os.chmod(self.root / "userlist.txt", 0o600)

    def _spawn(self) -> None:
        user = self.server.os_user
        with open(self.logfile, "ab") as log:
            self.proc = subprocess.Popen(
                [self.binary, str(self.config)], stdout=log, stderr=log, cwd=self.root,
                stdin=subprocess.DEVNULL, start_new_session=True,
                user=user.pw_uid if user else None, group=user.pw_gid if user else None,
                extra_groups=[] if user else None)

    def _wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise PgBouncerError(f"pgbouncer exited with {self.proc.returncode}:\n"
                                     f"{self.log_text()[-2000:]}")
            try:
                with socket.create_connection((HOST, self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise PgBouncerError(f"pgbouncer did not listen on {HOST}:{self.port} within "
                             f"{timeout}s:\n{self.log_text()[-2000:]}")

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _psql(self, dbname: str, sql: str, header: bool = False) -> str:
        cmd = [str(self.server.bindir / "psql"), "-X", "-q", "-A", "-v", "ON_ERROR_STOP=1",
               "-h", HOST, "-p", str(self.port), "-U", TEST_ROLE, "-d", dbname, "-c", sql]
        if not header:
            cmd.insert(4, "-t")
        env = {**os.environ, "PGPASSWORD": self.server.password, "PGCONNECT_TIMEOUT": "5"}
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
        except subprocess.TimeoutExpired as exc:
            raise PgBouncerError(f"psql through pgbouncer timed out: {sql}") from exc
        if result.returncode != 0:
            raise PgBouncerError(f"psql through pgbouncer failed: {result.stderr.strip()}")
        out = result.stdout.strip()
        if header:
            # The last line is the row count footer ("(1 row)").
            out = "\n".join(line for line in out.splitlines()
                            if not (line.startswith("(") and line.endswith(")")))
        return out


__all__ = ["PgBouncer", "PgBouncerError", "PgError", "find_binary", "version"]
