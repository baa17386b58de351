"""End to end: the real kube-apiserver calls the injector when an opted-in Pod is created.

Everything the chart renders for the injector is applied to the test bed (ServiceAccount,
Role, ClusterRole and bindings, the TLS Secret with the CA and certificate the chart made,
the ConfigMap with the sidecar spec, the webhook configuration with its caBundle and
namespace selectors) except that the webhooks' ``clientConfig`` points at
``https://127.0.0.1:<port>`` instead of the Service (no pods run here). The injector runs
as a local process with the chart's own arguments, as the chart's ServiceAccount (a token
kubeconfig), so the chart's RBAC is what it gets. Its serving certificate must also name
127.0.0.1, so it issues one from the chart's CA and stores it in the Secret.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from testkit.chart_support import documents, env_map, find, template
from testkit.support import REPO, free_port, get_json
from testkit.testbed.crds import install_cert_manager_crds
from testkit.testbed.kube import ControlPlane, ControlPlaneError

pytestmark = pytest.mark.kube

RELEASE = "inj"
LABEL = "lease-sidecar/inject"
NAME = "lease-sidecar/name"
NAMESPACE_LABEL = "lease-sidecar/injector"
START_TIMEOUT = 60.0


@dataclass
class Injector:
    """``lease-sidecar operator`` with the chart's args, as the chart's ServiceAccount."""

    args: list[str]
    kubeconfig: Path
    workdir: Path
    port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.workdir / "injector.log", "ab")  # noqa: SIM115 - child owns it
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "operator", *self.args,
             f"--listen=127.0.0.1:{self.port}", f"--health=127.0.0.1:{self.health_port}",
             f"--cert-dir={self.workdir / 'tls'}", "--host=127.0.0.1"],
            stdout=log, stderr=log, env=env, cwd=REPO)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while get_json(f"http://127.0.0.1:{self.health_port}/healthz")[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"injector did not start:\n{self.logs()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def logs(self) -> str:
        return (self.workdir / "injector.log").read_text(errors="replace")


@dataclass
class Env:
    cp: ControlPlane
    namespace: str
    webhook_config: str
    secret: str
    spec: dict[str, Any]
    injector: Injector
    release: str = RELEASE
    chart_ca: bytes = b""  # the CA the chart rendered into the TLS Secret

    @property
    def opt_in_value(self) -> str:
        """The namespace label value that opts a namespace in to this release."""
        return f"{self.release}.{self.namespace}"

    def pod(self, name: str, labels: dict[str, str] | None = None,
            annotations: dict[str, str] | None = None,
            containers: list[dict[str, Any]] | None = None,
            namespace: str | None = None) -> dict[str, Any]:
        """A pod; unless ``annotations`` says otherwise it names the lease "default"."""
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace or self.namespace,
                         "labels": labels or {},
                         "annotations": ({NAME: "default"} if annotations is None
                                         else annotations)},
            "spec": {"containers": containers or [
                {"name": "app", "image": "example.invalid/app:1",
                 "volumeMounts": [], "env": [{"name": "APP", "value": "1"}]}]},
        }

    def create(self, pod: dict[str, Any], *extra: str) -> subprocess.CompletedProcess[str]:
        return self.cp.kubectl("create", *extra, "-o", "json", "-f", "-",
                               input=json.dumps(pod), check=False)

    def stored(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        return json.loads(self.cp.kubectl("-n", namespace or self.namespace, "get", "pod",
                                          name, "-o", "json").stdout)

    def wait_until_called(self, namespace: str | None = None) -> None:
        """Until the apiserver has seen the configuration and reaches the webhook for
        ``namespace`` (a dry run, so nothing is stored)."""
        deadline = time.monotonic() + START_TIMEOUT
        probe = self.pod("probe", labels={LABEL: "true"}, namespace=namespace)
        while True:
            proc = self.create(probe, "--dry-run=server")
            if proc.returncode == 0 and json.loads(proc.stdout)["spec"].get("initContainers"):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"webhook never answered: {proc.stderr}\n"
                                     f"{self.injector.logs()}")
            time.sleep(0.2)


def _arg_list(container: dict[str, Any], drop: tuple[str, ...]) -> list[str]:
    return [a for a in container["args"] if not a.startswith(drop)]


def start_release(cp: ControlPlane, workdir: Path, release: str, namespace: str,
                  values: list[str], tls_dir: Path | None = None) -> Env:
    """Apply what the chart renders for ``release`` in ``namespace`` and start its injector
    (stopped, and its webhook configuration deleted, by :func:`stop_release`).

    ``tls_dir``: with ``injector.certManager.enabled``, the files of the Secret
    cert-manager would keep (tls.crt, tls.key, ca.crt), in place of the mounted Secret;
    the webhooks' caBundle is set from ca.crt, as cert-manager's CA injector does.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    docs = documents(template(release, namespace, ["injector.enabled=true", *values]).stdout)
    config = find(docs, "MutatingWebhookConfiguration")
    rest = [d for d in docs if d is not config]
    cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                      "items": rest}))
    deployment = find(docs, "Deployment", "-injector")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["lease-sidecar", "operator"]
    spec_text = find(docs, "ConfigMap", "-injector")["data"]["sidecar.json"]
    (workdir / "sidecar.json").write_text(spec_text)
    args = [*_arg_list(container, ("--spec", "--listen", "--health", "--cert-dir")),
            f"--spec={workdir / 'sidecar.json'}"]
    if tls_dir is not None:
        mounted = "/etc/lease-sidecar-injector/tls/"
        assert [a for a in args if mounted in a] == [f"--tls-file={mounted}tls.crt",
                                                     f"--tls-key={mounted}tls.key"]
        args = [a.replace(mounted, f"{tls_dir}/") for a in args]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    injector = Injector(args, cp.service_account_kubeconfig(namespace, account, create=False),
                        workdir)
    # The chart's webhooks and selectors as rendered; only the address is the local one.
    for webhook in config["webhooks"]:
        ca_bundle = (base64.b64encode((tls_dir / "ca.crt").read_bytes()).decode()
                     if tls_dir else webhook["clientConfig"]["caBundle"])
        webhook["clientConfig"] = {
            "url": f"https://127.0.0.1:{injector.port}/lease-sidecar-inject",
            "caBundle": ca_bundle}
    cp.kubectl("apply", "-f", "-", input=json.dumps(config))
    name = config["metadata"]["name"]
    secret = next((a.split("/", 1)[1] for a in args if a.startswith("--tls-secret=")), "")
    chart_ca = (base64.b64decode(find(docs, "Secret", "-injector-tls")["data"]["ca.crt"])
                if secret else b"")
    env = Env(cp, namespace, name, secret, json.loads(spec_text), injector, release, chart_ca)
    try:
        injector.start()
        env.wait_until_called()
    except BaseException:
        stop_release(env)
        raise
    return env


def stop_release(env: Env) -> None:
    env.injector.stop()
    # A Fail-policy webhook must not outlive its test.
    env.cp.kubectl("delete", "mutatingwebhookconfiguration", env.webhook_config, check=False)


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    namespace = control_plane.create_namespace("inj")
    result = start_release(control_plane, tmp_path_factory.mktemp("injector"), RELEASE,
                           namespace, ["rbac.leaseNames={sweeps}"])
    try:
        yield result
    finally:
        stop_release(result)


def test_opted_in_pod_is_stored_with_the_sidecar(env: Env) -> None:
    proc = env.create(env.pod("opted-in", labels={LABEL: "true"}))
    assert proc.returncode == 0, proc.stderr
    pod = env.stored("opted-in")
    spec = pod["spec"]
    sidecar = spec["initContainers"][0]
    want = env.spec["container"]
    assert sidecar["name"] == "lease-sidecar"
    assert sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == want["image"] and sidecar["args"] == ["run"]
    # In its group from creation, before its sidecar's first label write.
    assert pod["metadata"]["labels"]["lease-sidecar/group"] == "lease-sidecar.default"
    assert [e["name"] for e in sidecar["env"]] == [e["name"] for e in want["env"]]
    env_vars = env_map(sidecar)
    assert env_vars["POD_NAME"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env_vars["LEASE_BACKEND"] == "kubernetes"
    assert env_vars["LEASE_HTTP_ADDR"] == "0.0.0.0:8099"
    assert sidecar["securityContext"] == want["securityContext"]
    mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
    assert [mounts[m["mountPath"]] for m in want["volumeMounts"]] == want["volumeMounts"]
    # ServiceAccount admission re-ran after the webhook and gave the injected sidecar the
    # API token that the kubernetes backend and the lease-role label need.
    assert "/var/run/secrets/kubernetes.io/serviceaccount" in mounts
    # The app containers wait for the chart's start gate (its postStart hook by default).
    assert sidecar["lifecycle"] == want["lifecycle"]
    assert "startupProbe" not in sidecar and "startupProbe" not in want
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["lease-state"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Mi"}
    assert "lease-sidecar-tmp" in volumes
    app = spec["containers"][0]
    assert {"name": "lease-state", "mountPath": "/run/lease", "readOnly": True} in (
        app["volumeMounts"])
    assert env_map(app) == {"APP": "1", "LEASE_LEADER_FILE": "/run/lease/leader",
                            "LEASE_LEADER_URL": "http://127.0.0.1:8099/leader"}
    assert pod["metadata"]["annotations"]["lease-sidecar/injected"] == "lease-sidecar"


def test_annotations_set_lease_name_and_role(env: Env) -> None:
    pod = env.pod("tuned", labels={LABEL: "true"},
                  annotations={"lease-sidecar/name": "sweeps", "lease-sidecar/role": "api"})
    assert env.create(pod).returncode == 0
    env_vars = env_map(env.stored("tuned")["spec"]["initContainers"][0])
    assert env_vars["LEASE_NAME"] == "sweeps"
    assert env_vars["LEASE_ROLE"] == "api"


def test_bad_annotation_refuses_the_pod(env: Env) -> None:
    pod = env.pod("typo", labels={LABEL: "true"},
                  annotations={NAME: "default", "lease-sidecar/role": "boss"})
    proc = env.create(pod)
    assert proc.returncode != 0
    assert "annotation lease-sidecar/role: 'boss' is not one of all, worker, api" in proc.stderr


@pytest.mark.parametrize("labels", [{}, {LABEL: "false"}, {"app": "web"}])
def test_pod_that_did_not_opt_in_is_untouched(env: Env, labels: dict[str, str]) -> None:
    name = f"plain-{len(labels)}-{'-'.join(labels.values()) or 'none'}"
    pod = env.pod(name, labels=labels)
    assert env.create(pod).returncode == 0
    stored = env.stored(name)
    assert "initContainers" not in stored["spec"]
    assert stored["spec"]["containers"][0]["env"] == [{"name": "APP", "value": "1"}]
    assert "volumeMounts" not in stored["spec"]["containers"][0] or all(
        m["name"] != "lease-state" for m in stored["spec"]["containers"][0]["volumeMounts"])
    assert "lease-sidecar/injected" not in (stored["metadata"].get("annotations") or {})


def test_declared_sidecar_is_not_injected_again(env: Env) -> None:
    declared = {**env.spec["container"], "image": "example.invalid/my-own:2"}
    pod = env.pod("declared", labels={LABEL: "true"})
    pod["spec"]["initContainers"] = [declared]
    pod["spec"]["volumes"] = env.spec["volumes"]
    assert env.create(pod).returncode == 0
    stored = env.stored("declared")
    assert [c["image"] for c in stored["spec"]["initContainers"]] == ["example.invalid/my-own:2"]
    assert "lease-sidecar/injected" not in (stored["metadata"].get("annotations") or {})


def _ca(env: Env) -> bytes:
    secret = json.loads(env.cp.kubectl("-n", env.namespace, "get", "secret", env.secret,
                                       "-o", "json").stdout)
    assert set(secret["data"]) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}
    return base64.b64decode(secret["data"]["ca.crt"])


def test_tls_is_kept_in_the_secret_and_trusted_by_the_webhook(env: Env) -> None:
    """The chart made the CA (genCA, RSA); the injector keeps it and issues the serving
    certificate it needs (here one that also names 127.0.0.1) from it, so the caBundle
    the chart rendered stays valid."""
    ca = _ca(env)
    assert ca == env.chart_ca
    config = json.loads(env.cp.kubectl("get", "mutatingwebhookconfiguration",
                                       env.webhook_config, "-o", "json").stdout)
    assert [base64.b64decode(w["clientConfig"]["caBundle"]) for w in config["webhooks"]] == [
        ca, ca]
    # The served certificate chains to that CA and names the chart's Service and 127.0.0.1.
    ctx = ssl.create_default_context(cadata=ca.decode())
    served = ssl.get_server_certificate(("127.0.0.1", env.injector.port))
    cert = x509.load_pem_x509_certificate(served.encode())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"inj-lease-sidecar-injector.{env.namespace}.svc" in san.get_values_for_type(
        x509.DNSName)
    assert ctx.verify_mode == ssl.CERT_REQUIRED


def test_a_pod_without_a_lease_name_is_refused(env: Env) -> None:
    """Before: injected with LEASE_NAME=default, so every injected workload of the
    namespace contended for one lease and only one pod across all of them led."""
    proc = env.create(env.pod("nameless", labels={LABEL: "true"}, annotations={}))
    assert proc.returncode != 0
    assert ("the pod has no lease-sidecar/name annotation: name the lease its workload "
            "contends for") in proc.stderr
    assert env.cp.kubectl("-n", env.namespace, "get", "pod", "nameless",
                          check=False).returncode != 0


def test_a_lease_the_role_does_not_grant_refuses_the_pod(env: Env) -> None:
    """Before: injected, and its sidecar then failed closed on 403s for its Lease."""
    proc = env.create(env.pod("ungranted", labels={LABEL: "true"}, annotations={NAME: "web"}))
    assert proc.returncode != 0
    assert ("annotation lease-sidecar/name: the release's Role does not grant the Lease "
            "'lease-sidecar.web' (it grants lease-sidecar.default, lease-sidecar.sweeps): "
            "add 'web' to the chart value rbac.leaseNames") in proc.stderr


def _labelled_namespace(env: Env, value: str | None) -> str:
    namespace = env.cp.create_namespace("other")
    if value is not None:
        env.cp.kubectl("label", "namespace", namespace, f"{NAMESPACE_LABEL}={value}")
    return namespace


def test_a_namespace_that_did_not_opt_in_is_not_served(env: Env) -> None:
    """Before: every namespace but kube-system, though the Role, binding and DSN Secret the
    sidecar needs exist only in the release namespace: it failed closed, silently."""
    for value in (None, "another.release"):
        namespace = _labelled_namespace(env, value)
        pod = env.pod("opted-in-pod", labels={LABEL: "true"}, namespace=namespace)
        assert env.create(pod).returncode == 0
        stored = env.stored("opted-in-pod", namespace)
        assert "initContainers" not in stored["spec"], value
        assert "lease-sidecar/injected" not in stored["metadata"]["annotations"]


def test_a_namespace_labelled_for_the_release_is_served(env: Env) -> None:
    namespace = _labelled_namespace(env, env.opt_in_value)
    env.wait_until_called(namespace)  # the apiserver sees new namespace labels in moments
    assert env.create(env.pod("there", labels={LABEL: "true"}, namespace=namespace)
                      ).returncode == 0
    stored = env.stored("there", namespace)
    assert [c["name"] for c in stored["spec"]["initContainers"]] == ["lease-sidecar"]


def test_two_releases_never_both_inject_a_pod(env: Env, control_plane: ControlPlane,
                                              tmp_path: Path) -> None:
    """Before: two releases installed two webhooks with the same selector. Now each
    namespace has one release: its own, or the one its label names. The proof that the
    other release's webhook is not even called: with that injector stopped (failure
    policy Fail), the pod is still created."""
    other_ns = control_plane.create_namespace("inj-b")
    other = start_release(control_plane, tmp_path / "b", "injb", other_ns, ["image.tag=b"])
    try:
        def sidecars(name: str, namespace: str) -> list[str]:
            spec = env.stored(name, namespace)["spec"]
            return [c["image"] for c in spec.get("initContainers") or []]

        # Each release namespace is its own release's.
        for target, image in ((env, "lease-sidecar:0.1.0"), (other, "lease-sidecar:b")):
            assert target.create(target.pod("one", labels={LABEL: "true"})).returncode == 0
            assert sidecars("one", target.namespace) == [image]

        # A namespace labelled for release A, even B's own: A's alone.
        labelled = _labelled_namespace(env, env.opt_in_value)
        control_plane.kubectl("label", "namespace", other_ns,
                              f"{NAMESPACE_LABEL}={env.opt_in_value}")
        for namespace in (labelled, other_ns):
            env.wait_until_called(namespace)
            assert env.create(env.pod("two", labels={LABEL: "true"}, namespace=namespace)
                              ).returncode == 0
            assert sidecars("two", namespace) == ["lease-sidecar:0.1.0"]

        other.injector.stop()
        for namespace in (labelled, other_ns):
            proc = env.create(env.pod("three", labels={LABEL: "true"}, namespace=namespace))
            assert proc.returncode == 0, proc.stderr
            assert sidecars("three", namespace) == ["lease-sidecar:0.1.0"]
        # B's webhook is still there and fails closed for what is B's.
        unlabelled = control_plane.kubectl("label", "namespace", other_ns,
                                           f"{NAMESPACE_LABEL}-")
        assert unlabelled.returncode == 0
        deadline = time.monotonic() + 30
        while (proc := env.create(env.pod("four", labels={LABEL: "true"},
                                          namespace=other_ns))).returncode == 0:
            assert time.monotonic() < deadline, "B's webhook was never called again"
            env.cp.kubectl("-n", other_ns, "delete", "pod", "four", "--wait=false")
            time.sleep(0.3)
        assert "failed calling webhook" in proc.stderr
    finally:
        stop_release(other)


def _self_signed(hosts: list[str]) -> tuple[bytes, bytes]:
    """A serving certificate that is its own CA, as cert-manager's selfSigned issuer (the
    chart's default with certManager.enabled) makes it: ca.crt is tls.crt."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    now = dt.datetime.now(dt.UTC)
    sans: list[x509.GeneralName] = [x509.DNSName(h) for h in hosts[:-1]]
    sans.append(x509.IPAddress(ipaddress.ip_address(hosts[-1])))
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def test_cert_manager_certificate_files_are_served(control_plane: ControlPlane,
                                                   tmp_path: Path) -> None:
    """injector.certManager.enabled: the injector serves the key and certificate files of
    cert-manager's Secret (--tls-file, --tls-key), with no Secret or webhook rights of its
    own, and the apiserver calls it trusting ca.crt. (No cert-manager controller runs here:
    the files are what its self-signed issuer writes; its CRDs validate the Certificate.)"""
    install_cert_manager_crds(control_plane)
    namespace = control_plane.create_namespace("inj-cm")
    cert, key = _self_signed([f"cm-lease-sidecar-injector.{namespace}.svc", "127.0.0.1"])
    tls_dir = tmp_path / "cert-manager"
    tls_dir.mkdir()
    for name, data in (("tls.crt", cert), ("tls.key", key), ("ca.crt", cert)):
        (tls_dir / name).write_bytes(data)
    env = start_release(control_plane, tmp_path / "injector", "cm", namespace,
                        ["injector.certManager.enabled=true"], tls_dir=tls_dir)
    try:
        assert env.create(env.pod("cm-pod", labels={LABEL: "true"})).returncode == 0
        assert [c["name"] for c in env.stored("cm-pod")["spec"]["initContainers"]] == [
            "lease-sidecar"]
        served = ssl.get_server_certificate(("127.0.0.1", env.injector.port))
        assert served.encode() == cert
        stored = json.loads(control_plane.kubectl(
            "-n", namespace, "get", "certificate", "cm-lease-sidecar-injector", "-o",
            "json").stdout)
        assert stored["spec"]["secretName"] == "cm-lease-sidecar-injector-cert"
    finally:
        stop_release(env)


def test_name_the_lease_object_cannot_have_refuses_the_pod(env: Env) -> None:
    """Before: injected as is; the sidecar then crash-looped (exit 2) on its own settings."""
    pod = env.pod("upper", labels={LABEL: "true"},
                  annotations={"lease-sidecar/name": "Upper_Case"})
    proc = env.create(pod)
    assert proc.returncode != 0
    assert ("annotation lease-sidecar/name: 'lease-sidecar.Upper_Case' (key prefix + name) is "
            "not a valid Kubernetes object name") in proc.stderr
    assert env.cp.kubectl("-n", env.namespace, "get", "pod", "upper",
                          check=False).returncode != 0


def _post_review(env: Env, body: bytes) -> tuple[int, bytes]:
    """POST straight to the injector's HTTPS port, trusting the CA it keeps in its Secret."""
    context = ssl.create_default_context(cadata=_ca(env).decode())
    context.check_hostname = False  # the certificate names 127.0.0.1 as an IP SAN
    request = urllib.request.Request(
        f"https://127.0.0.1:{env.injector.port}/lease-sidecar-inject", data=body,
        method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


# What ServiceAccount admission adds to a pod before any webhook sees it: a review made
# by hand carries it too, or the injector refuses the pod for want of a token.
ADMITTED_TOKEN_VOLUME = {"name": "kube-api-access-abcde", "projected": {"sources": [
    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
]}}


def _review(env: Env, operation: str, name: str) -> dict[str, Any]:
    pod = env.pod(name, labels={LABEL: "true"})
    pod["spec"]["volumes"] = [ADMITTED_TOKEN_VOLUME]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": f"uid-{name}", "operation": operation,
                        "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "resource": {"group": "", "version": "v1", "resource": "pods"},
                        "namespace": env.namespace, "name": name,
                        "userInfo": {"username": "tester"},
                        "object": pod, "oldObject": pod if operation == "UPDATE" else None}}


def test_only_create_is_mutated(env: Env) -> None:
    """Before: an UPDATE review of an opted-in pod came back with the injection patch."""
    status, raw = _post_review(env, json.dumps(_review(env, "CREATE", "c")).encode())
    created = json.loads(raw)["response"]
    assert status == 200 and created["allowed"] is True and created["patchType"] == "JSONPatch"
    status, raw = _post_review(env, json.dumps(_review(env, "UPDATE", "u")).encode())
    assert status == 200
    assert json.loads(raw)["response"] == {"uid": "uid-u", "allowed": True}
    # The chart sends CREATE only in the first place.
    config = json.loads(env.cp.kubectl("get", "mutatingwebhookconfiguration",
                                       env.webhook_config, "-o", "json").stdout)
    assert [r["operations"] for r in config["webhooks"][0]["rules"]] == [["CREATE"]]


def test_malformed_reviews_get_a_denial_or_400_never_exception_text(env: Env) -> None:
    """Before: 500 with Python exception text ("'str' object has no attribute 'get'")."""
    broken_pod = _review(env, "CREATE", "broken")
    broken_pod["request"]["object"]["spec"]["containers"] = "app"
    no_user = _review(env, "CREATE", "nouser")
    del no_user["request"]["userInfo"]
    cases = [
        (b"{not json", 400, b"the body is not a JSON AdmissionReview"),
        (b"[1, 2]", 400, b"the body is not a JSON object"),
        (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}',
         400, b"request.uid is missing"),
        (json.dumps(no_user).encode(), 200, b"request.userInfo is missing or not a map"),
        (json.dumps(broken_pod).encode(), 200,
         b"malformed pod: spec.containers is not a list of maps"),
    ]
    for body, status, text in cases:
        got, raw = _post_review(env, body)
        assert got == status and text in raw, (body[:60], got, raw)
        if status == 200:
            answer = json.loads(raw)["response"]
            assert answer["allowed"] is False and answer["status"]["code"] == 400
        assert b"Traceback" not in raw and b"object has no attribute" not in raw
    assert "Traceback" not in env.injector.logs()


# Last: it leaves the injector stopped and the failure policy at Ignore.
# -- pods the sidecar could not serve: each refused with its own message -----------------

def _unservable(env: Env, case: str) -> dict[str, Any]:
    pod = env.pod(f"unservable-{case}", labels={LABEL: "true"})
    spec, app = pod["spec"], pod["spec"]["containers"][0]
    if case == "automount":
        spec["automountServiceAccountToken"] = False
    elif case == "mount":
        spec["volumes"] = [{"name": "mine", "emptyDir": {}}]
        app["volumeMounts"] = [{"name": "mine", "mountPath": "/run/lease"}]
    elif case == "volume":
        spec["volumes"] = [{"name": "lease-state", "hostPath": {"path": "/srv/lease"}}]
    elif case == "port":
        app["ports"] = [{"containerPort": 8099}]
    elif case == "hostnetwork":
        spec["hostNetwork"] = True
    return pod


REFUSALS = {
    "automount": "automountServiceAccountToken: false: the sidecar needs the Kubernetes API "
                 "for its Lease (kubernetes backend) and the lease-role label and pod Events "
                 "(lease.podLabel) and would get no ServiceAccount token",
    "mount": "container 'app' (containers) already mounts 'mine' at /run/lease, inside the "
             "sidecar's state directory /run/lease where the app reads the leader file",
    "volume": "the pod already has a volume named 'lease-state', the name of the sidecar's "
              "own volume (lease-sidecar-tmp, lease-state): rename it",
    "port": "container 'app' (containers) uses port 8099, the sidecar's HTTP port",
    "hostnetwork": "hostNetwork: true: the sidecar would listen on the node's network",
}


def test_each_pod_the_sidecar_cannot_serve_is_refused_with_its_own_message(env: Env) -> None:
    """Before: all five were injected; the sidecar then failed closed (no token: /leader
    503 forever while /healthz said 200), or the app never saw the leader file, or two
    pods on a node shared one (a hostPath named lease-state), or a bind failed, or the
    sidecar's POST /release was open to the node."""
    for case, message in REFUSALS.items():
        proc = env.create(_unservable(env, case))
        assert proc.returncode != 0, case
        assert message in proc.stderr, (case, proc.stderr)
        assert [m for c, m in REFUSALS.items() if c != case and m in proc.stderr] == []
        assert env.cp.kubectl("-n", env.namespace, "get", "pod", f"unservable-{case}",
                              check=False).returncode != 0


def test_a_serviceaccount_without_automount_refuses_the_pod(env: Env) -> None:
    """The pod does not say, its ServiceAccount does: ServiceAccount admission, which runs
    before the webhook, then added no token, and that is what the injector sees."""
    env.cp.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "tokenless", "namespace": env.namespace},
        "automountServiceAccountToken": False}))
    pod = env.pod("tokenless", labels={LABEL: "true"})
    pod["spec"]["serviceAccountName"] = "tokenless"
    proc = env.create(pod)
    assert proc.returncode != 0
    assert ("the pod gets no ServiceAccount token (its ServiceAccount 'tokenless' sets "
            "automountServiceAccountToken: false): the sidecar needs the Kubernetes API"
            ) in proc.stderr


def test_a_pod_bringing_its_own_token_gets_it_mounted_in_the_sidecar(env: Env) -> None:
    pod = env.pod("own-token", labels={LABEL: "true"})
    pod["spec"]["automountServiceAccountToken"] = False
    pod["spec"]["volumes"] = [{"name": "my-token", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
        {"configMap": {"name": "kube-root-ca.crt",
                       "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}]
    proc = env.create(pod)
    assert proc.returncode == 0, proc.stderr
    sidecar = env.stored("own-token")["spec"]["initContainers"][0]
    assert {"name": "my-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True} in sidecar["volumeMounts"]


# Last: it leaves this module's injector stopped.
def test_failure_policy_with_the_injector_stopped(env: Env) -> None:
    """Fail (the default): opted-in Pods are refused, others created; Ignore: created bare."""
    ca = _ca(env)
    env.injector.stop()
    refused = env.create(env.pod("while-down", labels={LABEL: "true"}))
    assert refused.returncode != 0
    assert "failed calling webhook" in refused.stderr
    assert env.cp.kubectl("-n", env.namespace, "get", "pod", "while-down",
                          check=False).returncode != 0
    assert env.create(env.pod("plain-while-down")).returncode == 0

    # Back up: the Secret's CA is reused (no caBundle churn) and injection resumes.
    env.injector.start()
    env.wait_until_called()
    assert _ca(env) == ca
    assert env.create(env.pod("after-restart", labels={LABEL: "true"})).returncode == 0
    assert env.stored("after-restart")["spec"]["initContainers"][0]["name"] == "lease-sidecar"

    # failurePolicy Ignore: the opted-in Pod is created, without a sidecar (so it never
    # leads: no file, nothing answers on :8099).
    env.injector.stop()
    env.cp.kubectl("patch", "mutatingwebhookconfiguration", env.webhook_config, "--type=json",
                   "-p", json.dumps([{"op": "replace", "path": "/webhooks/0/failurePolicy",
                                      "value": "Ignore"}]))
    deadline = time.monotonic() + 30
    while (proc := env.create(env.pod("ignored", labels={LABEL: "true"}))).returncode != 0:
        # The apiserver picks up the changed configuration within moments.
        if time.monotonic() > deadline:
            raise ControlPlaneError(proc.stderr)
        time.sleep(0.2)
    stored = env.stored("ignored")
    assert "initContainers" not in stored["spec"]
    assert "lease-sidecar/injected" not in (stored["metadata"].get("annotations") or {})


