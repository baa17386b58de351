"""The injector's part of the chart with the real helm and the real kube-apiserver:
scheduling, TLS that renders under ``helm template``, cert-manager, and the namespaces
the chart provisions for injected pods."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from sidecar.injector import certs
from testkit.chart_support import (
    CHART,
    documents,
    find,
    helm,
    named_rules,
    set_args,
    template,
)
from testkit.support import SidecarProcess, wait_until
from testkit.testbed.crds import install_cert_manager_crds
from testkit.testbed.kube import ControlPlane

pytestmark = pytest.mark.kube

INJECTOR = ["injector.enabled=true"]
HOSTS = ["r-lease-sidecar-injector.apps.svc", "r-lease-sidecar-injector.apps.svc.cluster.local"]
SELECTOR = {"app.kubernetes.io/name": "lease-sidecar", "app.kubernetes.io/instance": "r",
            "app.kubernetes.io/component": "injector"}


def _render(values: list[str], namespace: str = "apps") -> list[dict[str, Any]]:
    return documents(template("r", namespace, [*INJECTOR, *values]).stdout)


def _pod_spec(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs, "Deployment", "-injector")["spec"]["template"]["spec"]


# --------------------------------------------------------------------------- scheduling


def test_replicas_prefer_different_nodes_by_default() -> None:
    """Before: no affinity at all, so both replicas could land on one node and the PDB
    (minAvailable 1) protected nothing through that node's drain."""
    docs = _render([])
    spec = _pod_spec(docs)
    deployment = find(docs, "Deployment", "-injector")
    assert deployment["spec"]["replicas"] == 2
    assert spec["affinity"] == {"podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100, "podAffinityTerm": {
                "topologyKey": "kubernetes.io/hostname",
                "labelSelector": {"matchLabels": SELECTOR}}}]}}
    # The term selects exactly the injector's pods, which the PDB protects.
    assert deployment["spec"]["template"]["metadata"]["labels"] == SELECTOR
    assert find(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == SELECTOR
    for absent in ("nodeSelector", "tolerations", "topologySpreadConstraints",
                   "priorityClassName"):
        assert absent not in spec


def test_scheduling_values_reach_the_injector() -> None:
    hard = _pod_spec(_render(["injector.podAntiAffinity=hard"]))["affinity"]
    assert hard == {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": SELECTOR}}]}}
    assert "affinity" not in _pod_spec(_render(["injector.podAntiAffinity=none"]))
    spec = _pod_spec(_render([
        "injector.nodeSelector.kubernetes\\.io/os=linux",
        "injector.tolerations[0].key=dedicated", "injector.tolerations[0].operator=Exists",
        "injector.tolerations[0].effect=NoSchedule",
        "injector.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].key=pool",
        "injector.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        "injector.topologySpreadConstraints[0].maxSkew=1",
        "injector.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
        "injector.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
        "injector.priorityClassName=system-cluster-critical",
    ]))
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["tolerations"] == [{"key": "dedicated", "operator": "Exists",
                                    "effect": "NoSchedule"}]
    # An affinity of your own replaces the default anti-affinity.
    assert list(spec["affinity"]) == ["nodeAffinity"]
    # Without a labelSelector a constraint matches no pod (the apiserver warns): it gets
    # the injector's.
    assert spec["topologySpreadConstraints"] == [{
        "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
        "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": SELECTOR}}]
    assert spec["priorityClassName"] == "system-cluster-critical"
    proc = template("r", "apps", [*INJECTOR, "injector.podAntiAffinity=sometimes"], check=False)
    assert proc.returncode != 0 and "at '/injector/podAntiAffinity'" in proc.stderr


# --------------------------------------------------------------------------- TLS


def _tls(docs: list[dict[str, Any]]) -> certs.Bundle:
    data = find(docs, "Secret", "-injector-tls")["data"]
    return certs.Bundle(*(base64.b64decode(data[key])
                          for key in ("ca.crt", "ca.key", "tls.crt", "tls.key")))


def test_tls_renders_under_helm_template() -> None:
    """Before: the Secret and the caBundle came from `lookup` only, so `helm template` (and
    GitOps tools built on it) rendered an empty Secret and a webhook without a caBundle,
    which the apiserver could not call until the injector had run."""
    docs = _render([])
    bundle = _tls(docs)
    # A CA, and a serving certificate it signed for the Service: what the injector would
    # make itself, so it keeps them as they are.
    assert certs.renewal_reason(bundle, HOSTS) is None
    config = find(docs, "MutatingWebhookConfiguration")
    assert [base64.b64decode(w["clientConfig"]["caBundle"]) for w in config["webhooks"]] == [
        bundle.ca_cert, bundle.ca_cert]
    # Every render without a cluster to look up makes a new pair (documented), and the
    # injector restarts on it because it reads the Secret at start.
    again = _render([])
    assert _tls(again).ca_cert != bundle.ca_cert
    annotations = [find(d, "Deployment", "-injector")["spec"]["template"]["metadata"][
        "annotations"] for d in (docs, again)]
    assert annotations[0]["checksum/tls"] != annotations[1]["checksum/tls"]
    assert annotations[0]["checksum/sidecar-spec"] == annotations[1]["checksum/sidecar-spec"]


# --------------------------------------------------------------------------- cert-manager


def test_cert_manager_replaces_the_injectors_own_tls() -> None:
    docs = _render(["injector.certManager.enabled=true"])
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    # No TLS Secret of the chart's, and none of the rights the injector needs to keep one.
    assert ("Secret", "r-lease-sidecar-injector-tls") not in kinds
    assert ("Role", "r-lease-sidecar-injector") not in kinds
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    issuer = find(docs, "Issuer")
    assert issuer["metadata"]["name"] == "r-lease-sidecar-injector-selfsigned"
    assert issuer["spec"] == {"selfSigned": {}}
    certificate = find(docs, "Certificate")["spec"]
    assert certificate["secretName"] == "r-lease-sidecar-injector-cert"
    assert certificate["dnsNames"] == HOSTS
    assert certificate["issuerRef"] == {"name": "r-lease-sidecar-injector-selfsigned",
                                        "kind": "Issuer", "group": "cert-manager.io"}
    assert certificate["privateKey"]["rotationPolicy"] == "Always"
    spec = _pod_spec(docs)
    container = spec["containers"][0]
    assert [a for a in container["args"] if a.startswith("--tls")] == [
        "--tls-file=/etc/lease-sidecar-injector/tls/tls.crt",
        "--tls-key=/etc/lease-sidecar-injector/tls/tls.key"]
    assert not [a for a in container["args"] if a.startswith(("--host", "--webhook-config"))]
    assert {"name": "tls", "secret": {"secretName": "r-lease-sidecar-injector-cert"}} in (
        spec["volumes"])
    assert "checksum/tls" not in find(docs, "Deployment", "-injector")["spec"]["template"][
        "metadata"]["annotations"]
    config = find(docs, "MutatingWebhookConfiguration")
    assert config["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": "apps/r-lease-sidecar-injector"}
    assert all("caBundle" not in w["clientConfig"] for w in config["webhooks"])

    docs = _render(["injector.certManager.enabled=true",
                    "injector.certManager.issuerRef.name=corp-ca",
                    "injector.certManager.issuerRef.kind=ClusterIssuer"])
    assert not [d for d in docs if d["kind"] == "Issuer"]
    assert find(docs, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


@pytest.fixture(scope="module")
def cert_manager_crds_installed(control_plane: ControlPlane) -> None:
    install_cert_manager_crds(control_plane)


@pytest.mark.parametrize("values", [
    ["injector.certManager.enabled=true"],
    ["injector.certManager.enabled=true", "injector.certManager.issuerRef.name=corp-ca",
     "injector.certManager.issuerRef.kind=ClusterIssuer"],
], ids=["self-signed", "cluster-issuer"])
def test_apiserver_accepts_the_cert_manager_objects(
        control_plane: ControlPlane, kube_namespace: str, cert_manager_crds_installed: None,
        values: list[str]) -> None:
    """Against cert-manager's own CRD schemas (no cert-manager controller runs here)."""
    rendered = template("r", kube_namespace, [*INJECTOR, *values]).stdout
    proc = control_plane.kubectl("apply", "--dry-run=server", "-n", kube_namespace, "-f", "-",
                                 "-o", "name", input=rendered, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "certificate.cert-manager.io/r-lease-sidecar-injector" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- namespaces


def test_namespaces_get_the_role_binding_leases_and_dsn_secret() -> None:
    values = ["injector.namespaces[0].name=team-a",
              "injector.namespaces[1].name=team-b",
              "injector.namespaces[1].serviceAccounts={web,batch}",
              "injector.namespaces[2].name=apps",  # the release namespace: nothing twice
              "rbac.leaseNames={web}"]
    docs = _render(values)

    def in_namespace(namespace: str) -> list[dict[str, Any]]:
        return [d for d in docs if d["metadata"].get("namespace") == namespace]

    release_rules = named_rules(find(in_namespace("apps"), "Role", "r-lease-sidecar"))
    assert ("coordination.k8s.io", "leases", "update",
            ("lease-sidecar.default", "lease-sidecar.web")) in release_rules
    for namespace, accounts in (("apps", ["r-lease-sidecar"]), ("team-a", ["default"]),
                                ("team-b", ["web", "batch"])):
        here = in_namespace(namespace)
        assert named_rules(find(here, "Role", "r-lease-sidecar")) == release_rules
        binding = find(here, "RoleBinding", "r-lease-sidecar")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": a,
                                        "namespace": namespace} for a in accounts]
        assert sorted(d["metadata"]["name"] for d in here if d["kind"] == "Lease") == [
            "lease-sidecar.default", "lease-sidecar.web"]
    # The injector itself and its webhook stay in the release namespace, once.
    assert len([d for d in docs if d["kind"] == "Deployment"]) == 1
    # A DSN from lease.dsn goes to every namespace too (a Secret of yours: you copy it).
    docs = _render([*values, "lease.backend=postgres", "lease.dsn=postgresql://db/app"])
    assert sorted(d["metadata"]["namespace"] for d in docs
                  if d["kind"] == "Secret" and d["metadata"]["name"] == "r-lease-sidecar-dsn"
                  ) == ["apps", "team-a", "team-b"]
    proc = template("r", "apps", [*INJECTOR, "injector.namespaces[0].name=Team_A"],
                    check=False)
    assert proc.returncode != 0 and "at '/injector/namespaces/0/name'" in proc.stderr


def test_webhooks_serve_the_release_namespace_and_labelled_namespaces_only() -> None:
    """Before: one webhook for every namespace but kube-system."""
    config = find(_render(["injector.namespaceSelector.matchLabels.env=prod"]),
                  "MutatingWebhookConfiguration")
    own, labelled = config["webhooks"]
    assert own["namespaceSelector"] == {
        "matchLabels": {"env": "prod"},
        "matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["apps"]},
            {"key": "lease-sidecar/injector", "operator": "DoesNotExist"}]}
    assert labelled["namespaceSelector"] == {
        "matchLabels": {"env": "prod", "lease-sidecar/injector": "r.apps"}}
    assert own["name"] != labelled["name"]
    for webhook in (own, labelled):
        assert webhook["objectSelector"] == {"matchLabels": {"lease-sidecar/inject": "true"}}
        assert webhook["rules"][0]["operations"] == ["CREATE"]


def test_a_provisioned_namespace_lets_its_sidecar_lead(
        control_plane: ControlPlane, kube_namespace: str, tmp_path: Path) -> None:
    """helm install provisions another namespace; a real sidecar there, as that namespace's
    default ServiceAccount (what an injected pod runs as), leads and keeps its label."""
    cp = control_plane
    team = cp.create_namespace("team")
    kubeconfig = ["--kubeconfig", str(cp.kubeconfig), "--namespace", kube_namespace]
    values = [*INJECTOR, f"injector.namespaces[0].name={team}", "rbac.leaseNames={web}"]
    proc = helm("install", "prov", str(CHART), *kubeconfig, *set_args(values))
    try:
        assert (f"kubectl label namespace <namespace> lease-sidecar/injector=prov."
                f"{kube_namespace}") in proc.stdout
        assert f"Leases and DSN Secret in {team}" not in proc.stdout  # no DSN: kubernetes
        assert f"Role, Leases in {team}" in proc.stdout
        cp.kubectl("-n", team, "apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0"},
            "spec": {"containers": [{"name": "app", "image": "example.invalid/app:1"}]}}))
        account = cp.service_account_kubeconfig(team, "default", create=False)
        sidecar = SidecarProcess(tmp_path, "web-0", args=[
            "--backend", "kubernetes", "--name", "web", "--lease-duration", "3s",
            "--renew-interval", "500ms", "--renew-deadline", "2s"],
            env={"POD_NAME": "web-0", "POD_NAMESPACE": team, "KUBECONFIG": str(account)})
        sidecar.start()
        try:
            sidecar.wait_http()
            wait_until(lambda: sidecar.leader() == 200, timeout=20)

            def labelled() -> bool:
                pod = json.loads(cp.kubectl("-n", team, "get", "pod", "web-0", "-o",
                                            "json").stdout)
                return pod["metadata"].get("labels", {}).get("lease-role") == "leader"

            wait_until(labelled, timeout=10)
        finally:
            assert sidecar.stop() == 0, sidecar.logs()
        assert "Forbidden" not in sidecar.logs() and "denied" not in sidecar.logs()
    finally:
        helm("uninstall", "prov", *kubeconfig)
