"""``lease-sidecar operator`` keeps the ``lease-role`` labels true, on the real apiserver.

Real sidecar processes (kubernetes backend, 3 s lease, the deploy/rbac.yaml ServiceAccount)
label Pending Pod objects; one real operator process (labels only, no webhook, admin
credentials, this test's namespace) puts right what the sidecars do not: labels edited by
hand, group labels edited or removed (issue 19, item 6), the label of a holder killed with
nobody to take over; and labels and sidecars converge after a 90 s apiserver outage. A
poller (:class:`LeaderLabels`) checks that two pods never say ``leader`` for 5 s or more.
Repair times come from one admin watch (:class:`Recorder`): when the wrong label arrived
and when the right one did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.kube_support import (
    LeaderLabels,
    Recorder,
    install_rbac,
    leaders,
    lease_spec,
    role_column,
    sidecars_in_pods,
)
from testkit.procs import free_port
from testkit.support import REPO, SidecarProcess, get_json, unix_time, wait_until
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
    yield from sidecars_in_pods(control_plane, kube_namespace, tmp_path, kubeconfig, PODS)


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


def repair_time(recorder: Recorder, after: float, pod: str, wrong: str, right: str) -> float:
    """Seconds from the watch delivering ``pod`` labelled ``wrong`` (at or after
    monotonic ``after``) to it delivering the same pod labelled ``right`` again."""
    appeared = recorder.first(after, 5, lambda e: e.kind == "pod" and e.name == pod
                              and e.role == wrong)
    repaired = recorder.first(appeared.at, 5, lambda e: e.kind == "pod" and e.name == pod
                              and e.role == right and e.version > appeared.version)
    return repaired.at - appeared.at


def test_labels_edited_by_hand_are_put_back_within_a_second(
        control_plane: ControlPlane, kube_namespace: str,
        group: list[SidecarProcess]) -> None:
    cp, ns = control_plane, kube_namespace
    leader = leaders(group)[0].identity
    settle(cp, ns, picture(leader), 5)
    standby = next(p for p in PODS if p != leader)
    recorder = Recorder(cp.kubeconfig, ns).start()
    try:
        time.sleep(0.5)  # the watch is open
        with LeaderLabels(cp, ns) as poller:
            sent = time.monotonic()
            cp.kubectl("-n", ns, "label", "pod", standby, "lease-role=leader", "--overwrite")
            assert repair_time(recorder, sent, standby, "leader", "standby") < 1.0
            sent = time.monotonic()
            cp.kubectl("-n", ns, "label", "pod", leader, "lease-role=standby", "--overwrite")
            assert repair_time(recorder, sent, leader, "standby", "leader") < 1.0
            settle(cp, ns, picture(leader), 1.5)
        poller.assert_never_two_longer_than(5)
    finally:
        recorder.stop()


def test_a_dead_holders_label_goes_within_a_second_of_its_lease_running_out(
        control_plane: ControlPlane, kube_namespace: str,
        group: list[SidecarProcess]) -> None:
    """Every sidecar SIGKILLed, so no new leader demotes the holder's label: the operator
    does, by the Lease's truth, once the Lease has run out and not before."""
    cp, ns = control_plane, kube_namespace
    holder = leaders(group)[0]
    settle(cp, ns, picture(holder.identity), 5)
    recorder = Recorder(cp.kubeconfig, ns).start()
    try:
        time.sleep(0.5)  # the watch is open
        with LeaderLabels(cp, ns) as poller:
            for proc in group:
                if proc is not holder:
                    proc.signal(signal.SIGKILL)
            killed = time.monotonic()
            holder.signal(signal.SIGKILL)
            demoted = recorder.first(killed, 10, lambda e: e.kind == "pod"
                                     and e.name == holder.identity and e.role == "standby")
        poller.assert_never_two_longer_than(5)
    finally:
        recorder.stop()
    spec = lease_spec(cp, ns)
    assert spec["holderIdentity"] == holder.identity  # nobody took over
    renewed = unix_time(spec["renewTime"])
    ran_out = renewed + spec["leaseDurationSeconds"]
    assert ran_out <= demoted.wall < ran_out + 1.0
    assert role_column(cp, ns) == dict.fromkeys(PODS, "standby")


@pytest.mark.parametrize("edit", ["lease-sidecar/group=elsewhere", "lease-sidecar/group-"])
def test_a_pod_whose_group_label_is_edited_is_put_back(
        control_plane: ControlPlane, kube_namespace: str, group: list[SidecarProcess],
        edit: str) -> None:
    """Issue 19, item 6: the edit used to leave the pod out of the watch for good."""
    cp, ns = control_plane, kube_namespace
    leader = leaders(group)[0].identity
    settle(cp, ns, picture(leader), 5)
    standby = next(p for p in PODS if p != leader)

    def group_labels() -> dict[str, str]:
        out = cp.kubectl("-n", ns, "get", "pods", "-o",
                         "jsonpath={range .items[*]}{.metadata.name}="
                         "{.metadata.labels['lease-sidecar/group']} {end}").stdout
        return dict(item.split("=", 1) for item in out.split())

    with LeaderLabels(cp, ns) as poller:
        # The worst case: the pod leaves the group and says leader.
        sent = time.monotonic()
        cp.kubectl("-n", ns, "label", "pod", standby, edit, "lease-role=leader",
                   "--overwrite")
        wait_until(lambda: set(group_labels().values()) == {"lease-sidecar.jobs"},
                   timeout=5, interval=0.1)
        settle(cp, ns, picture(leader), 2)
        assert time.monotonic() - sent < 5
    poller.assert_never_two_longer_than(5)


def shown(cp: ControlPlane, ns: str, group: list[SidecarProcess]) -> bool:
    """Whether the labels and each pod's annotation say what the sidecars' ``/leader``
    says, with one leader."""
    truth = {p.identity: "leader" if p.leader() == 200 else "standby" for p in group}
    pods = json.loads(cp.kubectl("-n", ns, "get", "pods", "-o", "json").stdout)["items"]
    labels = {p["metadata"]["name"]: p["metadata"]["labels"].get("lease-role") for p in pods}
    notes = {p["metadata"]["name"]: json.loads(
        p["metadata"]["annotations"]["lease-sidecar/lease"])["role"] for p in pods}
    return list(truth.values()).count("leader") == 1 and labels == notes == truth


def test_labels_are_right_within_5s_after_a_90s_apiserver_outage(
        control_plane: ControlPlane, kube_namespace: str, group: list[SidecarProcess],
        operator: subprocess.Popen[bytes]) -> None:
    """kube-apiserver stopped for 90 s and started again on the same etcd: nobody can
    renew, write a label or read one meanwhile. Within 5 s of it answering again a new
    term has begun and every label and annotation says who leads: the sidecars retried
    their own writes (the annotations are theirs alone) and the operator re-judged."""
    cp, ns = control_plane, kube_namespace
    settle(cp, ns, picture(leaders(group)[0].identity), 5)
    with LeaderLabels(cp, ns) as poller:
        cp.restart_apiserver(down_for=90)
        back = time.monotonic()
        wait_until(lambda: shown(cp, ns, group), timeout=5, interval=0.1)
        assert time.monotonic() - back < 5
    poller.assert_never_two_longer_than(5)
    assert operator.poll() is None
    # The old holder's keeper retried its refused step-down write all along; it says so
    # on its first try that works, at most one backoff (2 s) after the apiserver is back
    # (a new term's own write may have put its labels right before that).
    wait_until(lambda: any("pod label written again" in p.logs() for p in group),
               timeout=3, interval=0.1)
