"""A cluster leaves nothing behind: after a failing test, and after being killed outright.

The host is inspected here with plain commands and /proc, independently of the sweep code
in testkit/testbed/hostguard.py, so a blind spot there cannot hide a leftover here.

These tests start clusters of their own, so they stop the session cluster first and run
last (``cluster_host_free``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.support import REPO
from testkit.testbed import gobuild
from testkit.testbed.cluster import BRIDGE, Cluster

pytestmark = [pytest.mark.pods, pytest.mark.slow]

SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
)
PATHS = ("/var/lib/kubelet", "/var/lib/cni", "/run/containerd", "/run/netns",
         "/var/log/containers", "/var/log/pods", "/opt/containerd")
MARK = "lease-cluster-"  # every cluster work directory's prefix


def _chains() -> set[str]:
    out = set()
    for binary in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle", "raw"):
            dump = subprocess.run([binary, "-w", "5", "-t", table, "-S"], capture_output=True,
                                  text=True).stdout
            out |= {f"{binary}/{table}: {line}" for line in dump.splitlines()
                    if "KUBE-" in line or "CNI-" in line or "LEASE-TB" in line}
    return out


def _processes() -> set[str]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if MARK in cmd and "pytest" not in cmd:
                found.add(f"{entry.name}: {cmd[:100]}")
    return found


def host_facts() -> dict[str, object]:
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    return {
        "sysctls": {s: Path("/proc/sys", s).read_text().strip() for s in SYSCTLS},
        "paths": {p for p in PATHS if os.path.lexists(p)},
        "mounts": {m.split()[4] for m in mounts
                   if MARK in m or "/run/netns" in m or "kubelet" in m or "containerd" in m},
        "chains": _chains(),
        "links": set(os.listdir("/sys/class/net")),
        "cgroups": {f"{c}/{d}" for c in os.listdir("/sys/fs/cgroup")
                    if os.path.isdir(f"/sys/fs/cgroup/{c}")
                    for d in os.listdir(f"/sys/fs/cgroup/{c}")
                    if os.path.isdir(f"/sys/fs/cgroup/{c}/{d}")},
        "processes": _processes(),
        "tmp": {p.name for p in Path("/tmp").glob(f"{MARK}*")},
    }


def assert_restored(before: dict[str, object], during: dict[str, object],
                    after: dict[str, object]) -> None:
    """Sysctls are back to their values; of everything that appeared while the cluster
    ran, nothing is left. (Other test runs on the machine may make cgroups or links of
    their own meanwhile; those are not the cluster's to remove.)"""
    assert after["sysctls"] == before["sysctls"]
    left = {k: sorted(after[k] & (during[k] - before[k]))  # type: ignore[operator]  # these facts are sets
            for k in before if k != "sysctls"}
    left = {k: v for k, v in left.items() if v}
    assert not left, f"the cluster left these behind: {left}"


def _busy_pod(image: str) -> str:
    """A pod that mounts a memory emptyDir and runs, so there is something to clean."""
    return json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "busy"},
        "spec": {
            "terminationGracePeriodSeconds": 30,
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                            "command": ["/bin/sh", "-c", "sleep 3600"],
                            "volumeMounts": [{"name": "mem", "mountPath": "/mem"}]}],
            "volumes": [{"name": "mem", "emptyDir": {"medium": "Memory"}}],
        },
    })


def _wait_running(kubectl: list[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        phase = subprocess.run([*kubectl, "get", "pod", "busy", "-o", "jsonpath={.status.phase}"],
                               capture_output=True, text=True).stdout
        if phase == "Running":
            return
        time.sleep(0.3)
    raise AssertionError("pod busy did not start")


def _kubectl(kubeconfig: Path | str) -> list[str]:
    return [str(gobuild.ensure_binary("kubectl")), f"--kubeconfig={kubeconfig}"]


class Boom(Exception):
    pass


def test_teardown_after_a_failing_test_restores_the_host(cluster_host_free: None) -> None:
    before = host_facts()
    assert BRIDGE not in before["links"]  # type: ignore[operator]  # links is a set
    with pytest.raises(Boom), Cluster() as cluster:
        cluster.kubectl("apply", "-f", "-", input=_busy_pod(cluster.busybox()))
        _wait_running(_kubectl(cluster.kubeconfig))
        during = host_facts()
        # The cluster really changed the host, so the comparison below means something.
        assert BRIDGE in during["links"]  # type: ignore[operator]  # links is a set
        assert during["chains"] and during["processes"] and during["mounts"]
        assert during["sysctls"] != before["sysctls"]
        assert during["cgroups"] - before["cgroups"]  # type: ignore[operator]  # cgroups is a set
        raise Boom
    assert_restored(before, during, host_facts())


def test_a_killed_run_is_swept_by_the_next_cleanup(cluster_host_free: None) -> None:
    before = host_facts()
    # A separate process runs the cluster and is then SIGKILLed: no teardown runs at all.
    proc = subprocess.Popen(
        [sys.executable, "-m", "testkit.testbed.cluster", "up", "--busybox"], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        said: dict[str, str] = {}
        lines = []
        while "ready" not in said:  # the child's own start timeout bounds this
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            key, _, value = line.strip().partition(" ")
            said[key] = value
        assert "ready" in said, "cluster did not start:\n" + "".join(lines[-30:])
        kubectl = _kubectl(said["kubeconfig"])
        subprocess.run([*kubectl, "apply", "-f", "-"], check=True, capture_output=True,
                       text=True, input=_busy_pod(said["busybox"]))
        _wait_running(kubectl)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        time.sleep(1)  # PDEATHSIG has taken the components down
        left = host_facts()
        # What a kill leaves: the containers and their shims, mounts, chains, sysctls.
        assert left["processes"], "expected the shims and containers to survive the kill"
        assert left["chains"] and BRIDGE in left["links"]  # type: ignore[operator]  # links is a set
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    cleanup = subprocess.run([sys.executable, "-m", "testkit.testbed.cluster", "cleanup"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert cleanup.returncode == 0, cleanup.stdout + cleanup.stderr
    assert "process" in cleanup.stdout  # it reports what it found
    assert_restored(before, left, host_facts())


INTERRUPTED_TEST = '''
import time
from tests.testbed.test_cluster_cleanup import _busy_pod

def test_waits_for_ctrl_c(pod_cluster):
    pod_cluster.kubectl("apply", "-f", "-", input=_busy_pod(pod_cluster.busybox()))
    pod_cluster.wait_for(
        lambda: pod_cluster.kubectl("get", "pod", "busy", "-o", "jsonpath={.status.phase}"
                                    ).stdout == "Running", 90, "pod busy")
    print("READY", flush=True)
    time.sleep(600)
'''


def _sigint_raises() -> None:
    """In the child before it execs: SIGINT back to its default, so Python turns it into
    KeyboardInterrupt. A shell that runs this suite in the background (``cmd &`` without
    job control) starts it with SIGINT ignored, and Python keeps an ignored SIGINT
    ignored: the child would sleep through the Ctrl-C this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_an_interrupted_test_run_restores_the_host(cluster_host_free: None,
                                                   tmp_path: Path) -> None:
    """Ctrl-C in the middle of a test: pytest's session teardown stops the cluster."""
    before = host_facts()
    test_file = tmp_path / "test_interrupted.py"
    test_file.write_text(INTERRUPTED_TEST)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-s", "-q", "-p", "no:cacheprovider",
         "-p", "tests.testbed.cluster_fixtures", "--rootdir", str(tmp_path), str(test_file)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=_sigint_raises,
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the cluster's start timeout bounds this
        lines.append(line)
        if "READY" in line:
            break
    assert "READY" in "".join(lines), "".join(lines[-30:])
    during = host_facts()
    assert during["processes"] and BRIDGE in during["links"]  # type: ignore[operator]  # links is a set
    os.kill(proc.pid, signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # it did not stop: leave no cluster for the next test
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "KeyboardInterrupt" in out, out[-2000:]
    assert_restored(before, during, host_facts())
