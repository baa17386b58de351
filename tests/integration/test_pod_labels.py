"""The ``lease-role`` pod label against a real kube-apiserver.

Real sidecar processes (kubernetes backend, 3 s lease) label Pending Pod objects as the
deploy/rbac.yaml ServiceAccount; assertions read ``kubectl get pods -L lease-role`` and,
for the order of writes, the resourceVersions of a watch (one etcd revision counter
orders pod and lease writes alike).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.kube_support import (
    LeaderLabels,
    Recorder,
    create_pods,
    install_rbac,
    leaders,
    lease_spec,
    lease_token,
    role_column,
    sidecars_in_pods,
)
from testkit.support import SidecarProcess, get_json, wait_until
from testkit.testbed.kube import ControlPlane

pytestmark = [pytest.mark.kube, pytest.mark.slow]

PODS = ("web-0", "web-1", "web-2")
API_POD = "api-0"


@pytest.fixture
def group(control_plane: ControlPlane, kube_namespace: str,
          tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    """Three contenders and one ``--role api`` sidecar, each in its own pod."""
    kubeconfig = install_rbac(control_plane, kube_namespace)
    yield from sidecars_in_pods(control_plane, kube_namespace, tmp_path, kubeconfig,
                                (*PODS, API_POD), extra={API_POD: ("--role", "api")})


def settled(cp: ControlPlane, ns: str, leader: str, standbys: list[str],
            timeout: float = 5) -> dict[str, str]:
    """Wait until the column shows exactly this picture; return it."""
    want = {leader: "leader", **dict.fromkeys(standbys, "standby"), API_POD: "api"}
    return wait_until(lambda: (roles := role_column(cp, ns)) == want and roles,
                      timeout=timeout, interval=0.1)


def pod(cp: ControlPlane, ns: str, name: str) -> dict:
    return json.loads(cp.kubectl("-n", ns, "get", "pod", name, "-o", "json").stdout)


def test_kubectl_shows_one_leader_the_standbys_and_the_api_pod(
    control_plane: ControlPlane, kube_namespace: str, group: list[SidecarProcess]
) -> None:
    leader = leaders(group[:3])[0]
    standbys = [p.identity for p in group[:3] if p is not leader]
    roles = settled(control_plane, kube_namespace, leader.identity, standbys)
    assert list(roles.values()).count("leader") == 1
    # The annotation tells who, which lease and which fencing token.
    meta = pod(control_plane, kube_namespace, leader.identity)["metadata"]
    note = json.loads(meta["annotations"]["lease-sidecar/lease"])
    spec = lease_spec(control_plane, kube_namespace)
    until = note.pop("valid_until")  # the term's first claim, for the operator
    assert until > spec["acquireTime"]
    assert note == {"lease": "jobs", "identity": leader.identity, "role": "leader",
                    "fencing_token": lease_token(control_plane, kube_namespace),
                    "backend": "kubernetes",
                    "object": "lease-sidecar.jobs"}
    assert meta["labels"]["lease-sidecar/group"] == "lease-sidecar.jobs"
    api = pod(control_plane, kube_namespace, API_POD)["metadata"]
    assert json.loads(api["annotations"]["lease-sidecar/lease"])["role"] == "api"
    assert get_json(group[3].url + "/leader")[1]["role"] == "api"


def test_sigterm_unpublishes_before_it_releases(
    control_plane: ControlPlane, kube_namespace: str, group: list[SidecarProcess]
) -> None:
    old = leaders(group[:3])[0]
    rest = [p for p in group[:3] if p is not old]
    recorder = Recorder(control_plane.kubeconfig, kube_namespace).start()
    try:
        time.sleep(0.5)
        sent = time.monotonic()
        old.signal(signal.SIGTERM)
        new = wait_until(lambda: leaders(rest), timeout=5)[0]
        unlabelled = recorder.first(sent, 5, lambda e: e.kind == "pod"
                                    and e.name == old.identity and e.role == "standby")
        released = recorder.first(sent, 5, lambda e: e.kind == "lease" and e.holder == "")
        labelled = recorder.first(sent, 5, lambda e: e.kind == "pod"
                                  and e.name == new.identity and e.role == "leader")
        taken = recorder.first(sent, 5, lambda e: e.kind == "lease"
                               and e.holder == new.identity)
    finally:
        recorder.stop()
    # Unpublish, then release; acquire, then publish.
    assert unlabelled.version < released.version < taken.version < labelled.version
    settled(control_plane, kube_namespace, new.identity,
            [p.identity for p in group[:3] if p is not new])


def test_a_killed_leaders_label_is_demoted_once_the_lease_moved(
    control_plane: ControlPlane, kube_namespace: str, group: list[SidecarProcess]
) -> None:
    old = leaders(group[:3])[0]
    rest = [p for p in group[:3] if p is not old]
    old.signal(signal.SIGKILL)
    time.sleep(1.0)
    # Nobody cleaned up, and the lease has not moved yet: the stale label stays.
    assert role_column(control_plane, kube_namespace)[old.identity] == "leader"
    new = wait_until(lambda: leaders(rest), timeout=8)[0]
    roles = settled(control_plane, kube_namespace, new.identity,
                    [p.identity for p in group[:3] if p is not new], timeout=3)
    assert roles[old.identity] == "standby"


def test_labels_converge_after_pods_patch_is_revoked_and_restored(
    control_plane: ControlPlane, kube_namespace: str, group: list[SidecarProcess]
) -> None:
    """Issue 19, item 5, without any operator: with ``patch`` on pods revoked the leader
    is SIGTERMed (its standby label is refused) and a standby takes over (its leader label
    is refused); once the Role is back, the labels are right within 5 s: the new leader's
    own write and its demotion of the dead pod are retried until they work."""
    cp, ns = control_plane, kube_namespace
    old = leaders(group[:3])[0]
    rest = [p for p in group[:3] if p is not old]
    settled(cp, ns, old.identity, [p.identity for p in rest])
    verbs = "/rules/0/verbs"
    with LeaderLabels(cp, ns) as poller:
        cp.kubectl("-n", ns, "patch", "role", "lease-sidecar", "--type=json", "-p",
                   json.dumps([{"op": "replace", "path": verbs,
                                "value": ["get", "list", "watch"]}]))
        try:
            time.sleep(0.5)
            old.signal(signal.SIGTERM)
            new = wait_until(lambda: leaders(rest), timeout=8)[0]
            time.sleep(3.0)  # several refused retries
            roles = role_column(cp, ns)
            assert roles[old.identity] == "leader" and roles[new.identity] == "standby"
        finally:
            cp.kubectl("-n", ns, "patch", "role", "lease-sidecar", "--type=json", "-p",
                       json.dumps([{"op": "replace", "path": verbs,
                                    "value": ["get", "list", "watch", "patch"]}]))
        restored = time.monotonic()
        settled(cp, ns, new.identity, [p.identity for p in group[:3] if p is not new],
                timeout=5)
        assert time.monotonic() - restored < 5
    poller.assert_never_two_longer_than(5)
    assert "pod label written again" in new.logs()


def test_every_new_leader_demotes_the_groups_other_leader_labels(
    control_plane: ControlPlane, kube_namespace: str, group: list[SidecarProcess]
) -> None:
    """Without any operator, on two leadership changes in a row: the new leader lists the
    namespace's pods labelled ``leader`` and demotes every other one of its group to
    ``standby``, within 5 s of its term beginning. First a pod whose sidecar died leading
    and whose group label was edited since (found by its annotation) while the leader is
    SIGTERMed; then the label of a leader SIGKILLed (nobody cleaned up)."""
    cp, ns = control_plane, kube_namespace
    contenders = group[:3]
    first = leaders(contenders)[0]
    settled(cp, ns, first.identity, [p.identity for p in contenders if p is not first])
    dead = "web-9"
    create_pods(cp, ns, dead)
    cp.kubectl("-n", ns, "annotate", "pod", dead, "lease-sidecar/lease=" + json.dumps({
        "lease": "jobs", "identity": dead, "role": "leader", "fencing_token": 1,
        "object": "lease-sidecar.jobs", "backend": "kubernetes"}))
    with LeaderLabels(cp, ns) as poller:
        cp.kubectl("-n", ns, "label", "pod", dead, "lease-role=leader",
                   "lease-sidecar/group=elsewhere")
        first.signal(signal.SIGTERM)
        second = wait_until(lambda: leaders([p for p in contenders if p is not first]),
                            timeout=8)[0]
        began = time.monotonic()
        settled(cp, ns, second.identity,
                [p.identity for p in contenders if p is not second] + [dead], timeout=5)
        assert time.monotonic() - began < 5
        assert "demoted stale leader label" in second.logs()

        second.signal(signal.SIGKILL)
        last = wait_until(lambda: leaders([p for p in contenders
                                           if p not in (first, second)]), timeout=8)[0]
        began = time.monotonic()
        roles = settled(cp, ns, last.identity,
                        [p.identity for p in contenders if p is not last] + [dead],
                        timeout=5)
        assert time.monotonic() - began < 5
        assert roles[second.identity] == "standby"
    poller.assert_never_two_longer_than(5)
