"""A real Kubernetes control plane for tests: etcd + kube-apiserver, no kubelet.

``ControlPlane`` starts etcd and kube-apiserver (built by :mod:`testkit.testbed.gobuild`)
on free 127.0.0.1 ports with a throw-away PKI, and writes an admin kubeconfig::

    with ControlPlane() as cp:
        ns = cp.create_namespace()
        cp.kubectl("-n", ns, "get", "pods")

What is real: authentication (client certificates, ServiceAccount tokens from the
TokenRequest API), RBAC and Node authorization, admission (defaults, so webhooks work
once registered), every built-in API, watches, Leases, server-side apply.

What is missing, on purpose, because no controllers or kubelet run:

* Pods are stored and stay ``Pending`` forever; nothing schedules or runs them.
* No kube-controller-manager, so no ServiceAccount controller: a new namespace gets no
  ``default`` ServiceAccount by itself.  :meth:`ControlPlane.create_namespace` creates one
  (the ServiceAccount admission plugin rejects pods whose ServiceAccount is missing);
  every other ServiceAccount must be created explicitly (see
  :meth:`ControlPlane.service_account_kubeconfig`).
* No namespace controller: a deleted namespace stays ``Terminating``.  Tests use fresh
  namespaces instead of cleaning up.
* No garbage collector: ownerReferences are stored but never acted upon.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from testkit.procs import Processes, Service, free_port, tail
from testkit.testbed import gobuild

HOST = "127.0.0.1"
SERVICE_CIDR = "10.0.0.0/24"
# The issuer doubles as the default audience; in-cluster clients expect this value.
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
START_TIMEOUT = 120.0
APISERVER = "kube-apiserver"


# --------------------------------------------------------------------------- PKI


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


def _new_key() -> ec.EllipticCurvePrivateKey:
    # P-256: generation is instant (RSA-2048 costs ~100 ms each) and every component
    # (Go TLS, kubectl, Python ssl, ES256 token signing) supports it.
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _cert_builder(
    subject: x509.Name, issuer: x509.Name, public_key: Any
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + dt.timedelta(days=2))
    )


def make_ca(directory: Path, cn: str = "lease-testbed-ca") -> CertPair:
    key = _new_key()
    name = _name(cn)
    cert = (
        _cert_builder(name, name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    pair = CertPair(directory / f"{cn}.crt", directory / f"{cn}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, pair.key)
    return pair


def issue_cert(
    ca: CertPair,
    directory: Path,
    stem: str,
    *,
    cn: str,
    org: str | None = None,
    server_names: Sequence[str] = (),
    server_ips: Sequence[str] = (),
) -> CertPair:
    """Issue a leaf cert: a serving cert if names/IPs are given, else a client cert."""
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    key = _new_key()
    is_server = bool(server_names or server_ips)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if is_server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _cert_builder(_name(cn, org), ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if is_server:
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in server_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]  # the CA key signs
    pair = CertPair(directory / f"{stem}.crt", directory / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, pair.key)
    return pair


def make_service_account_keys(directory: Path) -> CertPair:
    """Token signing key pair (CertPair.cert holds the public key PEM here)."""
    key = _new_key()
    pair = CertPair(directory / "sa.pub", directory / "sa.key")
    _write_key(key, pair.key)
    pair.cert.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pair


# --------------------------------------------------------------------------- helpers


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _q(value: str) -> str:
    # A JSON string is a valid YAML double-quoted scalar: no YAML library needed.
    return json.dumps(value)


def render_kubeconfig(
    server: str, ca: Path, user: str, credentials: dict[str, str], namespace: str = "default"
) -> str:
    """A one-cluster kubeconfig with everything embedded, so the file is self-contained."""
    cred_lines = "".join(f"    {k}: {_q(v)}\n" for k, v in credentials.items())
    return (
        "apiVersion: v1\n"
        "kind: Config\n"
        "clusters:\n"
        "- name: testbed\n"
        "  cluster:\n"
        f"    server: {_q(server)}\n"
        f"    certificate-authority-data: {_q(_b64(ca))}\n"
        "users:\n"
        f"- name: {_q(user)}\n"
        "  user:\n"
        f"{cred_lines}"
        "contexts:\n"
        "- name: testbed\n"
        "  context:\n"
        "    cluster: testbed\n"
        f"    user: {_q(user)}\n"
        f"    namespace: {_q(namespace)}\n"
        "current-context: testbed\n"
    )


# --------------------------------------------------------------------------- control plane


class ControlPlaneError(RuntimeError):
    """The control plane failed to start or a helper command failed."""


# kube-apiserver flags for a control plane that keeps ``spec.preferredHolder`` and
# ``spec.strategy``: without the CoordinatedLeaderElection gate (beta, off by default in
# 1.37) the apiserver drops them itself. Its in-apiserver controller acts only on Leases
# that have LeaseCandidates; ours have none.
COORDINATED_LEADER_ELECTION = ("--feature-gates=CoordinatedLeaderElection=true",
                               "--runtime-config=coordination.k8s.io/v1beta1=true")


class ControlPlane(Service):
    """etcd + kube-apiserver on loopback; see the module docstring for what is missing.

    ``apiserver_extra_args`` is appended last to the kube-apiserver command line, so it
    can add flags (``--admission-control-config-file=...``) or override defaults
    (``--authorization-mode=RBAC``); files it refers to may be written under
    :attr:`workdir` before :meth:`start`.  Set ``LEASE_TESTBED_KEEP=1`` to keep the
    work directory (logs, PKI, kubeconfigs) after :meth:`stop`.
    """

    def __init__(
        self,
        apiserver_extra_args: Sequence[str] = (),
        workdir: Path | None = None,
        *,
        with_nodes: bool = False,
    ) -> None:
        self.apiserver_extra_args = list(apiserver_extra_args)
        # A kubelet will register: the apiserver then needs a client certificate for
        # `kubectl logs/exec` and must call webhooks at their pods' IPs (it starts before
        # the cluster's kube-proxy, and needs none).
        self.with_nodes = with_nodes
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="lease-kube-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pki = self.workdir / "pki"
        self.kubeconfig = self.workdir / "admin.kubeconfig"
        self.version = ""  # Kubernetes gitVersion of the running apiserver
        self.apiserver_port = 0
        self.etcd_port = 0
        self._procs = Processes(self.workdir, stop_timeout=15)
        self._binaries: dict[str, Path] = {}

    # -- lifecycle -------------------------------------------------------------------

    @property
    def server(self) -> str:
        return f"https://{HOST}:{self.apiserver_port}"

    @property
    def ca_cert(self) -> Path:
        return self.pki / "ca.crt"

    def start(self) -> None:
        """Build (if needed) and start etcd and kube-apiserver; wait until ready."""
        # kube-apiserver first: it is the slowest and likeliest build to fail.
        for tool in ("kube-apiserver", "kubectl", "etcd"):
            self._binaries[tool] = gobuild.ensure_binary(tool)
        self.version = gobuild.tool_version("kube-apiserver")
        self._make_pki()
        try:
            self._with_port_retry(self._start_etcd)
            self._with_port_retry(self._start_apiserver)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the apiserver, then etcd; remove the work directory unless kept."""
        self._procs.stop_all()
        if os.environ.get("LEASE_TESTBED_KEEP") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)

    def kill_apiserver(self) -> None:
        """SIGKILL kube-apiserver (no graceful shutdown, like a crashed node); etcd and
        everything the apiserver was started with stay, for :meth:`start_apiserver`."""
        self._procs.stop(APISERVER, kill=True)

    def start_apiserver(self, attempts: int = 5) -> None:
        """Start kube-apiserver again after :meth:`kill_apiserver`: same port, etcd, PKI
        and ServiceAccount signing key, so every token and kubeconfig issued stays valid.
        Waits until /readyz answers."""
        for attempt in range(attempts):
            with self._procs.log_path(APISERVER).open("a") as log:
                log.write(f"\n--- restart at {time.time():.3f} ---\n")
            # Append: the log keeps every incarnation. Not tied to this thread either: the
            # chaos harness restarts from a worker thread, and a parent-death signal would
            # kill the apiserver when that thread ends. stop() still ends it.
            proc = self._procs.spawn(APISERVER, self._apiserver_args(), append=True,
                                     tie_to_parent=False)
            try:
                self._wait_http(APISERVER, proc, f"{self.server}/readyz",
                                ssl_ctx=self.admin_ssl_context())
                return
            except ControlPlaneError as exc:
                self.kill_apiserver()
                # Go sets SO_REUSEADDR, so the port is free again at once; anything else
                # that grabbed it in between shows up as "address already in use".
                if "address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                time.sleep(0.5)

    def restart_apiserver(self, down_for: float = 0.0) -> None:
        """A hard restart: SIGKILL kube-apiserver, keep it down ``down_for`` seconds,
        start it again on the same port and wait until it is ready."""
        self.kill_apiserver()
        time.sleep(down_for)
        self.start_apiserver()

    # -- startup pieces ----------------------------------------------------------------

    def _make_pki(self) -> None:
        self.pki.mkdir(exist_ok=True)
        ca = make_ca(self.pki)
        shutil.copy(ca.cert, self.ca_cert)
        self._ca = ca
        # The first IP of the service range is the in-cluster `kubernetes` Service.
        service_ip = str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))
        self._serving = issue_cert(
            ca,
            self.pki,
            "apiserver",
            cn="kube-apiserver",
            server_names=[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ],
            server_ips=[HOST, service_ip],
        )
        # system:masters is the bootstrap superuser group (bypasses RBAC), as kubeadm does.
        self._admin = issue_cert(ca, self.pki, "admin", cn="testbed-admin", org="system:masters")
        self._sa_keys = make_service_account_keys(self.pki)
        if self.with_nodes:
            self._kubelet_client = issue_cert(
                ca, self.pki, "apiserver-kubelet-client", cn="kube-apiserver-kubelet-client",
                org="system:masters",
            )

    def _with_port_retry(self, start: Callable[[], None], attempts: int = 3) -> None:
        """free_port() only reserves a port until it returns; another process may grab it
        before our server binds, so a start that lost that race is retried."""
        for attempt in range(attempts):
            try:
                start()
                return
            except ControlPlaneError as exc:
                if "address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                self._procs.stop_last()

    def _start_etcd(self) -> None:
        self.etcd_port, peer_port = free_port(), free_port()
        client = f"http://{HOST}:{self.etcd_port}"
        peer = f"http://{HOST}:{peer_port}"
        proc = self._procs.spawn(
            "etcd",
            [
                str(self._binaries["etcd"]),
                "--name=testbed",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=testbed={peer}",
                # Throw-away data: skipping fsync makes every write much faster.
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        self._wait_http("etcd", proc, f"{client}/health", ssl_ctx=None)

    def _apiserver_args(self) -> list[str]:
        return [
            str(self._binaries["kube-apiserver"]),
            f"--etcd-servers=http://{HOST}:{self.etcd_port}",
            f"--bind-address={HOST}",
            f"--advertise-address={HOST}",
            # Since 1.37 the endpoint reconciler refuses a loopback advertise address; it
            # only maintains the `kubernetes` Service endpoints, which no pod here uses.
            "--endpoint-reconciler-type=none",
            f"--secure-port={self.apiserver_port}",
            f"--cert-dir={self.pki}",
            f"--tls-cert-file={self._serving.cert}",
            f"--tls-private-key-file={self._serving.key}",
            f"--client-ca-file={self.ca_cert}",
            "--authorization-mode=Node,RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={self._sa_keys.cert}",
            f"--service-account-signing-key-file={self._sa_keys.key}",
            f"--api-audiences={SA_ISSUER}",
            "--allow-privileged=true",
            "--profiling=false",
            # Leave admission plugins at the version's defaults (includes
            # MutatingAdmissionWebhook / ValidatingAdmissionWebhook / ServiceAccount).
            *self._node_args(),
            *self.apiserver_extra_args,
        ]

    def _node_args(self) -> list[str]:
        if not self.with_nodes:
            return []
        return [
            # Webhooks and aggregated APIs are called at an endpoint's pod IP, which the
            # host routes to without kube-proxy's rules.
            "--enable-aggregator-routing=true",
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={self._kubelet_client.cert}",
            f"--kubelet-client-key={self._kubelet_client.key}",
        ]

    def _start_apiserver(self) -> None:
        self.apiserver_port = free_port()
        proc = self._procs.spawn(APISERVER, self._apiserver_args())
        ctx = self.admin_ssl_context()
        self._wait_http(APISERVER, proc, f"{self.server}/readyz", ssl_ctx=ctx)
        self.kubeconfig.write_text(
            render_kubeconfig(
                self.server,
                self.ca_cert,
                "testbed-admin",
                {
                    "client-certificate-data": _b64(self._admin.cert),
                    "client-key-data": _b64(self._admin.key),
                },
            )
        )
        self.kubeconfig.chmod(0o600)

    def ssl_context(self) -> ssl.SSLContext:
        """TLS context that trusts the test CA and presents no client cert.

        Use it with a bearer token: a client cert, if presented, would authenticate the
        request first and the token would be ignored.
        """
        return ssl.create_default_context(cafile=str(self.ca_cert))

    def admin_ssl_context(self) -> ssl.SSLContext:
        """TLS context trusting the test CA and presenting the admin client cert."""
        ctx = self.ssl_context()
        ctx.load_cert_chain(str(self._admin.cert), str(self._admin.key))
        return ctx

    def _wait_http(
        self, name: str, proc: subprocess.Popen[bytes], url: str, ssl_ctx: ssl.SSLContext | None
    ) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        last = ""
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ControlPlaneError(
                    f"{name} exited with {proc.returncode}:\n{tail(self._procs.log_path(name))}"
                )
            try:
                with urllib.request.urlopen(url, timeout=5, context=ssl_ctx) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.3)
        raise ControlPlaneError(
            f"{name} not ready at {url} after {START_TIMEOUT:.0f}s ({last}):\n"
            f"{tail(self._procs.log_path(name))}"
        )

    # -- credentials for other components ----------------------------------------------

    @property
    def service_account_signing_key(self) -> Path:
        """The key tokens are signed with (kube-controller-manager signs with it too)."""
        return self._sa_keys.key

    def issue_client_cert(self, stem: str, cn: str, org: str | None = None) -> CertPair:
        """A client certificate from the cluster CA: user ``cn``, group ``org``."""
        return issue_cert(self._ca, self.pki, stem, cn=cn, org=org)

    def issue_serving_cert(
        self, stem: str, cn: str, names: Sequence[str] = (), ips: Sequence[str] = ()
    ) -> CertPair:
        return issue_cert(self._ca, self.pki, stem, cn=cn, server_names=names, server_ips=ips)

    def cert_kubeconfig(self, name: str, pair: CertPair) -> Path:
        """A kubeconfig for the client certificate ``pair`` (component credentials)."""
        path = self.workdir / f"{name}.kubeconfig"
        user = name
        path.write_text(
            render_kubeconfig(
                self.server,
                self.ca_cert,
                user,
                {"client-certificate-data": _b64(pair.cert), "client-key-data": _b64(pair.key)},
            )
        )
        path.chmod(0o600)
        return path

    # -- helpers for tests -------------------------------------------------------------

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | str | None = None,
        check: bool = True,
        input: str | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run the matching kubectl (admin kubeconfig unless another is given)."""
        cmd = [str(self._binaries["kubectl"]), f"--kubeconfig={kubeconfig or self.kubeconfig}"]
        proc = subprocess.run(
            [*cmd, *args], input=input, capture_output=True, text=True, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise ControlPlaneError(
                f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr.strip()}"
            )
        return proc

    def create_namespace(self, prefix: str = "t") -> str:
        """Create a fresh, uniquely named namespace with its ``default`` ServiceAccount.

        The ServiceAccount is created here because no controller manager runs to do it,
        and the ServiceAccount admission plugin refuses pods without it.
        """
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.kubectl("create", "namespace", name)
        self.kubectl("-n", name, "create", "serviceaccount", "default")
        return name

    def ensure_service_account(self, namespace: str, name: str) -> None:
        proc = self.kubectl("-n", namespace, "create", "serviceaccount", name, check=False)
        if proc.returncode != 0 and "AlreadyExists" not in proc.stderr:
            raise ControlPlaneError(f"creating ServiceAccount {namespace}/{name}: {proc.stderr}")

    def service_account_token(
        self, namespace: str, name: str, duration: str = "2h", audience: str | None = None
    ) -> str:
        """A bound token from the TokenRequest API (what `kubectl create token` calls)."""
        args = ["-n", namespace, "create", "token", name, f"--duration={duration}"]
        if audience:
            args.append(f"--audience={audience}")
        return self.kubectl(*args).stdout.strip()

    def service_account_kubeconfig(
        self, namespace: str, sa_name: str, *, create: bool = True, duration: str = "2h"
    ) -> Path:
        """Write a kubeconfig that authenticates as ServiceAccount ``namespace/sa_name``.

        The ServiceAccount is created first when ``create`` is true (nothing else would
        create it here).  It has no permissions until a test binds a Role to it.
        """
        if create:
            self.ensure_service_account(namespace, sa_name)
        token = self.service_account_token(namespace, sa_name, duration)
        user = f"system:serviceaccount:{namespace}:{sa_name}"
        path = self.workdir / f"sa-{namespace}-{sa_name}.kubeconfig"
        path.write_text(
            render_kubeconfig(self.server, self.ca_cert, user, {"token": token}, namespace)
        )
        path.chmod(0o600)
        return path
