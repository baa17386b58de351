"""LEASE_APP_READY_URL with real sidecar processes on one SQLite file and real HTTP
readiness endpoints (and, in a pod, LEASE_APP_READY_CONTAINERS: the own pod's status on
a real apiserver): an application that never becomes ready never leads, and a leader
whose application turns unready hands over within LEASE_APP_UNREADY_AFTER + one
hand-over, with no two overlapping claims."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.handover import FAST
from testkit.kube_support import create_pods, install_rbac
from testkit.support import (
    ClaimRecorder,
    ReadyEndpoint,
    SidecarProcess,
    get_json,
    one_leader,
    serving,
    wait_until,
)

UNREADY_AFTER = 1.0


@pytest.fixture
def endpoints() -> Iterator[list[ReadyEndpoint]]:
    made: list[ReadyEndpoint] = []
    yield made
    for endpoint in made:
        endpoint.close()


def sidecar(tmp_path: Path, name: str, url: str) -> SidecarProcess:
    return SidecarProcess(tmp_path, name, args=[
        "--dsn", str(tmp_path / "leases.db"), "--name", "handover", *FAST,
        "--app-ready-url", url, "--app-unready-after", f"{UNREADY_AFTER}s"])


def metric(proc: SidecarProcess, line_start: str) -> float:
    text = get_json(proc.url + "/metrics")[1]
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(line_start))


def test_an_application_that_never_becomes_ready_never_leads(tmp_path, endpoints):
    endpoints.append(ReadyEndpoint(503))
    proc = sidecar(tmp_path, "unready", endpoints[0].url).start()
    try:
        proc.wait_http()
        time.sleep(3.0)  # more than a lease duration with nobody else contending
        assert proc.leader() == 503
        reason = get_json(proc.url + "/status")[1]["leases"][0]["reason"]
        assert reason.startswith("not campaigning: the application is not ready")
        assert "answered 503" in reason
        endpoints[0].status = 200  # ready now: it campaigns and leads
        wait_until(lambda: proc.leader() == 200, timeout=5)
    finally:
        proc.stop()


def test_a_leader_whose_application_turns_unready_hands_over(tmp_path, endpoints):
    endpoints.extend([ReadyEndpoint(200), ReadyEndpoint(200)])
    procs = [sidecar(tmp_path, f"app-{i}", endpoints[i].url) for i in range(2)]
    with serving(procs):
        with ClaimRecorder(procs) as recorder:
            leader = wait_until(lambda: one_leader(procs), timeout=10)
            other = procs[1 - procs.index(leader)]
            time.sleep(0.5)
            endpoints[procs.index(leader)].status = 500
            turned = time.monotonic()
            wait_until(lambda: other.leader() == 200, timeout=10, interval=0.01)
            took = time.monotonic() - turned
            time.sleep(0.3)
        assert recorder.overlaps() == []
        # The period, one poll (a renew interval), then one hand-over (two horizons, ...).
        assert UNREADY_AFTER <= took <= UNREADY_AFTER + 0.3 + 1.0, took
        assert leader.leader() == 503
        assert metric(leader, 'lease_sidecar_handovers_total{lease="handover",'
                              'reason="app-unready"}') == 1.0
        assert metric(leader, "lease_sidecar_app_unready_leading_seconds_total") >= 0.5


# -- in a pod: LEASE_APP_READY_CONTAINERS, the own pod watched on a real apiserver -------

def container_ready(cp, namespace: str, pod: str, ready: bool) -> None:
    """Write the pod's container status as kubelet would (the test bed has no kubelet)."""
    status = {"containerStatuses": [{
        "name": "app", "ready": ready, "restartCount": 0, "image": "registry.invalid/app:1",
        "imageID": "", "started": True, "state": {"running": {"startedAt": None}}}]}
    cp.kubectl("-n", namespace, "patch", "pod", pod, "--subresource=status",
               "--type=merge", "-p", json.dumps({"status": status}))


@pytest.mark.kube
def test_in_a_pod_the_app_containers_readiness_decides(control_plane, kube_namespace,
                                                       tmp_path):
    cp, namespace = control_plane, kube_namespace
    kubeconfig = install_rbac(cp, namespace)
    create_pods(cp, namespace, "pod-a", "pod-b")
    for pod in ("pod-a", "pod-b"):
        container_ready(cp, namespace, pod, False)
    procs = [SidecarProcess(tmp_path, pod, args=[
        "--dsn", str(tmp_path / "leases.db"), "--name", "handover", *FAST,
        "--pod-label", "off", "--app-ready-containers", "app",
        "--app-unready-after", f"{UNREADY_AFTER}s"],
        env={"POD_NAME": pod, "POD_NAMESPACE": namespace, "KUBECONFIG": str(kubeconfig)},
    ) for pod in ("pod-a", "pod-b")]
    with serving(procs):
        time.sleep(2.5)  # more than a lease duration: nobody may lead while not Ready
        assert [p.leader() for p in procs] == [503, 503]
        reason = get_json(procs[0].url + "/status")[1]["leases"][0]["reason"]
        assert "container app is not Ready" in reason, reason
        container_ready(cp, namespace, "pod-a", True)
        wait_until(lambda: procs[0].leader() == 200, timeout=5)
        container_ready(cp, namespace, "pod-b", True)
        time.sleep(0.5)
        with ClaimRecorder(procs) as recorder:
            container_ready(cp, namespace, "pod-a", False)
            turned = time.monotonic()
            wait_until(lambda: procs[1].leader() == 200, timeout=10, interval=0.01)
            took = time.monotonic() - turned
            time.sleep(0.3)
        assert recorder.overlaps() == []
        assert UNREADY_AFTER <= took <= UNREADY_AFTER + 0.3 + 1.0, took
        assert metric(procs[0], 'lease_sidecar_handovers_total{lease="handover",'
                                'reason="app-unready"}') == 1.0


@pytest.mark.kube
@pytest.mark.postgres
def test_an_apiserver_outage_keeps_a_database_backed_leader(control_plane, kube_namespace,
                                                           pg_dsn, tmp_path):
    """The lease lives in PostgreSQL; the apiserver goes away for 8 times
    LEASE_APP_UNREADY_AFTER. The pod watch failing used to count as "not ready": the
    leader handed over after 1 s and no standby campaigned, so nobody led until the
    apiserver was back. Now the last readiness seen counts for
    LEASE_APP_READY_OUTAGE_GRACE (5 min by default; a 60 s outage scaled down)."""
    cp, namespace = control_plane, kube_namespace
    kubeconfig = install_rbac(cp, namespace)
    create_pods(cp, namespace, "pod-a", "pod-b")
    for pod in ("pod-a", "pod-b"):
        container_ready(cp, namespace, pod, True)
    procs = [SidecarProcess(tmp_path, pod, args=[
        "--backend", "postgres", "--dsn", pg_dsn, "--name", "outage", *FAST,
        "--pod-label", "off", "--app-ready-containers", "app",
        "--app-unready-after", f"{UNREADY_AFTER}s"],
        env={"POD_NAME": pod, "POD_NAMESPACE": namespace, "KUBECONFIG": str(kubeconfig)},
    ) for pod in ("pod-a", "pod-b")]
    with serving(procs):
        leader = wait_until(lambda: one_leader(procs), timeout=15)
        time.sleep(1.0)  # both pod watches have seen their pods Ready
        samples: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append(leader.leader(timeout=1.0))
                stop.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        with ClaimRecorder(procs) as recorder:
            sampler.start()
            try:
                cp.restart_apiserver(down_for=8 * UNREADY_AFTER)
            finally:
                stop.set()
                sampler.join(5)
        assert recorder.overlaps() == []
        assert samples and set(samples) == {200}, samples
        assert metric(leader, 'lease_sidecar_handovers_total{lease="outage",'
                              'reason="app-unready"}') == 0.0
        assert "cannot watch the own pod" in leader.logs()
