"""deploy/rbac.yaml is the least that works: real RBAC on a real kube-apiserver.

A ServiceAccount bound to exactly that Role (applied from the file) may do what the
sidecar needs in its own namespace and nothing else; ``kubectl auth can-i`` answers as
that ServiceAccount (from its own token), and real requests confirm both the allowed and
the denied side. The other kube tests run every sidecar as this ServiceAccount, which
shows the Role is also enough.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from testkit.kube_support import RBAC, create_pods, install_rbac
from testkit.testbed.kube import ControlPlane

pytestmark = pytest.mark.kube

OURS = "leases.coordination.k8s.io/lease-sidecar.jobs"  # the Lease install_rbac names
THEIRS = "leases.coordination.k8s.io/kube-scheduler"  # another controller's Lease
ALLOWED = [(verb, "pods") for verb in ("get", "list", "watch", "patch")] + [
    (verb, OURS) for verb in ("get", "list", "watch", "update")] + [
    ("create", "leases.coordination.k8s.io")] + [
    (verb, "events") for verb in ("create", "patch")]
DENIED = [("delete", "pods"), ("create", "pods"), ("update", "pods"), ("get", "secrets"),
          ("list", "configmaps"), ("delete", "events"), ("update", "events"),
          ("list", "events"), ("create", "events.events.k8s.io"), ("delete", OURS), ("patch", OURS),
          ("get", "roles.rbac.authorization.k8s.io"),
          # Other Leases of the namespace: not even readable, let alone writable.
          *((verb, THEIRS) for verb in ("get", "list", "watch", "update", "patch", "delete")),
          ("update", "leases.coordination.k8s.io"), ("list", "leases.coordination.k8s.io")]


def can_i(cp: ControlPlane, kubeconfig: Path, namespace: str, verb: str, resource: str) -> str:
    proc = cp.kubectl("auth", "can-i", verb, resource, "-n", namespace,
                      kubeconfig=kubeconfig, check=False)
    return proc.stdout.strip()


@pytest.fixture
def sa(control_plane: ControlPlane, kube_namespace: str) -> Path:
    return install_rbac(control_plane, kube_namespace)


def test_the_file_grants_exactly_the_sidecars_rules() -> None:
    role = next(d for d in yaml.safe_load_all(RBAC.read_text()) if d["kind"] == "Role")
    granted = {(group, resource, verb, tuple(rule.get("resourceNames", ())))
               for rule in role["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]
               for verb in rule["verbs"]}
    named = ("lease-sidecar.default",)
    assert granted == (
        {("", "pods", verb, ()) for verb in ("get", "list", "watch", "patch")}
        | {("coordination.k8s.io", "leases", verb, named)
           for verb in ("get", "list", "watch", "update")}
        | {("coordination.k8s.io", "leases", "create", ())}
        | {("", "events", verb, ()) for verb in ("create", "patch")})
    assert all("nonResourceURLs" not in rule for rule in role["rules"])


@pytest.mark.parametrize(("verb", "resource"), ALLOWED)
def test_can_do_what_the_sidecar_needs(control_plane: ControlPlane, kube_namespace: str,
                                       sa: Path, verb: str, resource: str) -> None:
    assert can_i(control_plane, sa, kube_namespace, verb, resource) == "yes"


@pytest.mark.parametrize(("verb", "resource"), DENIED)
def test_cannot_do_anything_else(control_plane: ControlPlane, kube_namespace: str,
                                 sa: Path, verb: str, resource: str) -> None:
    assert can_i(control_plane, sa, kube_namespace, verb, resource) == "no"


def test_nothing_in_another_namespace(control_plane: ControlPlane, kube_namespace: str,
                                      sa: Path) -> None:
    other = control_plane.create_namespace()
    for verb, resource in ALLOWED:
        assert can_i(control_plane, sa, other, verb, resource) == "no", (verb, resource)


def test_real_requests_as_the_service_account(control_plane: ControlPlane,
                                              kube_namespace: str, sa: Path) -> None:
    cp, ns = control_plane, kube_namespace
    other = cp.create_namespace()
    create_pods(cp, ns, "mine")
    # A pod in another namespace (default ServiceAccount: ours exists only in ``ns``).
    cp.kubectl("-n", other, "run", "theirs", "--image=registry.invalid/app:1",
               "--restart=Never")

    def run(*args: str) -> tuple[int, str]:
        proc = cp.kubectl(*args, kubeconfig=sa, check=False)
        return proc.returncode, proc.stdout + proc.stderr

    # Allowed: label our own pod, read pods, create and update a Lease.
    assert run("-n", ns, "label", "pod", "mine", "lease-role=standby")[0] == 0
    code, out = run("-n", ns, "get", "pods", "-o", "json")
    assert code == 0 and [p["metadata"]["name"] for p in json.loads(out)["items"]] == ["mine"]
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": "lease-sidecar.jobs"}, "spec": {"holderIdentity": "mine"}}
    assert cp.kubectl("-n", ns, "create", "-f", "-", kubeconfig=sa,
                      input=json.dumps(lease), check=False).returncode == 0
    lease["spec"]["holderIdentity"] = ""
    assert cp.kubectl("-n", ns, "replace", "-f", "-", kubeconfig=sa,
                      input=json.dumps(lease), check=False).returncode == 0
    # Its watch: a list with a metadata.name field selector, which RBAC checks by name.
    code, out = run("-n", ns, "get", "leases", "--field-selector",
                    "metadata.name=lease-sidecar.jobs", "-o", "name")
    assert code == 0 and out.strip() == "lease.coordination.k8s.io/lease-sidecar.jobs"

    # Denied, by the apiserver: each answer is a 403 naming the missing verb.
    for args in (("-n", ns, "delete", "pod", "mine", "--wait=false"),
                 ("-n", ns, "get", "secrets"),
                 ("-n", ns, "delete", "lease", "lease-sidecar.jobs"),
                 ("-n", ns, "get", "leases"),
                 ("-n", other, "label", "pod", "theirs", "lease-role=leader"),
                 ("-n", other, "get", "pods")):
        code, out = run(*args)
        assert code != 0 and "Forbidden" in out, (args, out)
    # The denied requests changed nothing.
    assert cp.kubectl("-n", ns, "get", "pod", "mine", check=False).returncode == 0
    labels = json.loads(cp.kubectl("-n", other, "get", "pod", "theirs", "-o", "json")
                        .stdout)["metadata"].get("labels", {})
    assert "lease-role" not in labels


def test_cannot_touch_another_controllers_lease(control_plane: ControlPlane,
                                               kube_namespace: str, sa: Path) -> None:
    """Before: the Role could update every Lease of the namespace, other controllers'
    leader-election Leases included."""
    cp, ns = control_plane, kube_namespace
    theirs = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
              "metadata": {"name": "kube-scheduler"},
              "spec": {"holderIdentity": "scheduler-1", "leaseDurationSeconds": 15,
                       "leaseTransitions": 7}}
    cp.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(theirs))
    hijack = {**theirs, "spec": {**theirs["spec"], "holderIdentity": "mallory"}}
    for verb, args, stdin in (
            ("replace", ("replace", "-f", "-"), json.dumps(hijack)),
            ("patch", ("patch", "lease", "kube-scheduler", "--type=merge", "-p",
                       '{"spec": {"holderIdentity": "mallory"}}'), None),
            ("get", ("get", "lease", "kube-scheduler"), None),
            ("delete", ("delete", "lease", "kube-scheduler"), None)):
        proc = cp.kubectl("-n", ns, *args, kubeconfig=sa, input=stdin, check=False)
        assert proc.returncode != 0 and "Forbidden" in proc.stderr, (verb, proc.stderr)
    # Creating a Lease of that name is refused as well: it exists (create never overwrites).
    proc = cp.kubectl("-n", ns, "create", "-f", "-", kubeconfig=sa, input=json.dumps(hijack),
                      check=False)
    assert proc.returncode != 0 and "AlreadyExists" in proc.stderr
    spec = json.loads(cp.kubectl("-n", ns, "get", "lease", "kube-scheduler", "-o", "json")
                      .stdout)["spec"]
    assert spec["holderIdentity"] == "scheduler-1" and spec["leaseTransitions"] == 7
