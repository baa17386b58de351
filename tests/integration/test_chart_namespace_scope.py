"""An installer whose rights end at one namespace, against the real kube-apiserver with
`helm install`: the chart either installs with namespaced objects only, or stops before it
creates anything, naming the value to set. (The same install on real pods, from the
getting-started page's own commands: tests/e2e/test_quick_start.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.chart_support import CHART, helm, set_args
from testkit.testbed.kube import ControlPlane

pytestmark = [pytest.mark.kube, pytest.mark.tools]

RELEASE = "ns"
# The ask of a namespace owner: everything in the namespace, nothing outside it.
NAMESPACE_OWNER = {
    "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
    "metadata": {"name": "owner"},
    "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}],
}


def namespace_owner(cp: ControlPlane, namespace: str) -> Path:
    """A kubeconfig whose identity may do anything in ``namespace`` and nothing else."""
    cp.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(NAMESPACE_OWNER))
    cp.kubectl("-n", namespace, "create", "rolebinding", "owner", "--role=owner",
               f"--serviceaccount={namespace}:installer")
    return cp.service_account_kubeconfig(namespace, "installer")


@pytest.fixture
def owner(control_plane: ControlPlane) -> Iterator[tuple[ControlPlane, str, Path]]:
    namespace = control_plane.create_namespace("nsonly")
    yield control_plane, namespace, namespace_owner(control_plane, namespace)
    control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def install(kubeconfig: Path, namespace: str, *values: str):
    return helm("install", RELEASE, str(CHART), "--kubeconfig", str(kubeconfig),
                "--namespace", namespace, *set_args(["lease.name=nightly", *values]),
                check=False)


def releases(cp: ControlPlane, namespace: str) -> list[str]:
    """Helm's release records in the namespace: one exists once an install began."""
    out = json.loads(cp.kubectl("-n", namespace, "get", "secrets", "-l", "owner=helm",
                                "-o", "json").stdout)
    return [s["metadata"]["name"] for s in out["items"]]


@pytest.mark.parametrize(("values", "named"), [
    ((), "--set rbac.podPatchPolicy=false"),
    (("rbac.podPatchPolicy=false", "injector.enabled=true"), "--set injector.enabled=false"),
], ids=["pod-patch-policy", "injector"])
def test_without_cluster_rights_the_install_stops_naming_the_value(owner, values, named):
    cp, namespace, kubeconfig = owner
    done = install(kubeconfig, namespace, *values)
    assert done.returncode != 0
    assert named in done.stderr, done.stderr
    assert "forbidden" in done.stderr
    # Stopped at render: no release record, no object of the chart in the namespace.
    assert releases(cp, namespace) == []
    made = cp.kubectl("-n", namespace, "get", "serviceaccounts,roles,leases,deployments",
                      "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name").stdout
    assert made.strip() == ""


def test_the_namespace_only_install_creates_namespaced_objects_only(owner):
    _, namespace, kubeconfig = owner
    done = install(kubeconfig, namespace, "rbac.podPatchPolicy=false", "example.enabled=true")
    assert done.returncode == 0, done.stderr
    manifest = helm("get", "manifest", RELEASE, "--kubeconfig", str(kubeconfig),
                    "--namespace", namespace).stdout
    kinds = {line.split(":", 1)[1].strip() for line in manifest.splitlines()
             if line.startswith("kind:")}
    assert kinds <= {"ServiceAccount", "Role", "RoleBinding", "Lease", "Deployment"}, kinds
    assert {"Role", "Lease", "Deployment"} <= kinds
    helm("uninstall", RELEASE, "--kubeconfig", str(kubeconfig), "--namespace", namespace)


def test_a_cluster_admin_installs_the_policy_and_the_injector(control_plane: ControlPlane):
    cp = control_plane
    namespace = cp.create_namespace("nsadmin")
    try:
        done = install(cp.kubeconfig, namespace, "injector.enabled=true")
        assert done.returncode == 0, done.stderr
        policy = f"{namespace}-{RELEASE}-lease-sidecar-pod-patch"
        assert cp.kubectl("get", "validatingadmissionpolicy", policy,
                          check=False).returncode == 0
    finally:
        helm("uninstall", RELEASE, "--kubeconfig", str(cp.kubeconfig), "--namespace",
             namespace, check=False)
        cp.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
