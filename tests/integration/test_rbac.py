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

from tests.integration.kube_support import RBAC, create_pods, install_rbac
from tests.testbed.kube import ControlPlane

pytestmark = pytest.mark.kube

ALLOWED = [(verb, "pods") for verb in ("get", "list", "watch", "patch")] + [
    (verb, "leases.coordination.k8s.io")
    for verb in ("get", "list", "watch", "create", "update")] + [
    (verb, "events") for verb in ("create", "patch")]
DENIED = [("delete", "pods"), ("create", "pods"), ("update", "pods"), ("get", "secrets"),
          ("list", "configmaps"), ("delete", "events"), ("update", "events"),
          ("list", "events"), ("create", "events.events.k8s.io"),
          ("delete", "leases.coordination.k8s.io"),
          ("patch", "leases.coordination.k8s.io"), ("get", "roles.rbac.authorization.k8s.io")]


def can_i(cp: ControlPlane, kubeconfig: Path, namespace: str, verb: str, resource: str) -> str:
    proc = cp.kubectl("auth", "can-i", verb, resource, "-n", namespace,
                      kubeconfig=kubeconfig, check=False)
    return proc.stdout.strip()


@pytest.fixture
def sa(control_plane: ControlPlane, kube_namespace: str) -> Path:
    return install_rbac(control_plane, kube_namespace)


def test_the_file_grants_exactly_the_sidecars_rules() -> None:
    role = next(d for d in yaml.safe_load_all(RBAC.read_text()) if d["kind"] == "Role")
    granted = {(group, resource, verb) for rule in role["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]
               for verb in rule["verbs"]}
    assert granted == ({("", "pods", verb) for verb in ("get", "list", "watch", "patch")}
                       | {("coordination.k8s.io", "leases", verb)
                          for verb in ("get", "list", "watch", "create", "update")}
                       | {("", "events", verb) for verb in ("create", "patch")})
    assert all("resourceNames" not in rule and "nonResourceURLs" not in rule
               for rule in role["rules"])


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
             "metadata": {"name": "probe"}, "spec": {"holderIdentity": "mine"}}
    assert cp.kubectl("-n", ns, "create", "-f", "-", kubeconfig=sa,
                      input=json.dumps(lease), check=False).returncode == 0
    lease["spec"]["holderIdentity"] = ""
    assert cp.kubectl("-n", ns, "replace", "-f", "-", kubeconfig=sa,
                      input=json.dumps(lease), check=False).returncode == 0

    # Denied, by the apiserver: each answer is a 403 naming the missing verb.
    for args in (("-n", ns, "delete", "pod", "mine", "--wait=false"),
                 ("-n", ns, "get", "secrets"),
                 ("-n", ns, "delete", "lease", "probe"),
                 ("-n", other, "label", "pod", "theirs", "lease-role=leader"),
                 ("-n", other, "get", "pods")):
        code, out = run(*args)
        assert code != 0 and "Forbidden" in out, (args, out)
    # The denied requests changed nothing.
    assert cp.kubectl("-n", ns, "get", "pod", "mine", check=False).returncode == 0
    labels = json.loads(cp.kubectl("-n", other, "get", "pod", "theirs", "-o", "json")
                        .stdout)["metadata"].get("labels", {})
    assert "lease-role" not in labels
