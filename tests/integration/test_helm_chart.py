"""The Helm chart, with the real helm and the real kube-apiserver of the test bed.

helm is built from the Go module proxy by testkit/testbed/gobuild.py (cached); manifests go
to the real kube-apiserver with ``kubectl apply --dry-run=server`` (full validation and
admission, nothing stored) or are installed for real with ``helm install`` (objects are
stored; no pod ever runs, because the test bed has no kubelet).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from testkit.chart_support import (
    CHART,
    VALUE_SETS,
    documents,
    env_map,
    find,
    helm,
    kube_version,
    named_rules,
    rules_set,
    set_args,
    template,
)
from testkit.procs import free_port
from testkit.support import REPO, SidecarProcess, wait_until
from testkit.testbed.kube import ControlPlane
from testkit.testbed.postgres import PgServer

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
        (["sidecar.startGate=exec"], "at '/sidecar/startGate'"),
        (["injector.failurePolicy=Never"], "at '/injector/failurePolicy'"),
        (["lease.durration=15s"], "additional properties 'durration' not allowed"),
    ],
    ids=["mysql", "sqlite", "postgres-without-dsn", "role", "duration", "probe", "gate",
         "policy", "typo"],
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
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "lease-http"}
    # The app containers wait for the sidecar's postStart hook (it waits for /livez); no
    # startupProbe, whose success would cost the pod another kubelet pass (~0.8 s).
    assert "startupProbe" not in sidecar
    hook = sidecar["lifecycle"]["postStart"]["exec"]["command"]
    assert hook[:4] == ["/opt/lease-sidecar/bin/python", "-I", "-S", "-c"]
    assert '("127.0.0.1",8099)' in hook[4] and "GET /livez" in hook[4]
    # Readiness of a native sidecar gates the pod: /healthz by default (see values.yaml),
    # which also fails while the sidecar can never lead; a restart would not help that.
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert sidecar["readinessProbe"]["periodSeconds"] == 5
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


@pytest.mark.parametrize(("values", "key"), [
    ([], "lease-sidecar.default"),
    (["lease.name=sweeps\\,reports", "lease.keyPrefix=team-a"], "team-a.sweeps"),
    (["lease.keyPrefix="], "lease-sidecar.default"),  # empty: the sidecar's default
    ([f"lease.name={'n' * 70}"], f"lease-sidecar.{'n' * 70}"),  # too long: hashed
])
def test_example_pods_carry_their_group_label_from_creation(values: list[str],
                                                             key: str) -> None:
    """The label the sidecar's pod label publisher writes, already in the pod template
    (injected pods get it from the injector): a rollout deletes an old pod once a new one
    is Ready, which can be before the new sidecar's first write."""
    from sidecar.publish.pod_label import GROUP_LABEL, group_value

    docs = documents(template("r", "apps", ["example.enabled=true", *values]).stdout)
    labels = find(docs, "Deployment", "-example")["spec"]["template"]["metadata"]["labels"]
    assert labels[GROUP_LABEL] == group_value(key)
    off = documents(template("r", "apps", ["example.enabled=true",
                                           "lease.podLabel=off"]).stdout)
    assert GROUP_LABEL not in find(off, "Deployment", "-example")["spec"]["template"][
        "metadata"]["labels"]


def test_start_gate_startup_probe_settings() -> None:
    docs = documents(template("r", "apps", [
        "example.enabled=true", "sidecar.startGate=startupProbe",
        "sidecar.startTimeoutSeconds=45", "sidecar.readinessProbePeriodSeconds=1"]).stdout)
    sidecar = find(docs, "Deployment", "-example")["spec"]["template"]["spec"][
        "initContainers"][0]
    assert "lifecycle" not in sidecar
    assert sidecar["startupProbe"] == {"httpGet": {"path": "/livez", "port": "lease-http"},
                                       "periodSeconds": 1, "failureThreshold": 45}
    assert sidecar["readinessProbe"]["periodSeconds"] == 1


def _post_start_hook(port: int, timeout: int) -> list[str]:
    docs = documents(template("r", "apps", [
        "example.enabled=true", f"sidecar.port={port}",
        f"sidecar.startTimeoutSeconds={timeout}"]).stdout)
    sidecar = find(docs, "Deployment", "-example")["spec"]["template"]["spec"][
        "initContainers"][0]
    # Run with this interpreter: the image's path does not exist here.
    return [sys.executable, *sidecar["lifecycle"]["postStart"]["exec"]["command"][1:]]


def test_post_start_hook_returns_once_a_real_sidecar_answers(tmp_path: Path) -> None:
    """The chart's postStart program, run against a real sidecar process: it keeps
    waiting while nothing listens and returns 0 soon after the sidecar answers /livez."""
    sidecar = SidecarProcess(tmp_path, "hooked", args=[
        "--backend", "sqlite", "--dsn", str(tmp_path / "leases.db"), "--name", "hook"])
    hook = subprocess.Popen(_post_start_hook(sidecar.port, 60), stderr=subprocess.PIPE,
                            text=True)
    try:
        time.sleep(1.0)
        assert hook.poll() is None, hook.stderr.read() if hook.stderr else ""
        sidecar.start()
        sidecar.wait_http()
        answered = time.monotonic()
        assert hook.wait(timeout=10) == 0
        assert time.monotonic() - answered < 1.0  # it polls every 50 ms
    finally:
        hook.kill()
        hook.wait()
        if sidecar.proc is not None:
            assert sidecar.stop() == 0, sidecar.logs()


def test_post_start_hook_fails_when_nothing_answers_in_time() -> None:
    """Nothing on the port: the hook gives up after startTimeoutSeconds with one line
    saying so (the kubelet then kills and restarts the sidecar container)."""
    started = time.monotonic()
    done = subprocess.run(_post_start_hook(free_port(), 1), capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 1
    assert done.stderr.strip() == "lease-sidecar: no answer from /livez in 1 s"
    assert 1.0 <= time.monotonic() - started < 10


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
    # The postStart hook asks the address the sidecar listens on ("::" -> loopback).
    assert '("::1",9099)' in pod["initContainers"][0]["lifecycle"]["postStart"]["exec"][
        "command"][4]
    assert env_map(pod["containers"][0])["LEASE_LEADER_URL"] == "http://127.0.0.1:9099/leader"
    # No Lease rules without the kubernetes backend: least privilege.
    role = find(docs, "Role")
    assert rules_set(role) == ({("", "pods", v) for v in ("get", "list", "watch", "patch")}
                               | {("", "events", v) for v in ("create", "patch")})


@pytest.mark.parametrize(("backend", "repository"), [
    ("kubernetes", "lease-sidecar"), ("postgres", "lease-sidecar"),
    ("postgres-row", "lease-sidecar"), ("sqlserver", "lease-sidecar-sqlserver")])
def test_sidecar_image_follows_the_backend(backend: str, repository: str) -> None:
    """Only SQL Server needs the ODBC driver: its sidecars (the example's, the injected
    ones, the schema Job) run the Dockerfile's `sidecar-sqlserver` target, every other
    backend the ODBC-free `sidecar`; the operator image is the same for all."""
    values = {"kubernetes": [], "postgres": VALUE_SETS["postgres"],
              "postgres-row": [*VALUE_SETS["postgres-row"], "schemaJob.enabled=true",
                               "schemaJob.dsnSecret.name=admin"],
              "sqlserver": [*VALUE_SETS["sqlserver"], "schemaJob.enabled=true",
                            "schemaJob.dsnSecret.name=admin"]}[backend]
    docs = documents(template("r", "apps", [*values, "example.enabled=true",
                                            "injector.enabled=true", "image.tag=v7"]).stdout)
    images = {find(docs, "Deployment", "-example")["spec"]["template"]["spec"][
        "initContainers"][0]["image"],
        json.loads(find(docs, "ConfigMap", "-injector")["data"]["sidecar.json"])[
            "container"]["image"]}
    if backend in ("postgres-row", "sqlserver"):
        images.add(find(docs, "Job", "-schema")["spec"]["template"]["spec"][
            "containers"][0]["image"])
    assert images == {f"{repository}:v7"}
    operator = find(docs, "Deployment", "-injector")["spec"]["template"]["spec"]
    assert operator["containers"][0]["image"] == "lease-sidecar-operator:v7"


def test_injector_spec_is_the_chart_sidecar() -> None:
    """The injector injects exactly what the named template renders for the example."""
    values = ["example.enabled=true", "injector.enabled=true"]
    docs = documents(template("r", "apps", values).stdout)
    spec = json.loads(find(docs, "ConfigMap", "-injector")["data"]["sidecar.json"])
    pod = find(docs, "Deployment", "-example")["spec"]["template"]["spec"]
    assert spec["container"] == pod["initContainers"][0]
    assert spec["volumes"] == pod["volumes"]
    assert spec["appMount"] in pod["containers"][0]["volumeMounts"]
    # The Leases the Role grants, so the injector refuses a pod naming another.
    assert spec["leaseObjects"] == ["lease-sidecar.default"]
    for values_more, objects in ((["rbac.anyLease=true"], None),
                                 (["lease.backend=postgres", "lease.dsnSecret.name=pg"], None),
                                 (["rbac.leaseNames={web}"],
                                  ["lease-sidecar.default", "lease-sidecar.web"])):
        other = documents(template("r", "apps", [*values, *values_more]).stdout)
        assert json.loads(find(other, "ConfigMap", "-injector")["data"]["sidecar.json"])[
            "leaseObjects"] == objects
    webhook = find(docs, "MutatingWebhookConfiguration")["webhooks"][0]
    assert webhook["failurePolicy"] == "Fail"
    assert webhook["objectSelector"] == {"matchLabels": {"lease-sidecar/inject": "true"}}
    assert webhook["clientConfig"]["service"]["path"] == "/lease-sidecar-inject"
    assert webhook["sideEffects"] == "None"


def test_role_matches_deploy_rbac() -> None:
    """deploy/rbac.yaml (for kubectl users, who let the sidecar create its Lease) and the
    chart with rbac.createLeases=false grant exactly the same, names included."""
    path = REPO / "deploy" / "rbac.yaml"
    assert path.exists(), "deploy/rbac.yaml is missing"
    deploy_role = find(documents(path.read_text()), "Role")
    chart_role = find(documents(template("r", "apps", ["rbac.createLeases=false"]).stdout),
                      "Role")
    assert named_rules(chart_role) == named_rules(deploy_role)
    assert named_rules(chart_role) == (
        {("", "pods", v, ()) for v in ("get", "list", "watch", "patch")}
        | {("coordination.k8s.io", "leases", v, ("lease-sidecar.default",))
           for v in ("get", "list", "watch", "update")}
        | {("coordination.k8s.io", "leases", "create", ())}
        | {("", "events", v, ()) for v in ("create", "patch")})


def test_role_names_only_this_releases_leases_which_the_chart_creates() -> None:
    """Before: update on every Lease of the namespace (other controllers' included)."""
    docs = documents(template("r", "apps", VALUE_SETS["lease-names"]).stdout)
    objects = ("lease-sidecar.batch", "lease-sidecar.reports", "lease-sidecar.sweeps")
    assert named_rules(find(docs, "Role", "r-lease-sidecar")) == (
        {("", "pods", v, ()) for v in ("get", "list", "watch", "patch")}
        | {("coordination.k8s.io", "leases", v, objects)
           for v in ("get", "list", "watch", "update")}  # no create: the chart creates them
        | {("", "events", v, ()) for v in ("create", "patch")})
    leases = [d for d in docs if d["kind"] == "Lease"]
    assert sorted(d["metadata"]["name"] for d in leases) == list(objects)
    for lease in leases:
        # Kept on uninstall (the fencing token survives), and no spec: the sidecars own it.
        assert lease["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert "spec" not in lease
    # The sidecar creates them instead: then the Role needs create, on any name.
    docs = documents(template("r", "apps", ["rbac.createLeases=false"]).stdout)
    assert not [d for d in docs if d["kind"] == "Lease"]
    assert ("coordination.k8s.io", "leases", "create", ()) in named_rules(find(docs, "Role"))
    # Names chosen at will by injected pods: every Lease of the namespace.
    docs = documents(template("r", "apps", VALUE_SETS["any-lease"]).stdout)
    assert {r for r in named_rules(find(docs, "Role")) if r[1] == "leases"} == {
        ("coordination.k8s.io", "leases", v, ())
        for v in ("get", "list", "watch", "create", "update")}
    # No Lease rules or objects without the kubernetes backend.
    docs = documents(template("r", "apps", ["lease.backend=postgres",
                                            "lease.dsnSecret.name=pg"]).stdout)
    assert not [d for d in docs if d["kind"] == "Lease"]
    assert {r[1] for r in named_rules(find(docs, "Role"))} == {"pods", "events"}


def test_no_pod_or_event_rules_without_the_label() -> None:
    """lease.podLabel=off turns off the label and the pod Events: no rules for either."""
    role = find(documents(template("r", "apps", ["lease.podLabel=off"]).stdout), "Role")
    assert {r[1] for r in named_rules(role)} == {"leases"}


@pytest.mark.parametrize("values", [
    ["lease.name=Upper_Case"],
    [r"lease.name=ok\,Not_Ok"],
    ["rbac.leaseNames={Bad_Name}"],
    ["lease.keyPrefix=Prefix"],
], ids=["upper", "second-name", "lease-names", "prefix"])
def test_kubernetes_lease_names_must_be_object_names(values: list[str]) -> None:
    """The same rule as the backend (sidecar/base/names.py), before anything is installed."""
    proc = template("r", "apps", values, check=False)
    assert proc.returncode != 0
    # One line (helm adds its own hint about --debug below it).
    assert "(key prefix + name) is not a valid Kubernetes object name" in (
        proc.stderr.splitlines()[0])
    # A database backend keeps its wider names.
    assert template("r", "apps", [*values, "lease.backend=postgres",
                                  "lease.dsnSecret.name=pg"], check=False).returncode == 0


@pytest.mark.parametrize("dsn", [
    "postgresql://app:s3cret@db:5432/app",
    "postgresql://app:p@ss@db/app",  # a raw @ in the password
    "postgres://db/app?sslmode=require&password=s3cret",
    "host=db dbname=app user=app password=s3cret",
    "host=db sslpassword=s3cret",
    "Driver=FreeTDS;Server=mssql;UID=app;PWD=s3cret",
    "Driver=FreeTDS;Server=mssql;UID=app; PWD =s3cret",
    "Driver=FreeTDS;Server=mssql;UID=app;Password = s3cret",
    "Driver=FreeTDS;Server=mssql;UID=app;pwd={a}};b}",
])
def test_a_password_in_lease_dsn_is_refused(dsn: str) -> None:
    """Before: rendered in plain text into the pod spec and the injector's ConfigMap; then
    refused by the templates only, which `helm lint --strict` does not run to a failure.
    Now the schema refuses it (install, template and lint), unless explicitly allowed."""
    values = ["lease.backend=postgres-row", f"lease.dsn={dsn}", "injector.enabled=true"]
    proc = template("r", "apps", values, check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert "at '/lease/allowPasswordInDsn': value must be true" in proc.stderr
    assert "s3cret" not in proc.stderr
    lint = helm("lint", "--strict", str(CHART), *set_args(values), check=False)
    assert lint.returncode != 0 and "allowPasswordInDsn" in lint.stdout
    assert "s3cret" not in lint.stdout + lint.stderr
    # Without the schema (--skip-schema-validation) the templates still refuse it.
    proc = helm("template", "r", str(CHART), "--kube-version", kube_version(),
                "--skip-schema-validation", *set_args(values), check=False)
    assert proc.returncode != 0
    assert "lease.dsn holds a password" in proc.stderr and "s3cret" not in proc.stderr


def test_a_password_in_lease_dsn_when_explicitly_allowed() -> None:
    """lease.allowPasswordInDsn=true: accepted, and still only in the chart's Secret."""
    dsn = "postgresql://app:s3cret@db:5432/app"
    values = ["lease.backend=postgres-row", f"lease.dsn={dsn}", "injector.enabled=true",
              "example.enabled=true", "lease.allowPasswordInDsn=true"]
    assert helm("lint", "--strict", str(CHART), *set_args(values), check=False).returncode == 0
    docs = documents(template("r", "apps", values).stdout)
    assert [d["metadata"]["name"] for d in docs if "s3cret" in json.dumps(d)] == [
        "r-lease-sidecar-dsn"]


@pytest.mark.parametrize("dsn", [
    "postgresql://app@db:5432/app?sslmode=verify-full",
    "Driver=FreeTDS;Server=mssql;Database=app;Trusted_Connection=yes",
    "Driver={ODBC Driver 18 for SQL Server};Server=s;Authentication=ActiveDirectoryPassword",
])
def test_a_dsn_never_goes_into_the_injectors_configmap(dsn: str) -> None:
    values = ["lease.backend=postgres-row", f"lease.dsn={dsn}", "injector.enabled=true",
              "example.enabled=true"]
    docs = documents(template("r", "apps", values).stdout)
    configmap = find(docs, "ConfigMap", "-injector")
    assert dsn not in json.dumps(configmap)
    spec = json.loads(configmap["data"]["sidecar.json"])
    ref = {"secretKeyRef": {"name": "r-lease-sidecar-dsn", "key": "dsn"}}
    assert env_map(spec["container"])["LEASE_DSN"] == ref
    pod = find(docs, "Deployment", "-example")["spec"]["template"]["spec"]
    assert env_map(pod["initContainers"][0])["LEASE_DSN"] == ref
    secret = find(docs, "Secret", "-dsn")
    assert secret["stringData"] == {"dsn": dsn}
    assert [d["metadata"]["name"] for d in docs if dsn in json.dumps(d)] == ["r-lease-sidecar-dsn"]
    # A DSN of the user's own Secret: referenced, and the chart makes no Secret of its own.
    docs = documents(template("r", "apps", [*values, "lease.dsnSecret.name=mine",
                                            "lease.dsnSecret.key=url"]).stdout)
    spec = json.loads(find(docs, "ConfigMap", "-injector")["data"]["sidecar.json"])
    assert env_map(spec["container"])["LEASE_DSN"] == {
        "secretKeyRef": {"name": "mine", "key": "url"}}
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith(
        "-dsn")]


def test_a_literal_dsn_in_extra_env_is_refused() -> None:
    for name in ("LEASE_DSN", "LEASE_REPLICA_DSN"):
        proc = template("r", "apps", [f"sidecar.extraEnv[0].name={name}",
                                      "sidecar.extraEnv[0].value=postgresql://a:b@c/d"],
                        check=False)
        assert proc.returncode != 0
        assert f"sidecar.extraEnv: {name} must come from a Secret" in proc.stderr
    ok = template("r", "apps", ["sidecar.extraEnv[0].name=LEASE_REPLICA_DSN",
                                "sidecar.extraEnv[0].valueFrom.secretKeyRef.name=replica",
                                "sidecar.extraEnv[0].valueFrom.secretKeyRef.key=dsn"])
    assert ok.returncode == 0


def test_network_policy_admits_the_sidecar_port_only_from_probe_sources() -> None:
    docs = documents(template("r", "apps", VALUE_SETS["network-policy"]).stdout)
    policy = find(docs, "NetworkPolicy")["spec"]
    assert policy["podSelector"] == {} and policy["policyTypes"] == ["Ingress"]
    probes, others = policy["ingress"]
    assert probes == {"from": [{"ipBlock": {"cidr": "10.0.0.0/16"}},
                               {"ipBlock": {"cidr": "fd00::/64"}}],
                      "ports": [{"protocol": "TCP", "port": 8099}]}
    # Every other port stays open to everyone: the policy narrows only the sidecar's.
    assert "from" not in others
    assert others["ports"] == [
        {"protocol": "TCP", "port": 1, "endPort": 8098},
        {"protocol": "TCP", "port": 8100, "endPort": 65535},
        {"protocol": "UDP", "port": 1, "endPort": 65535},
        {"protocol": "SCTP", "port": 1, "endPort": 65535}]
    docs = documents(template("r", "apps", [*VALUE_SETS["network-policy"], "sidecar.port=1",
                                            "networkPolicy.podSelector.matchLabels.a=b"]).stdout)
    policy = find(docs, "NetworkPolicy")["spec"]
    assert policy["podSelector"] == {"matchLabels": {"a": "b"}}
    assert policy["ingress"][1]["ports"][0] == {"protocol": "TCP", "port": 2, "endPort": 65535}
    assert not [d for d in documents(template("r", "apps", []).stdout)
                if d["kind"] == "NetworkPolicy"]
    proc = template("r", "apps", ["networkPolicy.enabled=true"], check=False)
    assert proc.returncode != 0 and "networkPolicy.probeSources: give the CIDR" in proc.stderr


def test_schema_job_applies_the_ddl_before_install_and_upgrade_with_its_own_secret() -> None:
    docs = documents(template("r", "apps", VALUE_SETS["schema-job"]).stdout)
    job = find(docs, "Job", "-schema")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    (container,) = pod["containers"]
    assert container["args"] == ["schema", "--apply"]
    env = env_map(container)
    # Its own credentials, not the sidecar's; the table as the sidecar names it; nothing
    # else of extraEnv (the Job's settings are only where the table is).
    assert env == {"LEASE_BACKEND": "postgres-row",
                   "LEASE_DSN": {"secretKeyRef": {"name": "lease-admin-dsn", "key": "dsn"}},
                   "LEASE_TABLE": "locks"}
    # Off by default, and only for backends with a table.
    assert not [d for d in documents(template("r", "apps", VALUE_SETS["postgres-row"]).stdout)
                if d["kind"] == "Job"]
    for values, message in (
            (["schemaJob.enabled=true", "schemaJob.dsnSecret.name=x"],
             "schemaJob.enabled: the kubernetes backend has no table to create"),
            (["lease.backend=postgres-row", "lease.dsnSecret.name=lease-dsn",
              "schemaJob.enabled=true"], "schemaJob.dsnSecret.name: name the Secret")):
        proc = template("r", "apps", values, check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_schema_job_command_provisions_a_real_database(pg: PgServer, tmp_path: Path) -> None:
    """The Job's container, run as Kubernetes would run it (its args, its env with the
    Secret's DSN): a role that may create the schema provisions a real PostgreSQL, and
    a second run (the next upgrade) changes nothing."""
    docs = documents(template("r", "apps", VALUE_SETS["schema-job"]).stdout)
    (container,) = find(docs, "Job", "-schema")["spec"]["template"]["spec"]["containers"]
    database = f"t_{uuid.uuid4().hex[:12]}"
    admin_dsn = pg.create_database(database)  # owned by a role that may create in it
    env = {name: admin_dsn if isinstance(value, dict) else value
           for name, value in env_map(container).items()}
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "sidecar", *container["args"]],
                              env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=60, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        assert "schema applied (postgres-row, lease.locks)" in proc.stdout
    assert pg.psql("select count(*) from lease.locks", dbname=database) == "0"


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
    control_plane: ControlPlane, kube_namespace: str, tmp_path: Path
) -> None:
    cp, ns = control_plane, kube_namespace
    kubeconfig = ["--kubeconfig", str(cp.kubeconfig), "--namespace", ns]
    values = set_args(["example.enabled=true", "injector.enabled=true"])
    proc = helm("install", "demo", str(CHART), *kubeconfig, *values)
    try:
        _check_installed(cp, ns, proc.stdout, kubeconfig, values)
        token = _sidecar_leads_with_the_release_role(cp, ns, tmp_path)
    finally:
        # Leave no webhook behind that would refuse opted-in pods in other tests.
        helm("uninstall", "demo", *kubeconfig)
    gone = cp.kubectl("get", "mutatingwebhookconfiguration",
                      f"{ns}-demo-lease-sidecar-injector", check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    # The Leases outlive the release (and the upgrade that renamed the lease), so a
    # fencing token never restarts from zero.
    kept = json.loads(cp.kubectl("-n", ns, "get", "lease", "lease-sidecar.other", "-o",
                                 "json").stdout)
    assert kept["spec"]["leaseTransitions"] == token
    assert cp.kubectl("-n", ns, "get", "lease", "lease-sidecar.default").returncode == 0


def _sidecar_leads_with_the_release_role(cp: ControlPlane, ns: str, tmp_path: Path) -> int:
    """A real sidecar as the release's ServiceAccount: the chart's Lease and its narrowed
    Role (no create) are all it needs to lead. (The release was upgraded to lease.name
    "other".)"""
    kubeconfig = cp.service_account_kubeconfig(ns, "demo-lease-sidecar", create=False)
    proc = SidecarProcess(tmp_path, "chart-pod", args=[
        "--backend", "kubernetes", "--name", "other", "--pod-label", "off",
        "--lease-duration", "3s", "--renew-interval", "500ms", "--renew-deadline", "2s"],
        env={"POD_NAMESPACE": ns, "KUBECONFIG": str(kubeconfig)}).start()
    try:
        proc.wait_http()
        wait_until(lambda: proc.leader() == 200, timeout=20)
    finally:
        assert proc.stop() == 0, proc.logs()
    assert "Forbidden" not in proc.logs() and "403" not in proc.logs()
    spec = json.loads(cp.kubectl("-n", ns, "get", "lease", "lease-sidecar.other", "-o",
                                 "json").stdout)["spec"]
    assert spec["leaseTransitions"] >= 1
    return int(spec["leaseTransitions"])


def _check_installed(cp: ControlPlane, ns: str, notes: str, kubeconfig: list[str],
                     values: list[str]) -> None:
    assert f"kubectl -n {ns} get pods -L lease-role" in notes
    assert 'lease-sidecar/inject: "true"' in notes

    # The Role really lets the sidecar's ServiceAccount do its job, and no more.
    sa = f"system:serviceaccount:{ns}:demo-lease-sidecar"
    ours = "leases.coordination.k8s.io/lease-sidecar.default"
    for verb, resource in [("patch", "pods"), ("watch", "pods"), ("update", ours),
                           ("get", ours), ("watch", ours), ("create", "events"),
                           ("patch", "events")]:
        assert cp.kubectl("auth", "can-i", verb, resource, "-n", ns, "--as", sa,
                          check=False).stdout.strip() == "yes", (verb, resource)
    for verb, resource in [("delete", "pods"), ("get", "secrets"), ("delete", ours),
                           ("create", "leases.coordination.k8s.io"),
                           ("update", "leases.coordination.k8s.io/kube-scheduler"),
                           ("get", "leases.coordination.k8s.io/kube-scheduler"),
                           ("delete", "events")]:
        assert cp.kubectl("auth", "can-i", verb, resource, "-n", ns, "--as", sa,
                          check=False).stdout.strip() == "no", (verb, resource)

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


def test_leader_service_selects_the_example_pods_that_lead() -> None:
    docs = documents(template("r", "ns", VALUE_SETS["leader-service"]).stdout)
    service = find(docs, "Service", "-leader")
    deployment = find(docs, "Deployment", "-example")
    pods = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == {**deployment["spec"]["selector"]["matchLabels"],
                                           "lease-role": "leader"}
    # Every label the Service asks for but lease-role is on the workload's pods already.
    assert {k: v for k, v in service["spec"]["selector"].items() if k != "lease-role"}.items() \
        <= pods.items()
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": 8080,
                                         "protocol": "TCP"}]
    assert service["spec"]["publishNotReadyAddresses"] is False


def test_leader_service_for_a_workload_of_ones_own() -> None:
    docs = documents(template("r", "ns", [
        "leaderService.enabled=true", "leaderService.podSelector.app=webhook",
        "leaderService.name=webhook-leader", "leaderService.ports[0].port=443",
        "leaderService.ports[0].targetPort=https"]).stdout)
    service = find(docs, "Service", "webhook-leader")
    assert service["spec"]["selector"] == {"app": "webhook", "lease-role": "leader"}
    assert service["spec"]["ports"] == [{"port": 443, "targetPort": "https"}]


@pytest.mark.parametrize(("values", "message"), [
    (["leaderService.enabled=true"], "leaderService.podSelector: give the labels"),
    (["leaderService.enabled=true", "leaderService.podSelector.lease-role=standby"],
     "leaderService.podSelector: leave lease-role out"),
], ids=["no-selector", "lease-role-in-selector"])
def test_leader_service_refuses_a_selector_that_would_reach_other_pods(
        values: list[str], message: str) -> None:
    proc = template("r", "ns", values, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr


def example_sidecar_env(values: list[str]) -> dict[str, Any]:
    """The env of the sidecar the chart injects into its example Deployment."""
    docs = documents(template("r", "ns", ["example.enabled=true", *values]).stdout)
    container = next(c for c in find(docs, "Deployment", "-example")["spec"]["template"]
                     ["spec"]["initContainers"] if c["name"] == "lease-sidecar")
    return env_map(container)


def test_app_ready_containers_reach_the_sidecar_env() -> None:
    env = example_sidecar_env([
        "lease.appReadyContainers={app,worker}", "lease.appUnreadyAfter=5s",
        "lease.shutdownHandover=youngest-ready"])
    assert env["LEASE_APP_READY_CONTAINERS"] == "app,worker"
    assert env["LEASE_APP_UNREADY_AFTER"] == "5s"
    assert env["LEASE_SHUTDOWN_HANDOVER"] == "youngest-ready"
    default = example_sidecar_env([])
    assert "LEASE_APP_READY_CONTAINERS" not in default
    assert default["LEASE_SHUTDOWN_HANDOVER"] == "youngest-ready"  # auto


def test_the_control_token_and_the_outage_grace_reach_the_sidecar_env() -> None:
    env = example_sidecar_env(["lease.controlToken=true",
                               "lease.appReadyContainers={app}",
                               "lease.appReadyOutageGrace=10m"])
    assert env["LEASE_CONTROL_TOKEN_FILE"] == "/run/lease/control-token"
    assert env["LEASE_APP_READY_OUTAGE_GRACE"] == "10m"
    default = example_sidecar_env([])
    assert "LEASE_CONTROL_TOKEN_FILE" not in default  # opt-in
    assert "LEASE_APP_READY_OUTAGE_GRACE" not in default  # the sidecar's own 5m


@pytest.mark.parametrize(("values", "rendered"), [
    ([], "youngest-ready"),
    (["lease.podLabel=on"], "youngest-ready"),
    (["lease.podLabel=off"], None),  # auto: no label, so no group to pick from
    (["lease.shutdownHandover=off"], None),
    # An identity of one's own: youngest-ready needs the pod name as identity.
    (["sidecar.extraEnv[0].name=LEASE_IDENTITY", "sidecar.extraEnv[0].value=x"], None),
], ids=["default", "label-on", "label-off", "off", "own-identity"])
def test_shutdown_handover_auto_follows_the_pod_label(values: list[str],
                                                       rendered: str | None) -> None:
    assert example_sidecar_env(values).get("LEASE_SHUTDOWN_HANDOVER") == rendered


@pytest.mark.parametrize(("values", "message"), [
    (["lease.podLabel=off"], "needs lease.podLabel auto or on"),
    (["sidecar.extraEnv[0].name=LEASE_IDENTITY", "sidecar.extraEnv[0].value=x"],
     "needs the pod name as identity"),
], ids=["label-off", "own-identity"])
def test_shutdown_handover_youngest_ready_that_cannot_work_fails_to_render(
        values: list[str], message: str) -> None:
    proc = template("r", "ns", [*values, "lease.shutdownHandover=youngest-ready"],
                    check=False)
    assert proc.returncode != 0
    assert "lease.shutdownHandover=youngest-ready" in proc.stderr
    assert message in proc.stderr
