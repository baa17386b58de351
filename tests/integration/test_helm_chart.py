"""The Helm chart, with the real helm and the real kube-apiserver of the test bed.

helm is built from the Go module proxy by tests/testbed/gobuild.py (cached); manifests go
to the real kube-apiserver with ``kubectl apply --dry-run=server`` (full validation and
admission, nothing stored) or are installed for real with ``helm install`` (objects are
stored; no pod ever runs, because the test bed has no kubelet).
"""

from __future__ import annotations

import base64
import json

import pytest

from tests.integration.chart_support import (
    CHART,
    VALUE_SETS,
    documents,
    env_map,
    find,
    helm,
    rules_set,
    set_args,
    template,
)
from tests.support import REPO
from tests.testbed.kube import ControlPlane

pytestmark = pytest.mark.kube


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_lint_strict(values: list[str]) -> None:
    proc = helm("lint", "--strict", str(CHART), *set_args(values), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["lease.backend=mysql"], "at '/lease/backend': value must be one of"),
        (["lease.backend=sqlite"], "at '/lease/backend': value must be one of"),
        (["lease.backend=postgres"], "at '/lease': 'anyOf' failed"),
        (["lease.role=boss"], "at '/lease/role'"),
        (["lease.duration=15 seconds"], "at '/lease/duration'"),
        (["sidecar.readinessProbePath=/leader"], "at '/sidecar/readinessProbePath'"),
        (["injector.failurePolicy=Never"], "at '/injector/failurePolicy'"),
        (["lease.durration=15s"], "additional properties 'durration' not allowed"),
    ],
    ids=["mysql", "sqlite", "postgres-without-dsn", "role", "duration", "probe", "policy",
         "typo"],
)
def test_schema_rejects_bad_values(values: list[str], message: str) -> None:
    proc = template("r", "default", values, check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr
    # lint says the same, so CI catches it before anyone installs.
    assert helm("lint", "--strict", str(CHART), *set_args(values), check=False).returncode != 0


def test_sidecar_is_a_native_sidecar_with_shared_dir_and_probes() -> None:
    docs = documents(template("r", "apps", ["example.enabled=true"]).stdout)
    pod = find(docs, "Deployment", "-example")["spec"]["template"]["spec"]
    sidecar = pod["initContainers"][0]
    assert sidecar["name"] == "lease-sidecar"
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["args"] == ["run"]
    env = env_map(sidecar)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["LEASE_BACKEND"] == "kubernetes"
    # Probes come from the node: the sidecar must listen beyond loopback.
    assert env["LEASE_HTTP_ADDR"] == "0.0.0.0:8099"
    assert env["LEASE_STATE_DIR"] == "/run/lease"
    for probe in ("startupProbe", "livenessProbe"):
        assert sidecar[probe]["httpGet"] == {"path": "/healthz", "port": "lease-http"}
    # Readiness of a native sidecar gates the pod: /healthz by default (see values.yaml).
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/healthz"
    security = sidecar["securityContext"]
    assert security["runAsNonRoot"] is True and security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert sidecar["resources"]["requests"] and "cpu" not in sidecar["resources"]["limits"]
    assert {m["mountPath"] for m in sidecar["volumeMounts"]} == {"/run/lease", "/tmp"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["lease-state"]["emptyDir"]["medium"] == "Memory"
    app = pod["containers"][0]
    assert {"name": "lease-state", "mountPath": "/run/lease", "readOnly": True} in (
        app["volumeMounts"])
    assert env_map(app)["LEASE_LEADER_FILE"] == "/run/lease/leader"
    assert "$LEASE_LEADER_FILE" in app["args"][0]


def test_values_reach_the_sidecar_env() -> None:
    docs = documents(template("r", "apps", [
        "example.enabled=true", "lease.backend=sqlserver", "lease.dsnSecret.name=mssql",
        r"lease.name=sweeps\,reports", "lease.role=worker", "lease.duration=30s",
        "sidecar.listenAddress=::", "sidecar.port=9099",
        "sidecar.readinessProbePath=/readyz",
    ]).stdout)
    pod = find(docs, "Deployment", "-example")["spec"]["template"]["spec"]
    env = env_map(pod["initContainers"][0])
    assert env["LEASE_BACKEND"] == "sqlserver"
    assert env["LEASE_DSN"] == {"secretKeyRef": {"name": "mssql", "key": "dsn"}}
    assert env["LEASE_NAME"] == "sweeps,reports"
    assert env["LEASE_ROLE"] == "worker"
    assert env["LEASE_DURATION"] == "30s"
    assert env["LEASE_HTTP_ADDR"] == "[::]:9099"
    assert pod["initContainers"][0]["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert env_map(pod["containers"][0])["LEASE_LEADER_URL"] == "http://127.0.0.1:9099/leader"
    # No Lease rules without the kubernetes backend: least privilege.
    role = find(docs, "Role")
    assert rules_set(role) == ({("", "pods", v) for v in ("get", "list", "watch", "patch")}
                               | {("", "events", v) for v in ("create", "patch")})


def test_injector_spec_is_the_chart_sidecar() -> None:
    """The injector injects exactly what the named template renders for the example."""
    values = ["example.enabled=true", "injector.enabled=true"]
    docs = documents(template("r", "apps", values).stdout)
    spec = json.loads(find(docs, "ConfigMap", "-injector")["data"]["sidecar.json"])
    pod = find(docs, "Deployment", "-example")["spec"]["template"]["spec"]
    assert spec["container"] == pod["initContainers"][0]
    assert spec["volumes"] == pod["volumes"]
    assert spec["appMount"] in pod["containers"][0]["volumeMounts"]
    webhook = find(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    assert webhook["failurePolicy"] == "Fail"
    assert webhook["objectSelector"] == {"matchLabels": {"lease-sidecar/inject": "true"}}
    assert webhook["clientConfig"]["service"]["path"] == "/lease-sidecar-inject"
    assert webhook["sideEffects"] == "None"


def test_role_matches_deploy_rbac() -> None:
    """deploy/rbac.yaml (for kubectl users) and the chart grant exactly the same."""
    path = REPO / "deploy" / "rbac.yaml"
    assert path.exists(), "deploy/rbac.yaml is missing"
    deploy_role = find(documents(path.read_text()), "Role")
    chart_role = find(documents(template("r", "apps", []).stdout), "Role")
    assert rules_set(chart_role) == rules_set(deploy_role)
    assert rules_set(chart_role) == (
        {("", "pods", v) for v in ("get", "list", "watch", "patch")}
        | {("coordination.k8s.io", "leases", v)
           for v in ("get", "list", "watch", "create", "update")}
        | {("", "events", v) for v in ("create", "patch")})


def test_no_pod_or_event_rules_without_the_label() -> None:
    """lease.podLabel=off turns off the label and the pod Events: no rules for either."""
    role = find(documents(template("r", "apps", ["lease.podLabel=off"]).stdout), "Role")
    assert rules_set(role) == {("coordination.k8s.io", "leases", v)
                               for v in ("get", "list", "watch", "create", "update")}


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_server_accepts_rendered_manifests(
    control_plane: ControlPlane, kube_namespace: str, values: list[str]
) -> None:
    rendered = template("r", kube_namespace, values).stdout
    proc = control_plane.kubectl("apply", "--dry-run=server", "-n", kube_namespace,
                                 "-f", "-", "-o", "name", input=rendered, check=False)
    assert proc.returncode == 0, proc.stderr
    expected = {f"{d['kind'].lower()}/{d['metadata']['name']}" for d in documents(rendered)}
    accepted = set()
    for line in proc.stdout.split():  # "role.rbac.authorization.k8s.io/r-lease-sidecar"
        kind, name = line.split("/", 1)
        accepted.add(f"{kind.split('.', 1)[0]}/{name}")
    assert accepted == expected
    assert "Warning" not in proc.stderr, proc.stderr


def test_install_notes_rbac_and_upgrade_keeps_injector_tls(
    control_plane: ControlPlane, kube_namespace: str
) -> None:
    cp, ns = control_plane, kube_namespace
    kubeconfig = ["--kubeconfig", str(cp.kubeconfig), "--namespace", ns]
    values = set_args(["example.enabled=true", "injector.enabled=true"])
    proc = helm("install", "demo", str(CHART), *kubeconfig, *values)
    try:
        _check_installed(cp, ns, proc.stdout, kubeconfig, values)
    finally:
        # Leave no webhook behind that would refuse opted-in pods in other tests.
        helm("uninstall", "demo", *kubeconfig)
    gone = cp.kubectl("get", "mutatingwebhookconfiguration",
                      f"{ns}-demo-lease-sidecar-injector", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr


def _check_installed(cp: ControlPlane, ns: str, notes: str, kubeconfig: list[str],
                     values: list[str]) -> None:
    assert f"kubectl -n {ns} get pods -L lease-role" in notes
    assert 'lease-sidecar/inject: "true"' in notes

    # The Role really lets the sidecar's ServiceAccount do its job, and no more.
    sa = f"system:serviceaccount:{ns}:demo-lease-sidecar"
    for verb, resource in [("patch", "pods"), ("watch", "pods"),
                           ("update", "leases.coordination.k8s.io"), ("create", "events"),
                           ("patch", "events")]:
        assert cp.kubectl("auth", "can-i", verb, resource, "-n", ns, "--as", sa,
                          check=False).stdout.strip() == "yes"
    for verb, resource in [("delete", "pods"), ("get", "secrets"),
                           ("delete", "leases.coordination.k8s.io"), ("delete", "events")]:
        assert cp.kubectl("auth", "can-i", verb, resource, "-n", ns, "--as", sa,
                          check=False).stdout.strip() == "no"

    # The injector stores its certificates in the chart's Secret; an upgrade keeps them
    # and fills the webhook's caBundle from them (lookup), instead of blanking either.
    secret = "demo-lease-sidecar-injector-tls"
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nstand-in\n").decode()
    patch = {"data": {"ca.crt": ca, "tls.crt": ca}}
    cp.kubectl("-n", ns, "patch", "secret", secret, "-p", json.dumps(patch))
    helm("upgrade", "demo", str(CHART), *kubeconfig, *values, "--set", "lease.name=other")
    stored = json.loads(cp.kubectl("-n", ns, "get", "secret", secret, "-o", "json").stdout)
    assert stored["data"]["ca.crt"] == ca and stored["data"]["tls.crt"] == ca
    config = json.loads(cp.kubectl(
        "get", "mutatingwebhookconfiguration", f"{ns}-demo-lease-sidecar-injector",
        "-o", "json").stdout)
    assert config["webhooks"][0]["clientConfig"]["caBundle"] == ca
