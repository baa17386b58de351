"""The state directory: where the leader file lives, chosen and vetted before anything runs.

The application trusts whatever ``{state_dir}/leader`` says, so nobody but this user (and
root) may be able to create, replace or remove a file there. A directory is accepted when

- it is owned by this user and neither group nor others may write to it — the sticky bit
  does not help here: it stops others from removing our file, not from creating
  ``leader`` while we do not lead; or
- it is a **pod volume**: running in a Kubernetes pod (``POD_NAME`` and ``POD_NAMESPACE``
  set, as the chart and the injector do), the directory is the root of a mount and owned
  by root. The kubelet makes an ``emptyDir`` root-owned ``0777`` (``2777`` and the pod's
  group with ``fsGroup``) and nothing outside the pod can reach it: the only writers are
  the pod's own containers (the chart mounts it read-only into the app);

and every directory above it is owned by root or this user and, if others may write to
it, sticky or a pod volume (else someone could rename ours away and put theirs there).
Anything else is a configuration error (exit 2) naming the directory and the reason.

When the *default* (``/run/lease``) cannot be created or written (a non-root user on a
VM), a private directory is used instead: ``$XDG_RUNTIME_DIR/lease-sidecar-<uid>`` or
``/tmp/lease-sidecar-<uid>``, mode 0700. That name is predictable, so another user could
create it first: a pre-existing one not owned by us, or not a directory (a symlink), is
refused with one warning and a fresh ``mkdtemp`` directory is used instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import tempfile
from pathlib import Path

from sidecar.base.errors import ConfigError
from sidecar.settings import Settings

log = logging.getLogger("sidecar")

_SHARED = stat.S_IWGRP | stat.S_IWOTH


def resolve_state_dir(settings: Settings) -> Path:
    """The configured directory, or — only when the default is unusable — a private one.

    An explicit setting that does not work is an error instead, because the application
    reads that exact path.
    """
    wanted = Path(settings.state_dir)
    in_pod = bool(settings.pod_name and settings.pod_namespace)
    try:
        wanted.mkdir(mode=0o755, parents=True, exist_ok=True)
        problem = None if os.access(wanted, os.W_OK) else "not writable"
    except OSError as exc:
        problem = exc.strerror or str(exc)
    if problem is None:
        unsafe = state_dir_problem(wanted, in_pod)
        if unsafe:
            raise ConfigError(f"LEASE_STATE_DIR / --state-dir: {unsafe}")
        return wanted
    if "state_dir" in settings.explicit:
        raise ConfigError(f"LEASE_STATE_DIR / --state-dir: {wanted}: {problem}")
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    fallback = private_dir(base)
    log.warning("default state dir unusable; using a private one",
                extra={"wanted": str(wanted), "problem": problem, "state_dir": str(fallback)})
    return fallback


def private_dir(base: Path) -> Path:
    """``base/lease-sidecar-<uid>`` (0700, ours), or a fresh one if someone planted that."""
    uid = os.geteuid()
    path = base / f"lease-sidecar-{uid}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
        fresh = Path(tempfile.mkdtemp(prefix=f"lease-sidecar-{uid}-", dir=base))
        log.warning("refusing a pre-existing state dir that is not ours; using a fresh one",
                    extra={"refused": str(path), "owner_uid": info.st_uid,
                           "kind": "directory" if stat.S_ISDIR(info.st_mode) else "not a "
                           "directory", "state_dir": str(fresh)})
        path = fresh
    elif stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)  # ours, made by an older version with 0755
    unsafe = state_dir_problem(path, in_pod=False)
    if unsafe:
        raise ConfigError(f"LEASE_STATE_DIR / --state-dir: {unsafe}")
    return path


def state_dir_problem(path: Path, in_pod: bool) -> str | None:
    """Why ``path`` must not hold the leader file, or None (see the module docstring)."""
    me = os.geteuid()
    for prefix in _prefixes(Path(os.path.abspath(path))):
        info = os.lstat(prefix)
        if stat.S_ISLNK(info.st_mode) and info.st_uid not in (0, me):
            return f"{path}: {prefix} is a symlink owned by uid {info.st_uid}"
    real = Path(os.path.realpath(path))
    info = os.stat(real)
    if not stat.S_ISDIR(info.st_mode):
        return f"{path}: not a directory"
    pod_volume = in_pod and info.st_uid == 0 and is_mount_point(real)
    if not pod_volume:
        if info.st_uid != me:
            return f"{path}: owned by uid {info.st_uid}, not by this user (uid {me})"
        if info.st_mode & _SHARED:
            return (f"{path}: writable by group or others (mode "
                    f"{stat.S_IMODE(info.st_mode):04o}); they could plant a leader file")
    for parent in real.parents:
        above = os.stat(parent)
        if above.st_uid not in (0, me):
            return f"{path}: {parent} is owned by uid {above.st_uid}, who could replace it"
        if in_pod and above.st_uid == 0 and is_mount_point(parent):
            continue  # a pod volume above us: only the pod's containers reach it
        if above.st_mode & _SHARED and not above.st_mode & stat.S_ISVTX:
            return (f"{path}: {parent} is writable by group or others without the sticky "
                    "bit, so they could replace it")
    return None


def _prefixes(path: Path) -> list[Path]:
    return [*reversed(path.parents), path]


def is_mount_point(path: Path) -> bool:
    """Whether ``path`` (resolved) is where a filesystem is mounted.

    From ``/proc/self/mountinfo`` (field 5, octal escapes for spaces), which also sees
    bind mounts from the same device; ``os.path.ismount`` (a device change) elsewhere.
    """
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            points = {_unescape(line.split()[4]) for line in fh if line.strip()}
    except OSError:
        return os.path.ismount(path)
    return str(path) in points


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
