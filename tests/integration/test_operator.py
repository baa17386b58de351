"""``lease-sidecar operator`` keeps the ``lease-role`` labels true, on the real apiserver.

Real sidecar processes (kubernetes backend, 3 s lease, the deploy/rbac.yaml ServiceAccount)
label Pending Pod objects; one real operator process (labels only, no webhook, admin
credentials, this test's namespace) puts right what the sidecars do not: labels edited by
hand and group labels edited or removed (issue 19, item 6), and it must never leave two
pods labelled ``leader``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.kube_support import create_pods, install_rbac, leaders, role_column, sidecar
from testkit.procs import free_port
from testkit.support import REPO, SidecarProcess, get_json, wait_until
from testkit.testbed.kube import ControlPlane

pytestmark = [pytest.mark.kube, pytest.mark.slow]

PODS = ("web-0", "web-1", "web-2")


@pytest.fixture
def operator(control_plane: ControlPlane, kube_namespace: str,
             tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    port = free_port()
    log = open(tmp_path / "operator.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "operator", "--namespace", kube_namespace,
         "--health", f"127.0.0.1:{port}"],
        env={**os.environ, "KUBECONFIG": str(control_plane.kubeconfig),
             "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=log, cwd=REPO)
    try:
        wait_until(lambda: get_json(f"http://127.0.0.1:{port}/healthz")[0] == 200,
                   timeout=30)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def group(control_plane: ControlPlane, kube_namespace: str, tmp_path: Path,
          operator: subprocess.Popen[bytes]) -> Iterator[list[SidecarProcess]]:
    kubeconfig = install_rbac(control_plane, kube_namespace)
    create_pods(control_plane, kube_namespace, *PODS)
    procs = [sidecar(tmp_path, pod, kube_namespace, kubeconfig) for pod in PODS]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_http()
        wait_until(lambda: leaders(procs), timeout=15)
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def picture(leader: str) -> dict[str, str]:
    return {p: "leader" if p == leader else "standby" for p in PODS}


def settle(cp: ControlPlane, ns: str, want: dict[str, str], timeout: float) -> float:
    """Seconds until ``kubectl get pods -L lease-role`` shows ``want``; asserts it never
    shows two leaders meanwhile."""
    started = time.monotonic()
    while True:
        roles = role_column(cp, ns)
        assert list(roles.values()).count("leader") <= 1, roles
        if roles == want:
            return time.monotonic() - started
        assert time.monotonic() - started < timeout, roles
        time.sleep(0.05)


def test_labels_edited_by_hand_are_put_back_within_a_second(
        control_plane: ControlPlane, kube_namespace: str,
        group: list[SidecarProcess]) -> None:
    cp, ns = control_plane, kube_namespace
    leader = leaders(group)[0].identity
    settle(cp, ns, picture(leader), 5)
    standby = next(p for p in PODS if p != leader)
    cp.kubectl("-n", ns, "label", "pod", standby, "lease-role=leader", "--overwrite")
    edited = time.monotonic()
    wait_until(lambda: role_column(cp, ns) == picture(leader), timeout=5, interval=0.05)
    assert time.monotonic() - edited < 1.5  # kubectl's own start-up included
    cp.kubectl("-n", ns, "label", "pod", leader, "lease-role=standby", "--overwrite")
    settle(cp, ns, picture(leader), 1.5)


@pytest.mark.parametrize("edit", ["lease-sidecar/group=elsewhere", "lease-sidecar/group-"])
def test_a_pod_whose_group_label_is_edited_is_put_back(
        control_plane: ControlPlane, kube_namespace: str, group: list[SidecarProcess],
        edit: str) -> None:
    """Issue 19, item 6: the edit used to leave the pod out of the watch for good."""
    cp, ns = control_plane, kube_namespace
    leader = leaders(group)[0].identity
    settle(cp, ns, picture(leader), 5)
    standby = next(p for p in PODS if p != leader)
    # The worst case: the pod leaves the group and says leader.
    cp.kubectl("-n", ns, "label", "pod", standby, edit, "lease-role=leader", "--overwrite")

    def group_labels() -> dict[str, str]:
        out = cp.kubectl("-n", ns, "get", "pods", "-o",
                         "jsonpath={range .items[*]}{.metadata.name}="
                         "{.metadata.labels['lease-sidecar/group']} {end}").stdout
        return dict(item.split("=", 1) for item in out.split())

    wait_until(lambda: set(group_labels().values()) == {"lease-sidecar.jobs"}, timeout=5,
               interval=0.1)
    settle(cp, ns, picture(leader), 2)
