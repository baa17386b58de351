"""The chart's ValidatingAdmissionPolicy narrows the pod-patch power of the sidecar's
ServiceAccounts, proven against the real kube-apiserver: installed with `helm install`,
patches sent as those accounts (with tokens bound to a pod, as kubelet mounts them, and
unbound), and real sidecars keeping their labels under it.

RBAC alone lets these accounts patch anything of every pod in the namespace (labels, the
image): ``resourceNames`` cannot name the pods of a Deployment.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from testkit.chart_support import (
    CHART,
    documents,
    find,
    helm,
    set_args,
    template,
)
from testkit.kube_support import install_rbac
from testkit.support import REPO, SidecarProcess, one_leader, wait_until
from testkit.testbed.kube import ControlPlane, render_kubeconfig

pytestmark = pytest.mark.kube

RELEASE = "pp"
ACCOUNT = "pp-lease-sidecar"
POLICY_KIND = "ValidatingAdmissionPolicy"


@dataclass
class Bed:
    cp: ControlPlane
    namespace: str
    policy: str

    def pod(self, name: str, labels: dict[str, str] | None = None) -> None:
        self.cp.kubectl("-n", self.namespace, "apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name,
                         "labels": {"app": "shop", **(labels or {})},
                         "annotations": {"team": "payments"}},
            "spec": {"serviceAccountName": ACCOUNT,
                     "containers": [{"name": "app", "image": "example.invalid/app:1"}]}}))

    def get(self, name: str) -> dict[str, Any]:
        return json.loads(self.cp.kubectl("-n", self.namespace, "get", "pod", name, "-o",
                                          "json").stdout)

    def kubeconfig(self, bound_to: str | None = None) -> Path:
        """A kubeconfig of the release's ServiceAccount; with ``bound_to``, its token is
        bound to that pod, as the token kubelet mounts into a pod is."""
        if bound_to is None:
            return self.cp.service_account_kubeconfig(self.namespace, ACCOUNT, create=False)
        uid = self.get(bound_to)["metadata"]["uid"]
        token = self.cp.kubectl(
            "-n", self.namespace, "create", "token", ACCOUNT, "--duration=2h",
            "--bound-object-kind=Pod", f"--bound-object-name={bound_to}",
            f"--bound-object-uid={uid}").stdout.strip()
        path = self.cp.workdir / f"pp-{self.namespace}-{bound_to}.kubeconfig"
        path.write_text(render_kubeconfig(self.cp.server, self.cp.ca_cert,
                                          f"system:serviceaccount:{self.namespace}:{ACCOUNT}",
                                          {"token": token}, self.namespace))
        return path

    def patch(self, kubeconfig: Path | None, pod: str, body: dict[str, Any],
              kind: str = "merge") -> subprocess.CompletedProcess[str]:
        return self.cp.kubectl("-n", self.namespace, "patch", "pod", pod, f"--type={kind}",
                               "-p", json.dumps(body), kubeconfig=kubeconfig, check=False)


def _labels(**labels: str | None) -> dict[str, Any]:
    return {"metadata": {"labels": {k.replace("_", "-"): v for k, v in labels.items()}}}


ROLE = "lease-role"
GROUP = "lease-sidecar/group"
LEASE_ANNOTATION = "lease-sidecar/lease"
SHARDS_ANNOTATION = "lease-sidecar/shards"


@pytest.fixture(scope="module")
def bed(control_plane: ControlPlane) -> Iterator[Bed]:
    cp = control_plane
    namespace = cp.create_namespace("pp")
    kubeconfig = ["--kubeconfig", str(cp.kubeconfig), "--namespace", namespace]
    values = ["lease.name=jobs", "rbac.extraServiceAccounts={web}"]
    helm("install", RELEASE, str(CHART), *kubeconfig, *set_args(values))
    policy = f"{namespace}-{RELEASE}-lease-sidecar-pod-patch"
    result = Bed(cp, namespace, policy)
    try:
        result.pod("probe")
        # Policies reach the apiserver's admission within moments: wait until it denies.
        # (A new value each time: a patch that changes nothing is allowed.)
        deadline = time.monotonic() + 30
        attempt = 0
        while result.patch(result.kubeconfig(), "probe",
                           _labels(app=f"x{attempt}")).returncode == 0:
            assert time.monotonic() < deadline, "the policy never took effect"
            attempt += 1
            time.sleep(0.3)
        yield result
    finally:
        helm("uninstall", RELEASE, *kubeconfig)


def test_policy_binds_the_release_accounts_only(bed: Bed) -> None:
    policy = json.loads(bed.cp.kubectl("get", "validatingadmissionpolicy", bed.policy,
                                       "-o", "json").stdout)
    condition = policy["spec"]["matchConditions"][0]["expression"]
    assert condition == (f'request.userInfo.username in ["system:serviceaccount:'
                         f'{bed.namespace}:{ACCOUNT}","system:serviceaccount:'
                         f'{bed.namespace}:web"]')
    # Every expression compiled and type-checked against the Pod schema.
    assert not policy.get("status", {}).get("typeChecking", {}).get("expressionWarnings")
    binding = json.loads(bed.cp.kubectl("get", "validatingadmissionpolicybinding", bed.policy,
                                        "-o", "json").stdout)
    assert binding["spec"]["validationActions"] == ["Deny"]
    # RBAC alone still allows the patch: the policy is what narrows it.
    can = bed.cp.kubectl("auth", "can-i", "patch", "pods", "-n", bed.namespace,
                         kubeconfig=bed.kubeconfig()).stdout.strip()
    assert can == "yes"


@pytest.mark.parametrize("bound", [True, False], ids=["pod-token", "plain-token"])
def test_the_sidecar_may_set_its_lease_labels_and_annotation(bed: Bed, bound: bool) -> None:
    pod = f"own-{bound}".lower()
    bed.pod(pod)
    kubeconfig = bed.kubeconfig(pod if bound else None)
    body = {"metadata": {"labels": {ROLE: "leader", GROUP: "lease-sidecar.jobs"},
                         "annotations": {LEASE_ANNOTATION: '{"role": "leader"}',
                                         SHARDS_ANNOTATION: "12"}}}
    proc = bed.patch(kubeconfig, pod, body)
    assert proc.returncode == 0, proc.stderr
    for role in ("standby", "api", "leader"):
        assert bed.patch(kubeconfig, pod, _labels(lease_role=role)).returncode == 0
    meta = bed.get(pod)["metadata"]
    assert meta["labels"] == {"app": "shop", ROLE: "leader", GROUP: "lease-sidecar.jobs"}
    assert meta["annotations"][LEASE_ANNOTATION] == '{"role": "leader"}'
    assert meta["annotations"][SHARDS_ANNOTATION] == "12"


DENIED = [
    ("another label", _labels(app="attacker"), "merge",
     "may change only the lease-role and lease-sidecar/group labels"),
    ("a new label", _labels(tier="frontend"), "merge",
     "may change only the lease-role and lease-sidecar/group labels"),
    ("a removed label", _labels(app=None), "merge",
     "may change only the lease-role and lease-sidecar/group labels"),
    ("another annotation", {"metadata": {"annotations": {"team": "x"}}}, "merge",
     "may change only the lease-sidecar/lease and lease-sidecar/shards annotations"),
    ("a removed annotation", {"metadata": {"annotations": {"team": None}}}, "merge",
     "may change only the lease-sidecar/lease and lease-sidecar/shards annotations"),
    ("the image", {"spec": {"containers": [{"name": "app", "image": "example.invalid/evil:1"}]}},
     "strategic", "may not change a pod's spec"),
    ("a toleration", {"spec": {"tolerations": [{"key": "k", "operator": "Exists"}]}},
     "strategic", "may not change a pod's spec"),
    ("finalizers", {"metadata": {"finalizers": ["example.invalid/hold"]}}, "merge",
     "may not change a pod's owners or finalizers"),
    ("a role value", _labels(lease_role="boss"), "merge",
     "the lease-role label is leader, standby or api"),
]


@pytest.mark.parametrize(("what", "body", "kind", "message"), DENIED,
                         ids=[d[0].replace(" ", "-") for d in DENIED])
@pytest.mark.parametrize("bound", [True, False], ids=["pod-token", "plain-token"])
def test_anything_else_is_denied(bed: Bed, bound: bool, what: str, body: dict[str, Any],
                                 kind: str, message: str) -> None:
    pod = "victim"
    bed.pod(pod)
    before = bed.get(pod)
    proc = bed.patch(bed.kubeconfig(pod if bound else None), pod, body, kind)
    assert proc.returncode != 0, what
    assert f"ValidatingAdmissionPolicy '{bed.policy}'" in proc.stderr
    assert message in proc.stderr, proc.stderr
    after = bed.get(pod)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    # The same patch by someone else (the admin here) is none of the policy's business.
    assert bed.patch(None, pod, body, kind).returncode == 0, what
    bed.cp.kubectl("-n", bed.namespace, "delete", "pod", pod, "--wait=false")
    if "finalizers" in json.dumps(body):
        bed.patch(None, pod, {"metadata": {"finalizers": None}})
    wait_until(lambda: bed.cp.kubectl("-n", bed.namespace, "get", "pod", pod,
                                      check=False).returncode != 0, timeout=20)


def test_a_pod_token_promotes_only_its_own_pod(bed: Bed) -> None:
    """A sidecar may demote another pod of its group (leader → standby), never promote
    one: a Service selecting lease-role=leader cannot be pointed at another pod."""
    bed.pod("mine")
    bed.pod("theirs", labels={ROLE: "leader", GROUP: "lease-sidecar.jobs"})
    mine = bed.kubeconfig("mine")
    assert bed.patch(mine, "mine", _labels(lease_role="leader")).returncode == 0
    assert bed.patch(mine, "theirs", _labels(lease_role="standby")).returncode == 0
    for body in (_labels(lease_role="leader"), _labels(lease_role="api"),
                 {"metadata": {"labels": {GROUP: "other"}}},
                 {"metadata": {"annotations": {LEASE_ANNOTATION: "{}"}}},
                 {"metadata": {"annotations": {SHARDS_ANNOTATION: "0"}}}):
        proc = bed.patch(mine, "theirs", body)
        assert proc.returncode != 0, body
        assert ("a lease sidecar may change another pod only to demote it from leader to "
                "standby") in proc.stderr
    assert bed.get("theirs")["metadata"]["labels"][ROLE] == "standby"
    # A token bound to no pod cannot be told apart from its holder's own: allowed (the
    # tokens kubelet mounts are always bound).
    assert bed.patch(bed.kubeconfig(), "theirs", _labels(lease_role="leader")).returncode == 0


def test_real_sidecars_keep_and_demote_labels_under_the_policy(bed: Bed,
                                                               tmp_path: Path) -> None:
    """Two sidecars with pod-bound tokens: the leader labels itself; after it is killed
    (no cleanup) the new leader labels itself and demotes the stale label of the other
    pod, all through the policy."""
    names = ["worker-a", "worker-b"]
    for name in names:
        bed.pod(name)
    procs = [SidecarProcess(tmp_path, name, args=[
        "--backend", "kubernetes", "--name", "jobs", "--lease-duration", "3s",
        "--renew-interval", "500ms", "--renew-deadline", "2s"],
        env={"POD_NAME": name, "POD_NAMESPACE": bed.namespace,
             "KUBECONFIG": str(bed.kubeconfig(name))}).start() for name in names]

    def roles() -> dict[str, str | None]:
        return {n: bed.get(n)["metadata"].get("labels", {}).get(ROLE) for n in names}

    try:
        for proc in procs:
            proc.wait_http()
        leader = wait_until(lambda: one_leader(procs), timeout=20)
        first = names[procs.index(leader)]
        other = next(n for n in names if n != first)
        wait_until(lambda: roles() == {first: "leader", other: "standby"}, timeout=10)
        leader.signal(signal.SIGKILL)
        leader.proc.wait(10)
        survivor = procs[names.index(other)]
        wait_until(lambda: survivor.leader() == 200, timeout=20)
        wait_until(lambda: roles() == {first: "standby", other: "leader"}, timeout=10)
    finally:
        for proc in procs:
            proc.stop()
    logs = "".join(p.logs() for p in procs)
    assert "demoted stale leader label" in logs
    for problem in ("denied", "Forbidden", "pod label not set", "reconcile failed"):
        assert problem not in logs, problem


@pytest.mark.parametrize(("values", "extra", "rendered"), [
    ([], [], True),
    (["rbac.podPatchPolicy=false"], [], False),
    (["lease.podLabel=off"], [], False),
    (["rbac.create=false"], [], False),
], ids=["default", "off", "no-pod-label", "no-rbac"])
def test_rendered_when_wanted(values: list[str], extra: list[str], rendered: bool) -> None:
    kinds = {d["kind"] for d in documents(template("r", "apps", values).stdout)}
    assert ({POLICY_KIND, f"{POLICY_KIND}Binding"} <= kinds) is rendered


def test_not_rendered_before_kubernetes_1_30() -> None:
    def kinds(*args: str) -> set[str]:
        proc = helm("template", "r", str(CHART), "--namespace", "apps", *args)
        return {d["kind"] for d in documents(proc.stdout)}

    assert POLICY_KIND not in kinds("--kube-version", "v1.29.4")
    # A 1.29 cluster serving the API (a feature gate) says so through its API versions.
    assert POLICY_KIND in kinds("--kube-version", "v1.29.4", "--api-versions",
                                "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy")


DEPLOY_POLICY = REPO / "deploy" / "pod-patch-policy.yaml"


def test_deploy_policy_has_the_charts_rules() -> None:
    """deploy/pod-patch-policy.yaml (for deploy/rbac.yaml's account, named lease-sidecar
    in any namespace) and the chart's policy differ only in whom they match."""
    deploy = find(documents(DEPLOY_POLICY.read_text()), POLICY_KIND)["spec"]
    chart = find(documents(template("r", "apps", []).stdout), POLICY_KIND)["spec"]
    assert deploy.pop("matchConditions") != chart.pop("matchConditions")
    assert deploy == chart


def test_deploy_policy_narrows_the_deploy_account(control_plane: ControlPlane,
                                                  kube_namespace: str) -> None:
    cp = control_plane
    sa = install_rbac(cp, kube_namespace)
    cp.kubectl("-n", kube_namespace, "apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0", "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "app", "image": "example.invalid/app:1"}]}}))
    bed = Bed(cp, kube_namespace, "lease-sidecar-pod-patch")
    # Before the policy: RBAC alone lets the account relabel the pod.
    assert bed.patch(sa, "web-0", _labels(app="hijacked")).returncode == 0
    cp.kubectl("apply", "-f", str(DEPLOY_POLICY))
    try:
        deadline = time.monotonic() + 30
        attempt = 0
        while (proc := bed.patch(sa, "web-0", _labels(app=f"x{attempt}"))).returncode == 0:
            assert time.monotonic() < deadline, "the policy never took effect"
            attempt += 1
            time.sleep(0.3)
        assert "may change only the lease-role and lease-sidecar/group labels" in proc.stderr
        assert bed.patch(sa, "web-0", _labels(lease_role="leader")).returncode == 0
        image = {"spec": {"containers": [{"name": "app", "image": "example.invalid/evil:1"}]}}
        proc = bed.patch(sa, "web-0", image, "strategic")
        assert proc.returncode != 0 and "may not change a pod's spec" in proc.stderr
    finally:
        # Cluster-wide: it must not outlive this test (other tests use this account too).
        cp.kubectl("delete", "-f", str(DEPLOY_POLICY), check=False)
