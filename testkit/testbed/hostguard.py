"""Record the host state a one-node cluster changes, and put it back.

A kubelet, containerd and the CNI plugins change the host far beyond their own
directories: global sysctls, iptables chains in both families, cgroup trees, mounts,
``/var/lib/kubelet/device-plugins``, ``/var/lib/cni``, ``/run/containerd``, ``/run/netns``,
and container processes that outlive containerd (their shims daemonize).  ``snapshot()``
records what is there before the cluster starts; ``sweep()`` removes what appeared since
and restores what changed.  The snapshot is written to a journal on disk first, so a
later run can sweep after a test process that was killed outright (``sweep_stale()``).

Everything swept is identified by what this run made, never by a program name: processes
whose command line names the cluster's private work directory, processes inside cgroup
trees that did not exist before, iptables chains with the ``KUBE-``/``CNI-``/``LEASE-TB-``
prefixes that did not exist before, and the rules jumping to them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The kubelet sets these at start (containermanager's kernel tunables), the CNI bridge
# plugin turns on forwarding; containerd sets none. kube-proxy is configured to set none
# of the last four (its conntrack sizing and localhost NodePorts); they are put back
# all the same should a release start to.
SYSCTLS: tuple[str, ...] = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.ipv4.ip_forward",
    "net.ipv6.conf.all.forwarding",
    "net.ipv4.conf.all.route_localnet",
    "net.netfilter.nf_conntrack_max",
    "net.netfilter.nf_conntrack_tcp_timeout_established",
    "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
)

# Paths the components write whatever their configured directories say.
HOST_PATHS: tuple[str, ...] = (
    "/var/lib/kubelet",
    "/var/lib/kubelet/device-plugins",
    "/var/lib/cni",
    "/run/containerd",
    "/run/netns",
    "/var/log/containers",
    "/var/log/pods",
    "/opt/containerd",
    "/etc/kubernetes",
)

IPTABLES = ("iptables", "ip6tables")
TABLES = ("filter", "nat", "mangle", "raw")
CHAIN_PREFIXES = ("KUBE-", "CNI-", "LEASE-TB-")
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass
class Snapshot:
    """The host before the cluster started; JSON-serialisable for the journal."""

    workdir: str
    bridge: str
    owner_pid: int
    sysctls: dict[str, str] = field(default_factory=dict)
    paths: dict[str, bool] = field(default_factory=dict)
    mountpoints: list[str] = field(default_factory=list)
    chains: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    cgroups: dict[str, list[str]] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Snapshot:
        return cls(**json.loads(path.read_text()))


# --------------------------------------------------------------------------- reading


def read_sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def write_sysctl(name: str, value: str) -> None:
    Path("/proc/sys", *name.split(".")).write_text(value)


def mountpoints() -> list[str]:
    """Mount points of this mount namespace, in mount order."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, with spaces etc. octal-escaped.
        raw = line.split()[4]
        points.append(raw.encode().decode("unicode_escape"))
    return points


def iptables_rules(binary: str, table: str) -> list[str] | None:
    """``-S`` output of one table, or None when the table or the binary is missing."""
    if not shutil.which(binary):
        return None
    proc = subprocess.run(
        [binary, "-w", "5", "-t", table, "-S"], capture_output=True, text=True, timeout=30
    )
    return proc.stdout.splitlines() if proc.returncode == 0 else None


def chains(binary: str, table: str) -> list[str]:
    rules = iptables_rules(binary, table) or []
    return [line.split()[1] for line in rules if line.startswith(("-N ", "-P "))]


def cgroup_controllers() -> list[Path]:
    """Each mounted cgroup hierarchy (v1 controllers, named ones, and the v2 one)."""
    if not CGROUP_ROOT.is_dir():
        return []
    return sorted(p for p in CGROUP_ROOT.iterdir() if (p / "cgroup.procs").exists())


def top_cgroups(controller: Path) -> list[str]:
    return sorted(p.name for p in controller.iterdir() if p.is_dir())


def snapshot(workdir: Path, bridge: str) -> Snapshot:
    snap = Snapshot(workdir=str(workdir), bridge=bridge, owner_pid=os.getpid())
    for name in SYSCTLS:
        value = read_sysctl(name)
        if value is not None:
            snap.sysctls[name] = value
    snap.paths = {p: os.path.lexists(p) for p in HOST_PATHS}
    snap.mountpoints = mountpoints()
    for binary in IPTABLES:
        snap.chains[binary] = {t: chains(binary, t) for t in TABLES}
    snap.cgroups = {str(c): top_cgroups(c) for c in cgroup_controllers()}
    return snap


# --------------------------------------------------------------------------- what is left


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def workdir_processes(workdir: str) -> list[int]:
    """Processes whose command line names the work directory (components and shims)."""
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me and workdir in _cmdline(int(entry.name)):
            found.append(int(entry.name))
    return found


def new_cgroup_dirs(snap: Snapshot) -> list[Path]:
    """Top-level cgroup directories that appeared since the snapshot (kubepods, ...)."""
    found = []
    for controller in cgroup_controllers():
        before = set(snap.cgroups.get(str(controller), []))
        found += [controller / n for n in top_cgroups(controller) if n not in before]
    return found


def cgroup_pids(top: Path) -> list[int]:
    pids: set[int] = set()
    for procs in top.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(x) for x in procs.read_text().split())
    return sorted(pids)


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def owned_roots(snap: Snapshot) -> list[str]:
    """Directories whose every mount and file belongs to this cluster."""
    roots = [snap.workdir]
    roots += [p for p, existed in snap.paths.items() if not existed]
    return roots


def _ours(mount: str, roots: list[str]) -> bool:
    # containerd pins each pod's network namespace at /run/netns/cni-<uuid> and makes
    # /run/netns a shared mount of itself; other netns there are not ours.
    return _under(mount, roots) or mount == "/run/netns" or mount.startswith("/run/netns/cni-")


def new_mounts(snap: Snapshot) -> list[str]:
    """Mounts that appeared under owned roots, plus network namespaces CNI pinned."""
    before = set(snap.mountpoints)
    roots = owned_roots(snap)
    return [m for m in mountpoints() if m not in before and _ours(m, roots)]


def new_chains(snap: Snapshot) -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for binary in IPTABLES:
        for table in TABLES:
            before = set(snap.chains.get(binary, {}).get(table, []))
            extra = [
                c for c in chains(binary, table) if c.startswith(CHAIN_PREFIXES) and c not in before
            ]
            if extra:
                found[(binary, table)] = extra
    return found


def bridge_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def leftovers(snap: Snapshot) -> list[str]:
    """Everything the cluster left behind, one line each; empty when the host is clean."""
    out = [f"process {pid}: {_cmdline(pid)[:120]}" for pid in workdir_processes(snap.workdir)]
    out += [f"cgroup {p} ({len(cgroup_pids(p))} processes)" for p in new_cgroup_dirs(snap)]
    out += [f"mount {m}" for m in new_mounts(snap)]
    for (binary, table), names in new_chains(snap).items():
        out += [f"{binary} -t {table} chain {n}" for n in names]
    for name, value in snap.sysctls.items():
        now = read_sysctl(name)
        if now is not None and now != value:
            out.append(f"sysctl {name} = {now} (was {value})")
    out += [f"path {p}" for p, existed in snap.paths.items() if not existed and os.path.lexists(p)]
    if bridge_exists(snap.bridge):
        out.append(f"link {snap.bridge}")
    return out


# --------------------------------------------------------------------------- sweeping


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def kill_processes(snap: Snapshot, timeout: float = 20.0) -> None:
    """SIGKILL the components, their shims, then every process in new cgroup trees.

    Components first, so nothing restarts a container while its processes are killed.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = workdir_processes(snap.workdir)
        for top in new_cgroup_dirs(snap):
            pids += cgroup_pids(top)
        pids = [p for p in pids if p != os.getpid()]
        if not pids:
            return
        _kill_all(pids)
        time.sleep(0.1)


def unmount_all(snap: Snapshot, timeout: float = 20.0) -> None:
    """Unmount new mounts, deepest first; lazily if a mount stays busy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        mounts = new_mounts(snap)
        if not mounts:
            return
        for m in sorted(mounts, key=lambda p: p.count("/"), reverse=True):
            flag = [] if time.monotonic() < deadline - timeout / 2 else ["-l"]
            subprocess.run(["umount", *flag, m], capture_output=True, timeout=30)
        time.sleep(0.05)


def _ipt(binary: str, table: str, *args: str) -> None:
    subprocess.run([binary, "-w", "5", "-t", table, *args], capture_output=True, timeout=30)


def remove_chains(snap: Snapshot) -> None:
    """Delete rules jumping to new chains, then flush and delete those chains."""
    for (binary, table), names in new_chains(snap).items():
        targets = set(names)
        for line in iptables_rules(binary, table) or []:
            if not line.startswith("-A "):
                continue
            words = shlex.split(line)
            jump = words[words.index("-j") + 1] if "-j" in words else None
            if words[1] not in targets and jump in targets:
                _ipt(binary, table, "-D", *words[1:])
        for name in names:
            _ipt(binary, table, "-F", name)
        for name in names:
            _ipt(binary, table, "-X", name)


def remove_cgroups(snap: Snapshot) -> None:
    for top in new_cgroup_dirs(snap):
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts))
        for d in [*reversed(dirs), top]:
            with contextlib.suppress(OSError):
                d.rmdir()


def remove_links(snap: Snapshot) -> None:
    if not bridge_exists(snap.bridge):
        return
    # veths whose peer namespace is gone are deleted by the kernel; any others, now.
    brif = Path("/sys/class/net", snap.bridge, "brif")
    for port in sorted(p.name for p in brif.iterdir()) if brif.is_dir() else []:
        subprocess.run(["ip", "link", "del", port], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", snap.bridge], capture_output=True, timeout=30)


def restore_sysctls(snap: Snapshot) -> None:
    for name, value in snap.sysctls.items():
        if read_sysctl(name) not in (None, value):
            with contextlib.suppress(OSError):
                write_sysctl(name, value)


def remove_paths(snap: Snapshot, keep_workdir: bool = False) -> None:
    for path, existed in sorted(snap.paths.items(), key=lambda kv: len(kv[0])):
        if not existed and os.path.lexists(path):
            shutil.rmtree(path, ignore_errors=True)
    if not keep_workdir:  # kept for its logs; nothing is mounted in it any more
        shutil.rmtree(snap.workdir, ignore_errors=True)


def sweep(snap: Snapshot, keep_workdir: bool = False) -> list[str]:
    """Undo everything since ``snap``; return what could not be undone (empty if all)."""
    kill_processes(snap)
    unmount_all(snap)
    remove_links(snap)
    remove_chains(snap)
    kill_processes(snap, timeout=5)
    remove_cgroups(snap)
    restore_sysctls(snap)
    remove_paths(snap, keep_workdir)
    return leftovers(snap)


# --------------------------------------------------------------------------- the journal


def state_dir() -> Path:
    return Path(os.environ.get("LEASE_TESTBED_HOST_STATE", "/var/tmp/lease-testbed-cluster"))


class HostLock:
    """One cluster per machine: the kubelet's chains, sysctls and cgroup trees are global.

    Holding the lock also means owning the journal: a journal found on acquiring it was
    left by a process that died before its sweep, and is swept first.
    """

    def __init__(self) -> None:
        self.dir = state_dir()
        self.journal = self.dir / "journal.json"
        self._fh: object | None = None

    def acquire(self, timeout: float = 900.0) -> list[str]:
        """Wait for the lock; sweep a dead owner's leftovers; return what that found."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fh = (self.dir / "lock").open("w")
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    fh.close()
                    raise TimeoutError(
                        f"another one-node cluster held {self.dir / 'lock'} for {timeout:.0f}s"
                    ) from None
                time.sleep(1)
        self._fh = fh
        return self.sweep_stale()

    def sweep_stale(self) -> list[str]:
        if not self.journal.exists():
            return []
        stale = Snapshot.load(self.journal)
        found = leftovers(stale)
        remaining = sweep(stale)
        if remaining:
            raise RuntimeError(
                "could not clean up after an earlier cluster:\n" + "\n".join(remaining)
            )
        self.journal.unlink()
        return found

    def record(self, snap: Snapshot) -> None:
        snap.save(self.journal)

    def forget(self) -> None:
        self.journal.unlink(missing_ok=True)

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()  # type: ignore[attr-defined]  # a file once not None
            self._fh = None
