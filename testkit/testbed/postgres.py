"""A real PostgreSQL for tests: a throw-away primary and, on demand, a streaming standby.

``PgServer`` runs ``initdb`` and starts a cluster in a temp dir on a free 127.0.0.1 port::

    with PgServer() as pg:
        pg.psql("select 1")            # as the superuser ``postgres``
        pg.dsn                         # postgresql://lease:<password>@127.0.0.1:<port>/lease
        standby = start_standby(pg)    # pg_basebackup -R, hot standby on another port
        standby.wait_replayed()        # until the primary's current LSN is replayed
        standby.stop_receiving()       # asynchronous replication lags: WAL receiver off
        standby.promote()              # pg_ctl promote: a new timeline, read-write

:mod:`testkit.testbed.pg_failover` fails a primary over to its standby again and again.

The binaries come from Debian's ``postgresql`` package (``/usr/lib/postgresql/<v>/bin``,
newest version wins); :func:`ensure_installed` installs it with apt-get when missing
(root only). PostgreSQL refuses to run as root, so as root every server command runs as
the ``postgres`` OS user (created if missing) through ``runuser``.

Authentication: the superuser ``postgres`` is trusted on loopback (admin and replication);
every other role needs its password (scram-sha-256), so the test role ``lease`` has one and
tests can check that it never leaks into logs.

Settings favour speed and fault tests over durability: ``fsync=off``; ``wal_level=replica``
and ``hot_standby=on`` so standbys can be built from the primary.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from testkit.procs import free_port

HOST = "127.0.0.1"
SUPERUSER = "postgres"
TEST_ROLE = "lease"
TEST_DB = "lease"
OS_USER = "postgres"
_INSTALL_LOCK = Path(tempfile.gettempdir()) / "lease-testbed-pg-install.lock"
_REQUIRED = ("pg_ctl", "initdb", "postgres", "psql", "pg_basebackup")


class PgError(RuntimeError):
    """The test bed could not install, start or talk to PostgreSQL."""


# -- installation ------------------------------------------------------------------------
def find_bindir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding all server tools."""
    found: list[tuple[tuple[int, ...], Path]] = []
    for bindir in Path("/usr/lib/postgresql").glob("*/bin"):
        version = bindir.parent.name
        if re.fullmatch(r"\d+(\.\d+)*", version) and all(
            (bindir / tool).exists() for tool in _REQUIRED
        ):
            found.append((tuple(int(part) for part in version.split(".")), bindir))
    return max(found)[1] if found else None


def ensure_installed() -> Path:
    """Return the server bin dir, installing Debian's ``postgresql`` package if needed."""
    bindir = find_bindir()
    if bindir:
        return bindir
    if os.geteuid() != 0:
        raise PgError("PostgreSQL server binaries not found under /usr/lib/postgresql and "
                      "not root, so cannot apt-get install postgresql")
    # Several pytest processes may start at once; one installs, the others wait.
    with open(_INSTALL_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        bindir = find_bindir()
        if bindir:
            return bindir
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update"],
                    ["apt-get", "install", "-y", "--no-install-recommends", "postgresql"]):
            result = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if result.returncode != 0:
                raise PgError(f"{' '.join(cmd)} failed ({result.returncode}):\n"
                              f"{result.stdout[-2000:]}{result.stderr[-2000:]}")
    bindir = find_bindir()
    if not bindir:
        raise PgError("apt-get installed postgresql but no server binaries were found")
    return bindir


def ensure_os_user() -> pwd.struct_passwd | None:
    """As root: the unprivileged OS user to run the server as (created if missing)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(OS_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                        "--shell", "/bin/sh", OS_USER], check=True, capture_output=True)
        return pwd.getpwnam(OS_USER)


# -- one cluster -------------------------------------------------------------------------
class PgServer:
    """One PostgreSQL cluster in its own temp dir; a primary unless built as a standby."""

    def __init__(self, bindir: Path | None = None, root: Path | None = None,
                 name: str = "primary", *, extra_listen: Sequence[str] = (),
                 client_networks: Sequence[str] = ()) -> None:
        """``extra_listen``: addresses to listen on besides 127.0.0.1 (the one-node
        cluster's bridge, so pods reach the server); ``client_networks``: CIDRs whose
        clients may log in with a password (the pod network)."""
        self.extra_listen = list(extra_listen)
        self.client_networks = list(client_networks)
        self.bindir = bindir or ensure_installed()
        self.os_user = ensure_os_user()
        self.root = root or Path(tempfile.mkdtemp(prefix="lease-pg-"))
        self.name = name
        self.data = self.root / name
        self.sockdir = self.root / f"{name}-sock"
        self.logfile = self.root / f"{name}.log"
        self.port = free_port()
        self.password = secrets.token_urlsafe(12)
        self._owns_root = root is None
        for path in (self.root, self.sockdir):
            path.mkdir(exist_ok=True)
            self._chown(path)

    # -- addresses -----------------------------------------------------------------------
    @property
    def dsn(self) -> str:
        """The test role's URL (with its password) for the ``lease`` database."""
        return self.dsn_for(TEST_DB)

    def dsn_for(self, dbname: str, host: str = HOST) -> str:
        """The test role's URL for ``dbname``; ``host`` one of the listen addresses."""
        return f"postgresql://{TEST_ROLE}:{self.password}@{host}:{self.port}/{dbname}"

    @property
    def admin_dsn(self) -> str:
        """The superuser's URL (trusted on loopback, no password)."""
        return f"postgresql://{SUPERUSER}@{HOST}:{self.port}/postgres"

    @property
    def pid(self) -> int | None:
        """The postmaster's pid, or None when the server is not running."""
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    # -- lifecycle -----------------------------------------------------------------------
    def init(self) -> PgServer:
        """initdb, write test settings, start, create the test role and database."""
        self._run(["initdb", "-D", str(self.data), "-U", SUPERUSER, "-A", "trust",
                   "-E", "UTF8", "--no-sync", "--locale=C"])
        self._configure()
        self._start_on_free_port()
        self.psql(f"create role {TEST_ROLE} login password '{self.password}' createdb")
        self.psql(f"create database {TEST_DB} owner {TEST_ROLE}")
        return self

    def _configure(self) -> None:
        conf = f"""
# lease-sidecar test bed: fast, throw-away, replication-ready
listen_addresses = '{",".join([HOST, *self.extra_listen])}'
port = {self.port}
unix_socket_directories = '{self.sockdir}'
fsync = off
full_page_writes = off
wal_level = replica
max_wal_senders = 10
hot_standby = on
shared_buffers = 32MB
max_connections = 200
password_encryption = 'scram-sha-256'
log_line_prefix = '%m [%p] %u@%d '
"""
        with open(self.data / "postgresql.conf", "a") as fh:
            fh.write(conf)
        (self.data / "pg_hba.conf").write_text(
            f"local all all trust\n"
            f"host all {SUPERUSER} {HOST}/32 trust\n"
            f"host replication {SUPERUSER} {HOST}/32 trust\n"
            f"host all all {HOST}/32 scram-sha-256\n"
            + "".join(f"host all all {net} scram-sha-256\n" for net in self.client_networks))
        self._chown(self.data, recursive=True)

    def _start_on_free_port(self, attempts: int = 3) -> None:
        """Start; if another process took our free port meanwhile, pick another one."""
        for attempt in range(attempts):
            try:
                self.start()
                return
            except PgError as exc:
                if attempt == attempts - 1 or "already in use" not in str(exc):
                    raise
            self.port = free_port()
            with open(self.data / "postgresql.conf", "a") as fh:  # later lines win
                fh.write(f"\nport = {self.port}\n")

    def start(self, timeout: float = 60.0) -> None:
        self._run(["pg_ctl", "-D", str(self.data), "-l", str(self.logfile), "-w",
                   "-t", str(int(timeout)), "start"])

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl stop; ``mode`` is ``smart``, ``fast`` or ``immediate`` (a crash)."""
        if self.pid is None:
            return
        self._run(["pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"])

    def restart(self) -> None:
        self.stop("fast")
        self.start()

    def destroy(self) -> None:
        """Stop at once and remove the temp dir."""
        with contextlib.suppress(PgError):
            self.stop("immediate")
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgServer:
        return self.init()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.destroy()

    # -- SQL -----------------------------------------------------------------------------
    def psql(self, sql: str, dbname: str = "postgres", timeout: float = 30.0) -> str:
        """Run SQL as the superuser; return unaligned, tuples-only output (stripped)."""
        cmd = [str(self.bindir / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
               "-h", HOST, "-p", str(self.port), "-U", SUPERUSER, "-d", dbname, "-c", sql]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, "PGCONNECT_TIMEOUT": "5"})
        if result.returncode != 0:
            raise PgError(f"psql on {self.name}:{self.port} failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def create_database(self, dbname: str) -> str:
        """A fresh database owned by the test role; returns its DSN."""
        self.psql(f'create database "{dbname}" owner {TEST_ROLE}')
        return self.dsn_for(dbname)

    def log_text(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    # -- helpers -------------------------------------------------------------------------
    def _run(self, argv: list[str], timeout: float = 120.0) -> str:
        cmd = [str(self.bindir / argv[0]), *argv[1:]]
        if self.os_user is not None:
            cmd = ["runuser", "-u", self.os_user.pw_name, "--", *cmd]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                    cwd=self.root)
        except subprocess.TimeoutExpired as exc:
            raise PgError(f"{argv[0]} timed out after {timeout}s") from exc
        if result.returncode != 0:
            raise PgError(f"{argv[0]} failed ({result.returncode}): "
                          f"{result.stderr.strip() or result.stdout.strip()}\n"
                          f"server log tail:\n{self.log_text()[-2000:]}")
        return result.stdout

    def _chown(self, path: Path, recursive: bool = False) -> None:
        if self.os_user is None:
            return
        uid, gid = self.os_user.pw_uid, self.os_user.pw_gid
        os.chown(path, uid, gid)
        if recursive:
            for dirpath, dirnames, filenames in os.walk(path):
                for entry in (*dirnames, *filenames):
                    os.chown(os.path.join(dirpath, entry), uid, gid)


class PgStandby(PgServer):
    """A streaming hot standby of ``primary`` (built with ``pg_basebackup -R``)."""

    def __init__(self, primary: PgServer, name: str = "standby", port: int | None = None) -> None:
        """``port``: listen there (e.g. a failed primary's, so a multi-host DSN naming
        both ports stays right) instead of on a new free port."""
        super().__init__(bindir=primary.bindir, root=primary.root, name=name)
        self.primary = primary
        self.password = primary.password  # roles are replicated
        if port is not None:
            self.port = port
        self._primary_conninfo = ""

    def init(self) -> PgStandby:
        self._run(["pg_basebackup", "-h", HOST, "-p", str(self.primary.port),
                   "-U", SUPERUSER, "-D", str(self.data), "-R", "-X", "stream",
                   "--no-sync", "-c", "fast"])
        # The copied postgresql.conf names the primary's port and socket dir; later lines
        # win, so append ours.
        with open(self.data / "postgresql.conf", "a") as fh:
            fh.write(f"\nport = {self.port}\nunix_socket_directories = '{self.sockdir}'\n")
        self._chown(self.data, recursive=True)
        self._start_on_free_port()
        return self

    def pause_replay(self) -> None:
        self.psql("select pg_wal_replay_pause()")

    def stop_receiving(self) -> None:
        """Stop the WAL receiver (an empty ``primary_conninfo``, reloaded): the standby
        falls behind the way an asynchronous one does under load or a network blip,
        and what the primary commits meanwhile never reaches it."""
        self._primary_conninfo = self.psql("show primary_conninfo")
        self.psql("alter system set primary_conninfo = ''")
        self.psql("select pg_reload_conf()")
        deadline = time.monotonic() + 30.0
        while self.psql("select count(*) from pg_stat_wal_receiver") != "0":
            if time.monotonic() >= deadline:
                raise PgError("the standby's WAL receiver did not stop within 30s")
            time.sleep(0.02)

    def resume_receiving(self) -> None:
        """Start the WAL receiver again with the connection string it had."""
        value = self._primary_conninfo.replace("'", "''")
        self.psql(f"alter system set primary_conninfo = '{value}'")
        self.psql("select pg_reload_conf()")

    def promote(self, timeout: float = 60.0) -> None:
        """``pg_ctl promote``: end recovery, start a new timeline, accept writes."""
        self._run(["pg_ctl", "-D", str(self.data), "-w", "-t", str(int(timeout)), "promote"])

    def resume_replay(self) -> None:
        self.psql("select pg_wal_replay_resume()")

    def wait_replayed(self, timeout: float = 30.0) -> str:
        """Wait until this standby has replayed the primary's current WAL position."""
        target = self.primary.psql("select pg_current_wal_lsn()")
        deadline = time.monotonic() + timeout
        while True:
            done = self.psql(f"select coalesce(pg_last_wal_replay_lsn() >= '{target}', false)")
            if done == "t":
                return target
            if time.monotonic() >= deadline:
                raise PgError(f"standby did not replay {target} within {timeout}s")
            time.sleep(0.02)


def pg_upgrade(old: PgServer, name: str = "upgraded") -> PgServer:
    """``pg_upgrade`` of ``old`` (stopped first) into a new cluster of the same major
    version beside it, started: what a major upgrade does to the cluster's identity —
    timeline 1 again (``pg_resetwal -l 00000001…``), transaction ids, sequences and
    every table carried over, roles and their passwords too."""
    new = PgServer(bindir=old.bindir, root=old.root, name=name)
    new.password = old.password
    new._run(["initdb", "-D", str(new.data), "-U", SUPERUSER, "-A", "trust", "-E", "UTF8",
              "--no-sync", "--locale=C"])
    new._configure()
    old.stop("fast")
    new._run(["pg_upgrade", "-b", str(old.bindir), "-B", str(new.bindir),
              "-d", str(old.data), "-D", str(new.data), "-U", SUPERUSER,
              "-p", str(old.port), "-P", str(new.port)], timeout=300.0)
    new._start_on_free_port()
    return new


def start_standby(primary: PgServer, name: str = "standby") -> PgStandby:
    return PgStandby(primary, name=name).init()


def main(argv: list[str]) -> int:
    """``python -m testkit.testbed.postgres [ensure|smoke]`` (see scripts/ensure-postgres)."""
    command = argv[0] if argv else "ensure"
    try:
        bindir = ensure_installed()
        print(bindir)
        if command == "smoke":
            with PgServer() as pg:
                print(pg.psql("select version()"))
    except PgError as exc:
        print(f"ensure-postgres: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
