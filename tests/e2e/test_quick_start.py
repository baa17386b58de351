"""The Kubernetes quick start of docs/getting-started.md, run as the page writes it on
the test bed's real kubelet: once as cluster admin (the injector, a Deployment of one's
own opted in by a patch), once as a user whose rights end at one namespace (the chart's
example Deployment, no cluster-scoped object). The page cannot drift from what works.

The image step is the one thing done the test bed's way: the page's `docker build`
targets are built from the Dockerfile by the image test bed (no container engine here)
and loaded from archives, then given the names the page tags them with, as `kind load`
leaves them. Every other command runs as written, in bash, with the test bed's own helm
and kubectl; only the namespace `my-ns` becomes a fresh one.

Run alone: python -m pytest tests/e2e/test_quick_start.py   (needs root; see
testkit/testbed/cluster.py)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from testkit import pods_support as ps
from testkit import quick_start
from testkit.support import REPO
from testkit.testbed import gobuild
from testkit.testbed.cluster import Cluster

pytestmark = [pytest.mark.pods, pytest.mark.slow]

EXAMPLE_IMAGE = "busybox:1.36"  # the chart's example.image and the page's own Deployment
NAMESPACE_OWNER = {
    "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
    "metadata": {"name": "owner"},
    "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}],
}


@pytest.fixture(scope="module")
def images(pod_cluster: Cluster, sidecar_image: str) -> dict[str, str]:
    """The page's image step: each target it builds, loaded under the name it gives."""
    builds, loaded = quick_start.image_step(quick_start.blocks()["image"])
    built = {"sidecar": sidecar_image, "operator": ps.operator_ref(sidecar_image)}
    for build in builds:
        assert build.name in loaded, f"the page builds {build.name} but never loads it"
        pod_cluster.tag_image(built[build.target], build.name)
    pod_cluster.tag_image(pod_cluster.busybox(), EXAMPLE_IMAGE)
    return {b.target: b.name for b in builds}


def run_block(cluster: Cluster, name: str, namespace: str,
              kubeconfig: Path) -> subprocess.CompletedProcess[str]:
    """The page's block, as bash runs it from the repository's root."""
    script = quick_start.blocks()[name].replace(quick_start.NAMESPACE, namespace)
    # The test bed's helm and kubectl, under the names the page calls them by.
    tools = Path(cluster.workdir) / "quick-start-bin"
    tools.mkdir(exist_ok=True)
    for tool in ("helm", "kubectl"):
        if not (tools / tool).exists():
            (tools / tool).symlink_to(gobuild.ensure_binary(tool))
    env = dict(os.environ, KUBECONFIG=str(kubeconfig),
               PATH=os.pathsep.join([str(tools), os.environ.get("PATH", "")]))
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(cluster.workdir / "helm" / var.lower())
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def one_leader(cluster: Cluster, namespace: str, kubeconfig: Path) -> dict[str, str]:
    """Wait until `kubectl get pods -L lease-role` (the page's last command) shows one
    running pod `leader` and the other running pods `standby`; their roles by pod."""
    def roles() -> dict[str, str] | None:
        out = cluster.kubectl("-n", namespace, "get", "pods", "-L", "lease-role",
                              "--no-headers", kubeconfig=kubeconfig).stdout
        seen = {}
        for line in out.splitlines():
            fields = line.split()
            name, status, role = fields[0], fields[2], fields[-1]
            if status == "Running" and "injector" not in name:
                seen[name] = role
        values = sorted(seen.values())
        if len(values) >= 2 and values.count("leader") == 1 and \
                values.count("standby") == len(values) - 1:
            return seen
        return None

    return cluster.wait_for(roles, 180, f"one leader and the rest standby in {namespace}",
                            interval=1)


def test_as_cluster_admin(pod_cluster: Cluster, images: dict[str, str]) -> None:
    c = pod_cluster
    namespace = f"qs-admin-{os.urandom(3).hex()}"  # created by the page's --create-namespace
    try:
        done = run_block(c, "cluster-admin", namespace, c.kubeconfig)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "LEASE-ROLE" in done.stdout  # the page's last command printed the column
        roles = one_leader(c, namespace, c.kubeconfig)
        assert len(roles) == 3  # the page's three replicas, each with its sidecar
        # Every pod that leads or stands by is one the injector gave the sidecar (the
        # Deployment's pods from before the patch may still be terminating).
        for pod in c.kubectl_json("-n", namespace, "get", "pods", "-l", "app=web")["items"]:
            if pod["metadata"]["name"] in roles:
                init = [x["name"] for x in pod["spec"].get("initContainers", [])]
                assert ps.SIDECAR in init, pod["metadata"]["name"]
    finally:
        c.helm("uninstall", "jobs", "-n", namespace, "--wait", check=False)
        c.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_with_rights_in_one_namespace(pod_cluster: Cluster, images: dict[str, str]) -> None:
    c = pod_cluster
    namespace = c.create_namespace("qs-ns")  # the one thing the namespace owner is given
    c.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(NAMESPACE_OWNER))
    c.kubectl("-n", namespace, "create", "rolebinding", "owner", "--role=owner",
              f"--serviceaccount={namespace}:installer")
    owner = c.control_plane.service_account_kubeconfig(namespace, "installer")
    # Nothing outside the namespace: no namespace, no cluster-scoped policy or webhook.
    for kind in ("namespaces", "validatingadmissionpolicies",
                 "mutatingwebhookconfigurations"):
        assert c.kubectl("auth", "can-i", "create", kind, "--all-namespaces",
                         kubeconfig=owner, check=False).stdout.strip() == "no", kind
    try:
        done = run_block(c, "namespace", namespace, owner)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "LEASE-ROLE" in done.stdout
        one_leader(c, namespace, owner)
        manifest = c.helm("get", "manifest", "jobs", "-n", namespace).stdout
        kinds = {line.split(":", 1)[1].strip() for line in manifest.splitlines()
                 if line.startswith("kind:")}
        assert kinds <= {"ServiceAccount", "Role", "RoleBinding", "Lease", "Deployment"}, kinds
    finally:
        c.helm("uninstall", "jobs", "-n", namespace, "--wait", check=False)
        c.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
