"""The ``kubernetes`` backend against a real kube-apiserver, with real sidecar processes.

Each sidecar runs as the ServiceAccount of deploy/rbac.yaml (so these tests also prove the
Role is enough), believes it runs in a Pending Pod object, and uses a 3 s lease.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.kube_support import (
    Recorder,
    create_pods,
    install_rbac,
    leaders,
    lease_spec,
    sidecar,
)
from tests.support import REPO, SidecarProcess, get_json, wait_until
from tests.testbed.kube import ControlPlane

pytestmark = [pytest.mark.kube, pytest.mark.slow]

PODS = ("pod-a", "pod-b", "pod-c")


@pytest.fixture
def sa_kubeconfig(control_plane: ControlPlane, kube_namespace: str) -> Path:
    return install_rbac(control_plane, kube_namespace)


@pytest.fixture
def trio(control_plane: ControlPlane, kube_namespace: str, sa_kubeconfig: Path,
         tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    """Three contenders, each in its own pod, all up and one of them leading."""
    create_pods(control_plane, kube_namespace, *PODS)
    procs = [sidecar(tmp_path, pod, kube_namespace, sa_kubeconfig) for pod in PODS]
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


def the_leader(procs: list[SidecarProcess], timeout: float = 10) -> SidecarProcess:
    found = wait_until(lambda: leaders(procs), timeout=timeout)
    assert len(found) == 1, [p.identity for p in found]
    return found[0]


def test_exactly_one_leads_and_the_lease_names_it(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    leader = the_leader(trio)
    codes = sorted(p.leader() for p in trio)
    assert codes == [200, 503, 503]
    spec = lease_spec(control_plane, kube_namespace)
    assert spec["holderIdentity"] == leader.identity
    assert spec["leaseDurationSeconds"] == 3
    _, body, _ = get_json(leader.url + "/leader")
    assert body["fencing_token"] == spec["leaseTransitions"] >= 1
    assert spec["acquireTime"].endswith("Z") and spec["renewTime"] >= spec["acquireTime"]
    for standby in (p for p in trio if p is not leader):
        _, body, _ = get_json(standby.url + "/leader")
        assert body["leader"] is False and body["holder"] == leader.identity
        # Losing the race is not an error: the standbys never called the backend down.
        assert "backend unreachable" not in standby.logs()
        assert get_json(standby.url + "/readyz")[0] == 200


def test_the_holder_renews(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    leader = the_leader(trio)
    before = lease_spec(control_plane, kube_namespace)
    wait_until(lambda: lease_spec(control_plane, kube_namespace)["renewTime"]
               > before["renewTime"], timeout=5)
    after = lease_spec(control_plane, kube_namespace)
    assert after["holderIdentity"] == leader.identity
    assert after["leaseTransitions"] == before["leaseTransitions"]  # same term, same token
    assert after["acquireTime"] == before["acquireTime"]


def test_sigterm_releases_and_a_standby_leads_within_a_second(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    old = the_leader(trio)
    token = lease_spec(control_plane, kube_namespace)["leaseTransitions"]
    rest = [p for p in trio if p is not old]
    recorder = Recorder(control_plane.kubeconfig, kube_namespace).start()
    try:
        time.sleep(0.5)  # let the recorder's watches open
        sent = time.monotonic()
        old.signal(signal.SIGTERM)
        new = the_leader(rest, timeout=5)
        took = time.monotonic() - sent
        assert old.proc is not None and old.proc.wait(10) == 0
        # The lease was released (holder cleared, duration 1 like client-go's
        # ReleaseOnCancel) before the standby took it: not a TTL expiry.
        release = recorder.first(sent, 5, lambda e: e.kind == "lease" and e.holder == "")
        taken = recorder.first(sent, 5, lambda e: e.kind == "lease"
                               and e.holder == new.identity)
        assert release.version < taken.version
    finally:
        recorder.stop()
    assert took < 1.0, f"standby led {took:.3f}s after SIGTERM (lease is 3s)"
    spec = lease_spec(control_plane, kube_namespace)
    assert spec["holderIdentity"] == new.identity
    assert spec["leaseTransitions"] == token + 1


def test_sigkill_is_taken_over_after_about_the_lease_duration(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    old = the_leader(trio)
    token = lease_spec(control_plane, kube_namespace)["leaseTransitions"]
    rest = [p for p in trio if p is not old]
    killed = time.monotonic()
    old.signal(signal.SIGKILL)
    # Before one lease duration has passed since the last renewal nobody may lead.
    # (The last renewal was at most one renew interval, 0.5 s, before the kill.)
    time.sleep(2.0)
    assert leaders(rest) == []
    new = the_leader(rest, timeout=6)
    took = time.monotonic() - killed
    assert 2.4 <= took <= 5.0, f"took over after {took:.2f}s with a 3s lease"
    spec = lease_spec(control_plane, kube_namespace)
    assert spec["holderIdentity"] == new.identity
    assert spec["leaseTransitions"] == token + 1


def test_fencing_tokens_grow_across_holders(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    tokens = []
    alive = list(trio)
    for _ in range(2):
        leader = the_leader(alive)
        tokens.append(get_json(leader.url + "/leader")[1]["fencing_token"])
        leader.signal(signal.SIGTERM)
        alive.remove(leader)
    leader = the_leader(alive)
    tokens.append(get_json(leader.url + "/leader")[1]["fencing_token"])
    assert tokens == sorted(set(tokens)), tokens
    assert tokens[-1] == lease_spec(control_plane, kube_namespace)["leaseTransitions"]


def test_an_unreachable_apiserver_means_not_leader_and_no_crash(
    control_plane: ControlPlane, kube_namespace: str, sa_kubeconfig: Path, tmp_path: Path
) -> None:
    # The same credentials, pointed at a port where nothing listens.
    dead = tmp_path / "dead.kubeconfig"
    dead.write_text(sa_kubeconfig.read_text().replace(control_plane.server,
                                                      "https://127.0.0.1:9"))
    create_pods(control_plane, kube_namespace, "pod-x")
    proc = sidecar(tmp_path, "pod-x", kube_namespace, dead).start()
    try:
        proc.wait_http()
        time.sleep(2.0)
        assert proc.proc is not None and proc.proc.poll() is None
        assert proc.leader() == 503
        assert get_json(proc.url + "/readyz")[0] == 503
        logged = [line for line in proc.logs().splitlines() if "backend unreachable" in line]
        assert logged and "kubernetes: get lease" in logged[0]
        assert "Traceback" not in proc.logs()
    finally:
        assert proc.stop() == 0


def test_a_name_that_is_no_kubernetes_object_name_is_a_settings_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--backend", "kubernetes",
         "--name", "Nightly_Jobs", "--state-dir", str(tmp_path), "--pod-label", "off",
         "--http-addr", "127.0.0.1:0"],
        cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a valid Kubernetes object name" in lines[-1], result.stderr


def test_a_lease_deleted_by_hand_is_restored_by_its_holder_not_taken_over(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    """Leases allow create-on-update: the holder's next renew writes the object back,
    with its token. The standbys saw the object vanish while held and wait out that
    holder's duration instead of creating a new Lease (and a new count) at once."""
    leader = the_leader(trio)
    before = lease_spec(control_plane, kube_namespace)
    control_plane.kubectl("-n", kube_namespace, "delete", "lease", "lease-sidecar.jobs")
    restored = wait_until(lambda: lease_spec(control_plane, kube_namespace), timeout=3)
    assert restored["holderIdentity"] == leader.identity
    assert restored["leaseTransitions"] == before["leaseTransitions"]
    time.sleep(4.0)  # longer than the lease: a standby that had jumped in would show now
    assert leaders(trio) == [leader]
    assert lease_spec(control_plane, kube_namespace)["leaseTransitions"] == \
        before["leaseTransitions"]
