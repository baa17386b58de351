"""A one-node Kubernetes cluster that runs real pods: the test bed for end-to-end tests.

On top of :class:`testkit.testbed.kube.ControlPlane` (etcd + kube-apiserver) it starts
kube-controller-manager, kube-scheduler, a kubelet and kube-proxy (all built by
:mod:`testkit.testbed.gobuild`, same release) with containerd + runc and the CNI plugins
from Debian's packages::

    with Cluster() as cluster:
        cluster.load_image(archive)                 # a docker-archive tar
        cluster.kubectl("apply", "-f", "-", input=manifest)
        cluster.helm("install", ...)
        cluster.kubectl_json("get", "pods", "-A")

The node network is a bridge (:data:`BRIDGE`, :data:`NODE_IP`) made before the kubelet
starts; pods get addresses from :data:`POD_CIDR` and reach the host, which is also the
node IP.  kube-proxy (iptables mode, its defaults but for what would change the host
beyond its own chains) makes every Service's ClusterIP reach its ready endpoints, from
pods and from the host.  No DNS.  Pods reach the apiserver (which stays on 127.0.0.1,
so the ``kubernetes`` Service has no endpoints) through that Service's IP by a DNAT rule
of our own, and the apiserver calls webhooks at pod IPs (``--enable-aggregator-routing``).
Images come from archives only (``imagePullPolicy: Never``); the kubelet never
garbage-collects them.

Needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN on a cgroup v1 host
(:func:`unavailable_reason` says why not).  Only one cluster runs per machine (the
kubelet's sysctls, chains and cgroup trees are global): :meth:`Cluster.start` waits for
a machine-wide lock.  :meth:`Cluster.stop` removes everything the cluster did to the
host (see :mod:`testkit.testbed.hostguard`), also after a failed start; a run killed
outright is swept by the next :meth:`Cluster.start` or by
``python -m testkit.testbed.cluster cleanup``.  Set ``LEASE_TESTBED_KEEP=1`` to keep the
work directory (every component's log) after a stop.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from testkit.procs import Processes, Service, free_port
from testkit.testbed import gobuild, hostguard, tinyimages
from testkit.testbed.kube import SERVICE_CIDR, ControlPlane, ControlPlaneError

BRIDGE = "lstb0"
POD_CIDR = "10.244.0.0/24"
NODE_IP = "10.244.0.1"
NODE_NAME = "testbed-node"
SERVICE_IP = str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))  # `kubernetes` Service
DNAT_CHAIN = "LEASE-TB-APISERVER"
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "portmap", "loopback")
HOST_COMMANDS = {
    "containerd": "containerd",
    "containerd-shim-runc-v2": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "iptables": "iptables",
    "ip6tables": "iptables",
    "iptables-save": "iptables",  # kube-proxy
    "iptables-restore": "iptables",
    "ip": "iproute2",
    "gcc": "gcc",
    "mount": "mount",
    "umount": "mount",
}
COMPONENTS = ("kubelet", "kube-controller-manager", "kube-scheduler", "kube-proxy")
READY_TIMEOUT = 120.0
CONTAINERD_TMPFS = "6g"  # an upper bound; only what is stored uses memory

T = TypeVar("T")


class ClusterError(RuntimeError):
    """The cluster could not start, or a command against it failed."""


# --------------------------------------------------------------------------- host checks


def _capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def unavailable_reason() -> str | None:
    """Why this host cannot run the cluster at all (tests skip), or None if it can."""
    if sys.platform != "linux":
        return "the one-node cluster needs Linux"
    if os.geteuid() != 0:
        return "the one-node cluster needs root (kubelet, containerd, iptables, mounts)"
    caps = _capabilities()
    missing = [name for bit, name in ((12, "CAP_NET_ADMIN"), (21, "CAP_SYS_ADMIN"))
               if not caps >> bit & 1]
    if missing:
        return f"the one-node cluster needs {' and '.join(missing)} (bridge, iptables, mounts)"
    if not Path("/sys/fs/cgroup/memory/cgroup.procs").exists():
        return "the one-node cluster needs cgroup v1 (this kubelet setup is not tried on v2)"
    return None


def missing_packages() -> list[str]:
    """Debian packages whose commands are missing (scripts/test installs them)."""
    missing = {pkg for cmd, pkg in HOST_COMMANDS.items() if not shutil.which(cmd)}
    if any(not (CNI_BIN_DIR / p).exists() for p in CNI_PLUGINS):
        missing.add("containernetworking-plugins")
    if not tinyimages.BUSYBOX.exists():
        missing.add("busybox-static")
    return sorted(missing)


def _run(
    cmd: list[str], timeout: float = 60, check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


# --------------------------------------------------------------------------- the cluster


class Cluster(Service):
    """A one-node cluster; see the module docstring."""

    def __init__(self, workdir: Path | None = None) -> None:
        self._owns_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="lease-cluster-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.node_ip = NODE_IP
        self.node_name = NODE_NAME
        self.pod_cidr = POD_CIDR
        self.bridge = BRIDGE
        self.service_ip = SERVICE_IP
        self.kubelet_port = 0
        self.control_plane = ControlPlane(workdir=self.workdir / "control-plane", with_nodes=True)
        self.stale_found: list[str] = []  # what the start swept after an earlier dead run
        self.startup_seconds = 0.0
        self._procs = Processes(self.workdir, stop_timeout=10, append_logs=True,
                               new_session=True)
        self._binaries: dict[str, Path] = {}
        self._lock = hostguard.HostLock()
        self._snapshot: hostguard.Snapshot | None = None
        self._ctr_address = self.workdir / "containerd" / "containerd.sock"
        self._kubelet_reader: Any = None  # client cert for the kubelet's own API
        self._proxy_healthz_port = 0
        self._started = False

    # -- public surface ----------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (system:masters)."""
        return self.control_plane.kubeconfig

    @property
    def running(self) -> bool:
        return self._started

    def start(self) -> None:
        """Build what is missing, claim the host, start everything, wait for node Ready."""
        reason = unavailable_reason()
        if reason:
            raise ClusterError(reason)
        missing = missing_packages()
        if missing:
            raise ClusterError(
                "missing Debian packages for the one-node cluster (scripts/test installs "
                f"them): apt-get install {' '.join(missing)}"
            )
        for tool in COMPONENTS:
            self._binaries[tool] = gobuild.ensure_binary(tool)
        pause = tinyimages.pause_image()
        self.stale_found = self._lock.acquire()
        began = time.monotonic()
        try:
            self._snapshot = hostguard.snapshot(self.workdir, self.bridge)
            self._lock.record(self._snapshot)
            self._started = True
            self._make_bridge()
            self.control_plane.start()
            self._route_service_ip()
            self._start_containerd(pause.ref)
            self.load_image(pause.archive)
            self._start_components()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began

    def stop(self) -> None:
        """Stop everything and undo every change to the host; idempotent."""
        if not self._started:  # never started, or failed before touching the host
            self._lock.release()
            if self._owns_workdir and os.environ.get("LEASE_TESTBED_KEEP") != "1":
                shutil.rmtree(self.workdir, ignore_errors=True)
            return
        keep = os.environ.get("LEASE_TESTBED_KEEP") == "1"
        try:
            # The kubelet first, so nothing restarts what the sweep kills.
            self._procs.stop_all()
            assert self._snapshot is not None
            # Pods and the control plane die together: an apiserver stopped first would
            # wait for the pods' watches to drain before it exits.
            hostguard.kill_processes(self._snapshot)
            with contextlib.suppress(Exception):
                self.control_plane.stop()
            remaining = hostguard.sweep(self._snapshot, keep_workdir=keep)
            if remaining:
                raise ClusterError(
                    "the cluster's teardown left these behind:\n" + "\n".join(remaining)
                )
            self._lock.forget()
        finally:
            self._started = False
            self._lock.release()

    def kubectl(
        self,
        *args: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 60,
        kubeconfig: Path | str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """kubectl of the same release, as admin unless another kubeconfig is given."""
        try:
            return self.control_plane.kubectl(
                *args, check=check, input=input, timeout=timeout, kubeconfig=kubeconfig
            )
        except ControlPlaneError as exc:
            raise ClusterError(str(exc)) from None

    def kubectl_json(self, *args: str, timeout: float = 60) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def helm(
        self, *args: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """The cached helm against this cluster; its config/cache/data stay in the workdir."""
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig))
        for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            env[var] = str(self.workdir / "helm" / var.lower())
        cmd = [str(gobuild.ensure_binary("helm")), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if check and proc.returncode != 0:
            raise ClusterError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def load_image(self, archive: Path | str) -> list[str]:
        """Import a docker-archive or OCI tar into the node's image store; return its refs."""
        out = self._ctr("images", "import", "--snapshotter", "overlayfs", str(archive), timeout=600)
        return [line.split()[1] for line in out.splitlines() if line.startswith("unpacking ")]

    def images(self) -> list[str]:
        return self._ctr("images", "list", "-q").split()

    def tag_image(self, ref: str, name: str) -> None:
        """Give a loaded image another name, as ``kind load docker-image NAME`` leaves it:
        a short ``name`` (``lease-sidecar:dev``) is the runtime's ``docker.io/library/…``."""
        if "/" not in name.split(":")[0]:
            name = f"docker.io/library/{name}"
        elif "." not in name.split("/")[0]:
            name = f"docker.io/{name}"
        if name not in self.images():
            self._ctr("images", "tag", ref, name)

    def busybox(self) -> str:
        """Load the busybox-static image (once) and return its ref."""
        image = tinyimages.busybox_image()
        if image.ref not in self.images():
            self.load_image(image.archive)
        return image.ref

    def create_namespace(self, prefix: str = "e2e") -> str:
        """A fresh namespace, once its ``default`` ServiceAccount exists (pods need it)."""
        name = f"{prefix}-{os.urandom(4).hex()}"
        self.kubectl("create", "namespace", name)
        self.wait_for(
            lambda: self.kubectl("-n", name, "get", "sa", "default", check=False).returncode == 0,
            30,
            f"ServiceAccount {name}/default",
        )
        return name

    def wait_for(self, predicate: Callable[[], T], timeout: float, what: str,
                 interval: float = 0.2) -> T:
        """Poll until ``predicate()`` is truthy; return it or raise naming ``what``."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(interval)

    def kubelet_get(self, path: str, timeout: float = 10) -> Any:
        """GET a kubelet API path (for example ``/stats/summary``) as admin; parsed JSON."""
        ctx = ssl.create_default_context(cafile=str(self.control_plane.ca_cert))
        admin = self._kubelet_reader
        ctx.load_cert_chain(str(admin.cert), str(admin.key))
        url = f"https://{self.node_ip}:{self.kubelet_port}{path}"
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:
            return json.load(resp)

    @property
    def kubelet_root(self) -> Path:
        return self.workdir / "kubelet" / "root"

    def empty_dir(self, pod_uid: str, volume: str) -> Path:
        """Where the node keeps a pod's ``emptyDir`` volume (readable from the host)."""
        return self.kubelet_root / "pods" / pod_uid / "volumes" / "kubernetes.io~empty-dir" / volume

    def log_path(self, component: str) -> Path:
        """Where a component logs (kubelet, containerd, kube-apiserver, ...)."""
        if component in ("kube-apiserver", "etcd"):
            return self.control_plane.workdir / f"{component}.log"
        return self.workdir / f"{component}.log"

    # -- node network --------------------------------------------------------------------

    def _make_bridge(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.node_ip}/{POD_CIDR.split('/')[1]}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        # Lets packets from pods be DNATed to 127.0.0.1 (the apiserver's address).
        hostguard.write_sysctl(f"net.ipv4.conf.{self.bridge}.route_localnet", "1")

    def _route_service_ip(self) -> None:
        port = self.control_plane.apiserver_port
        ipt = ["iptables", "-w", "5", "-t", "nat"]
        _run([*ipt, "-N", DNAT_CHAIN])
        _run([*ipt, "-A", DNAT_CHAIN, "-d", f"{self.service_ip}/32", "-p", "tcp",
              "--dport", "443", "-j", "DNAT", "--to-destination", f"127.0.0.1:{port}"])
        for hook in ("PREROUTING", "OUTPUT"):
            _run([*ipt, "-I", hook, "-j", DNAT_CHAIN])

    # -- processes -----------------------------------------------------------------------

    def _check_alive(self) -> None:
        exited = self._procs.exited(lines=30)
        if exited:
            raise ClusterError(exited)

    # -- containerd --------------------------------------------------------------------

    def _containerd_config(self, sandbox_image: str) -> str:
        d = self.workdir / "containerd"
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return f"""version = 2
root = "{d / 'root'}"
state = "{d / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = "{self._ctr_address}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'opt'}"

[{cri}]
  sandbox_image = "{sandbox_image}"
  # Without it every sandbox fails ("can't get final child's PID from pipe"): the
  # kubelet asks for oom_score_adj -998, which needs CAP_SYS_RESOURCE, absent here.
  restrict_oom_score_adj = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # Pod network namespaces are pinned inside the work directory, not in /run/netns.
  netns_mounts_under_state_dir = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "{CNI_BIN_DIR}"
  conf_dir = "{self.workdir / 'cni' / 'net.d'}"
"""

    def _cni_config(self) -> dict[str, Any]:
        return {
            "cniVersion": "1.0.0",
            "name": "lease-testbed",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": True,
                    "ipMasq": False,  # pods talk to the host and each other only
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.pod_cidr, "gateway": self.node_ip}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.workdir / "cni" / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }

    def _start_containerd(self, sandbox_image: str) -> None:
        d = self.workdir / "containerd"
        (d / "root").mkdir(parents=True, exist_ok=True)
        # Images and container layers in memory: importing the sidecar image is faster,
        # and teardown is an unmount instead of deleting thousands of files.
        _run(["mount", "-t", "tmpfs", "-o", f"size={CONTAINERD_TMPFS},mode=0700", "tmpfs",
              str(d / "root")])
        conf_dir = self.workdir / "cni" / "net.d"
        conf_dir.mkdir(parents=True, exist_ok=True)
        (conf_dir / "10-lease-testbed.conflist").write_text(json.dumps(self._cni_config()))
        config = d / "config.toml"
        config.write_text(self._containerd_config(sandbox_image))
        proc = self._procs.spawn("containerd", ["containerd", "--config", str(config)])

        def answers() -> bool:
            if proc.poll() is not None:
                self._check_alive()
            return self._ctr_ok("version")

        self.wait_for(answers, 60, "containerd to answer")

    def _ctr_cmd(self, *args: str) -> list[str]:
        return ["ctr", "--address", str(self._ctr_address), "--namespace", "k8s.io", *args]

    def _ctr_ok(self, *args: str) -> bool:
        return subprocess.run(self._ctr_cmd(*args), capture_output=True, timeout=30).returncode == 0

    def _ctr(self, *args: str, timeout: float = 60) -> str:
        return _run(self._ctr_cmd(*args), timeout=timeout).stdout

    # -- Kubernetes components -------------------------------------------------------------

    def _component_kubeconfig(self, name: str, cn: str, org: str | None = None) -> Path:
        pair = self.control_plane.issue_client_cert(name, cn=cn, org=org)
        return self.control_plane.cert_kubeconfig(name, pair)

    def _kubelet_config(self, serving: Any) -> dict[str, Any]:
        k = self.workdir / "kubelet"
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # v1.37 still runs on cgroup v1 when told to; these machines have only v1.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self._ctr_address}",
            "address": self.node_ip,
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(),
            "tlsCertFile": str(serving.cert),
            "tlsPrivateKeyFile": str(serving.key),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.control_plane.ca_cert)},
            },
            "authorization": {"mode": "Webhook"},
            "podLogsDir": str(k / "pod-logs"),
            "volumePluginDir": str(k / "volume-plugins"),
            # Images come from archives; nothing could pull them back.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "50Mi",
                "nodefs.available": "1%",
                "nodefs.inodesFree": "1%",
                "imagefs.available": "1%",
            },
            "serializeImagePulls": False,
            "shutdownGracePeriod": "0s",
            "nodeStatusUpdateFrequency": "2s",
            "syncFrequency": "10s",
        }

    def _start_control_component(self, name: str, *args: str) -> None:
        """kube-controller-manager or kube-scheduler: its own client certificate (user
        ``system:<name>``), a loopback serving port, no leader election (one replica)."""
        kubeconfig = self._component_kubeconfig(name, f"system:{name}")
        self._procs.spawn(name, [
            str(self._binaries[name]),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--cert-dir={self.workdir / name}",
            "--leader-elect=false",
            *args,
        ])

    def _start_components(self) -> None:
        cp = self.control_plane
        self._start_control_component(
            "kube-controller-manager",
            "--use-service-account-credentials=true",
            f"--root-ca-file={cp.ca_cert}",
            f"--service-account-private-key-file={cp.service_account_signing_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--cluster-name=lease-testbed",
            "--concurrent-deployment-syncs=5",
        )
        self._start_control_component("kube-scheduler")
        k = self.workdir / "kubelet"
        k.mkdir(exist_ok=True)
        self.kubelet_port = free_port(self.node_ip)
        serving = cp.issue_serving_cert(
            "kubelet-serving", cn=self.node_name, names=[self.node_name], ips=[self.node_ip]
        )
        self._kubelet_reader = cp.issue_client_cert("kubelet-reader", cn="testbed-admin",
                                                    org="system:masters")
        kubelet_kc = self._component_kubeconfig(
            "kubelet", f"system:node:{self.node_name}", "system:nodes"
        )
        config = k / "config.json"
        config.write_text(json.dumps(self._kubelet_config(serving), indent=1))
        self._procs.spawn("kubelet", [
            str(self._binaries["kubelet"]),
            f"--config={config}",
            f"--kubeconfig={kubelet_kc}",
            f"--root-dir={self.kubelet_root}",
            f"--cert-dir={k / 'pki'}",
            f"--hostname-override={self.node_name}",
            f"--node-ip={self.node_ip}",
            "--v=1",
        ])
        self._start_kube_proxy()

    def _kube_proxy_config(self, kubeconfig: Path, healthz_port: int) -> dict[str, Any]:
        # Every port on loopback and free: the host runs other things.
        return {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "hostnameOverride": self.node_name,
            "mode": "iptables",
            "clusterCIDR": self.pod_cidr,
            "healthzBindAddress": f"127.0.0.1:{healthz_port}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            # The default min-sync-period (1 s) and sync period stay: the lag a Service's
            # clients see after its endpoints change is what a real node shows.
            "iptables": {
                # Service traffic leaves the host with the node's address, so a reply from
                # a pod on the same bridge comes back through the host's conntrack
                # whether or not br_netfilter is loaded.
                "masqueradeAll": True,
                # true would set net.ipv4.conf.all.route_localnet (NodePorts on 127.0.0.1).
                "localhostNodePorts": False,
            },
            # 0: leave the host's conntrack table size and timeouts alone.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
            # Its default (-999) needs CAP_SYS_RESOURCE, which this host withholds.
            "oomScoreAdj": 0,
            "nodePortAddresses": ["primary"],  # no Service here uses NodePorts
        }

    def _start_kube_proxy(self) -> None:
        kubeconfig = self._component_kubeconfig("kube-proxy", "system:kube-proxy")
        self._proxy_healthz_port = free_port()
        config = self.workdir / "kube-proxy.json"
        config.write_text(json.dumps(self._kube_proxy_config(kubeconfig,
                                                             self._proxy_healthz_port)))
        self._procs.spawn("kube-proxy", [str(self._binaries["kube-proxy"]),
                                         f"--config={config}", "--v=1"])

    def _proxy_ready(self) -> bool:
        """kube-proxy's /healthz answers 200 once it has synced its rules."""
        self._check_alive()
        try:
            url = f"http://127.0.0.1:{self._proxy_healthz_port}/healthz"
            with urllib.request.urlopen(url, timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def _node_ready(self) -> bool:
        self._check_alive()
        proc = self.kubectl("get", "node", self.node_name, "-o",
                            'jsonpath={.status.conditions[?(@.type=="Ready")].status}',
                            check=False)
        return proc.stdout.strip() == "True"

    def _wait_ready(self) -> None:
        self.wait_for(self._node_ready, READY_TIMEOUT, f"node {self.node_name} Ready", 0.3)
        self.wait_for(self._proxy_ready, READY_TIMEOUT, "kube-proxy to sync its rules", 0.3)
        # The controller manager runs: it creates every namespace's `default` account.
        self.wait_for(
            lambda: self.kubectl("get", "sa", "default", check=False).returncode == 0,
            READY_TIMEOUT,
            "ServiceAccount default/default",
        )


# --------------------------------------------------------------------------- CLI


def main(argv: list[str]) -> int:
    """``python -m testkit.testbed.cluster up [--busybox] | cleanup``.

    ``up`` starts a cluster, prints ``kubeconfig <path>`` (and with ``--busybox`` loads
    that image and prints ``busybox <ref>``), then ``ready <seconds>``, and waits for
    SIGINT/SIGTERM; ``cleanup`` sweeps what a killed run left behind (the next start
    does it as well).
    """
    command = argv[0] if argv else "up"
    if command == "cleanup":
        lock = hostguard.HostLock()
        found = lock.acquire(timeout=60)
        lock.release()
        print("\n".join(found) if found else "nothing to clean up")
        return 0
    if command != "up":
        print(f"unknown command {command!r}; use up or cleanup", file=sys.stderr)
        return 2
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    cluster = Cluster()
    try:
        cluster.start()
        print(f"kubeconfig {cluster.kubeconfig}", flush=True)
        if "--busybox" in argv:
            print(f"busybox {cluster.busybox()}", flush=True)
        print(f"ready {cluster.startup_seconds:.1f}", flush=True)
        while not stop:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
