"""The state directory is vetted before anything runs: real directories, owners, mounts.

Another user is played by uid 65534 (``nobody``): directories are handed to it with
``chown``, or planted by a real process that switched to it with ``os.setuid``. The
pod case mounts a real tmpfs the way the kubelet mounts a memory ``emptyDir``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from sidecar.base.errors import ConfigError
from sidecar.runtime import resolve_state_dir
from sidecar.settings import Settings
from sidecar.statedir import private_dir
from testkit.support import SidecarProcess, get_json, wait_until

NOBODY = 65534
FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play another user")


def run_sidecar(state_dir: Path, tmp_path: Path, env: dict[str, str] | None = None,
                ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--state-dir", str(state_dir),
         "--dsn", str(tmp_path / "l.db"), "--http-addr", "127.0.0.1:0", "--pod-label", "off"],
        capture_output=True, text=True, timeout=30,
        env={**os.environ, **(env or {})})


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@needs_root
def test_a_state_dir_owned_by_another_user_exits_2(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    result = run_sidecar(theirs, tmp_path)
    assert result.returncode == 2
    line = one_line(result)
    assert "LEASE_STATE_DIR / --state-dir" in line and str(theirs) in line
    assert f"owned by uid {NOBODY}" in line
    assert list(theirs.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_a_state_dir_others_can_write_exits_2(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    result = run_sidecar(shared, tmp_path)
    assert result.returncode == 2
    line = one_line(result)
    assert str(shared) in line and "writable by group or others" in line


def test_a_replaceable_parent_exits_2(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)  # anyone could rename our directory away and plant theirs
    result = run_sidecar(parent / "state", tmp_path)
    assert result.returncode == 2
    assert "without the sticky bit" in one_line(result)


def test_a_directory_named_leader_is_a_state_dir_error(tmp_path):
    (tmp_path / "state" / "leader").mkdir(parents=True)
    result = run_sidecar(tmp_path / "state", tmp_path)
    assert result.returncode == 2
    line = one_line(result)
    assert "LEASE_STATE_DIR / --state-dir" in line and "leader" in line
    assert "HTTP" not in line


def test_the_normal_private_dir_still_works(tmp_path):
    proc = SidecarProcess(tmp_path, "plain", args=["--dsn", str(tmp_path / "l.db"), *FAST])
    proc.start()
    try:
        proc.wait_http()
        wait_until(lambda: proc.leader() == 200, timeout=10)
        leader = proc.state_dir / "leader"
        wait_until(leader.exists, timeout=2)
        assert json.loads(leader.read_text())["leader"] is True
        assert stat.S_IMODE(leader.stat().st_mode) == 0o644
    finally:
        assert proc.stop() == 0


@pytest.fixture
def kubelet_emptydir(tmp_path):
    """A tmpfs mounted as the kubelet mounts ``emptyDir: {medium: Memory}``."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        point = tmp_path / f"volume-{len(mounted)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=1m,{options}", "tmpfs",
                               str(point)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=False)


def in_a_pod(tmp_path: Path, pod: str, state_dir: Path) -> SidecarProcess:
    """A started sidecar told it runs in pod ``jobs/<pod>``, its state in ``state_dir``."""
    return SidecarProcess(tmp_path, pod, args=[
        "--dsn", str(tmp_path / "l.db"), "--state-dir", str(state_dir), "--pod-label", "off",
        *FAST], env={"POD_NAME": pod, "POD_NAMESPACE": "jobs"}).start()


@needs_root
@pytest.mark.parametrize("options", ["mode=0777", "mode=2777,gid=10001"],
                         ids=["emptyDir", "emptyDir-with-fsGroup"])
def test_a_pod_volume_is_accepted_in_a_pod_only(tmp_path, kubelet_emptydir, options):
    volume = kubelet_emptydir(options)
    assert stat.S_IMODE(volume.stat().st_mode) & 0o777 == 0o777
    # On a VM (no pod), a world-writable directory is refused, mount or not.
    outside = run_sidecar(volume, tmp_path)
    assert outside.returncode == 2 and "writable by group or others" in one_line(outside)
    # In a pod the emptyDir is reachable only by the pod's containers: accepted.
    proc = in_a_pod(tmp_path, "pod-7f9c", volume)
    try:
        proc.wait_http()
        wait_until(lambda: (volume / "leader").exists(), timeout=10)
        assert get_json(proc.url + "/leader")[0] == 200
    finally:
        assert proc.stop() == 0
    assert not (volume / "leader").exists()


@needs_root
def test_a_directory_inside_a_pod_volume_is_accepted_in_a_pod(tmp_path, kubelet_emptydir):
    volume = kubelet_emptydir("mode=0777")
    inside = volume / "leases"
    outside = run_sidecar(inside, tmp_path)
    assert outside.returncode == 2 and "without the sticky bit" in one_line(outside)
    proc = in_a_pod(tmp_path, "pod-1", inside)
    try:
        proc.wait_http()
        wait_until(lambda: (inside / "leader").exists(), timeout=10)
    finally:
        assert proc.stop() == 0


def test_a_pod_directory_that_is_not_a_mount_is_still_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    result = run_sidecar(shared, tmp_path, env={"POD_NAME": "p", "POD_NAMESPACE": "n"})
    assert result.returncode == 2


@pytest.fixture
def public_tmp():
    """A root-owned, sticky, world-writable directory: a private copy of ``/tmp``."""
    base = Path(tempfile.mkdtemp(prefix="lease-sidecar-test-", dir="/tmp"))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def plant_as_nobody(code: str) -> None:
    """Run ``code`` in a real process that has switched to uid/gid 65534."""
    def become_nobody() -> None:
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    subprocess.run([python, "-c", code], preexec_fn=become_nobody, check=True, timeout=30)


@needs_root
@pytest.mark.parametrize("planted", ["directory", "symlink"])
def test_a_planted_fallback_dir_is_refused(public_tmp, caplog, monkeypatch, planted):
    predictable = public_tmp / f"lease-sidecar-{os.geteuid()}"
    trap = public_tmp / "trap"
    if planted == "directory":
        plant_as_nobody(f"import os; os.mkdir({str(predictable)!r}, 0o777)")
    else:
        plant_as_nobody(f"import os; os.mkdir({str(trap)!r}, 0o777); "
                        f"os.symlink({str(trap)!r}, {str(predictable)!r})")
    assert os.lstat(predictable).st_uid == NOBODY
    # The default state dir is unusable (as /run/lease is for a non-root user on a VM).
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(public_tmp))
    settings = Settings(state_dir="/proc/no-such-dir/lease")
    with caplog.at_level(logging.WARNING, logger="sidecar"):
        chosen = resolve_state_dir(settings)
    assert chosen != predictable and chosen.parent == public_tmp
    info = chosen.stat()
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    refusals = [r for r in caplog.records if "refusing a pre-existing state dir" in r.message]
    assert len(refusals) == 1 and refusals[0].refused == str(predictable)
    if planted == "directory":
        assert list(predictable.iterdir()) == []
    else:
        assert list(trap.iterdir()) == []


def test_the_fallback_dir_is_private_and_reused(public_tmp):
    first = private_dir(public_tmp)
    assert first == public_tmp / f"lease-sidecar-{os.geteuid()}"
    assert stat.S_IMODE(first.stat().st_mode) == 0o700
    first.chmod(0o755)  # as an older version made it
    assert private_dir(public_tmp) == first
    assert stat.S_IMODE(first.stat().st_mode) == 0o700


def test_a_fallback_dir_that_cannot_be_vetted_is_an_error(tmp_path):
    open_base = tmp_path / "open"
    open_base.mkdir()
    open_base.chmod(0o777)  # not sticky: the fallback inside it could be swapped
    with pytest.raises(ConfigError, match="sticky"):
        private_dir(open_base)
