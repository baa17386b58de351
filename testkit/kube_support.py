"""Helpers for tests and benchmarks of the kubernetes backend and the pod label.

They run real ``lease-sidecar`` processes against the test bed's real kube-apiserver,
each told its ``POD_NAME`` / ``POD_NAMESPACE`` and authenticated as the ServiceAccount of
``deploy/rbac.yaml`` (and nothing more). No kubelet runs, so the Pod objects stay Pending:
they exist so the sidecar has its own pod to label.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, watch

from sidecar.lease.kubernetes.record import Record
from testkit.support import REPO, SidecarProcess, serving, unix_time_or_none, wait_until
from testkit.testbed.kube import ControlPlane

RBAC = REPO / "deploy" / "rbac.yaml"
SERVICE_ACCOUNT = "lease-sidecar"
# Short timings keep takeovers quick; the rules between them hold (config.validate).
FAST = ["--lease-duration", "3s", "--renew-interval", "500ms", "--renew-deadline", "2s"]


def rbac_manifest(leases: tuple[str, ...] = ("lease-sidecar.jobs",)) -> str:
    """deploy/rbac.yaml with its lease resourceNames edited to ``leases`` (Lease object
    names), as the file tells its users to do."""
    docs = list(yaml.safe_load_all(RBAC.read_text()))
    for doc in docs:
        if doc["kind"] == "Role":
            named = [r for r in doc["rules"] if "resourceNames" in r]
            assert len(named) == 1, "deploy/rbac.yaml should name its Leases in one rule"
            named[0]["resourceNames"] = list(leases)
    return yaml.safe_dump_all(docs)


def install_rbac(cp: ControlPlane, namespace: str,
                 leases: tuple[str, ...] = ("lease-sidecar.jobs",)) -> Path:
    """Apply deploy/rbac.yaml naming ``leases``; return a kubeconfig authenticating as its
    ServiceAccount."""
    cp.kubectl("-n", namespace, "apply", "-f", "-", input=rbac_manifest(leases))
    return cp.service_account_kubeconfig(namespace, SERVICE_ACCOUNT, create=False)


def create_pods(cp: ControlPlane, namespace: str, *names: str) -> None:
    """Pod objects for the sidecars to label (they stay Pending: no kubelet)."""
    items = [{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "lease-test"}},
        "spec": {"serviceAccountName": SERVICE_ACCOUNT,
                 "containers": [{"name": "app", "image": "registry.invalid/app:1"}]},
    } for name in names]
    cp.kubectl("-n", namespace, "apply", "-f", "-",
               input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


def mark_ready(cp: ControlPlane, namespace: str, *pods: str, ready: bool = True) -> None:
    """Write the pods' Ready condition as kubelet would (none runs here, so they stay
    Pending): a hand-over's target must be Ready."""
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    for pod in pods:
        cp.kubectl("-n", namespace, "patch", "pod", pod, "--subresource=status",
                   "--type=merge", "-p", json.dumps({"status": status}))


def sidecar(workdir: Path, pod: str, namespace: str, kubeconfig: Path, *args: str,
            lease: str = "jobs") -> SidecarProcess:
    """A sidecar process that believes it runs in pod ``namespace/pod``."""
    return SidecarProcess(
        workdir, pod,
        args=["--backend", "kubernetes", "--name", lease, *FAST, *args],
        env={"POD_NAME": pod, "POD_NAMESPACE": namespace, "KUBECONFIG": str(kubeconfig)})


def lease_spec(cp: ControlPlane, namespace: str, lease: str = "jobs") -> dict[str, Any]:
    proc = cp.kubectl("-n", namespace, "get", "lease", f"lease-sidecar.{lease}", "-o", "json",
                      check=False)
    return json.loads(proc.stdout)["spec"] if proc.returncode == 0 else {}


def lease_token(cp: ControlPlane, namespace: str, lease: str = "jobs") -> int | None:
    """The fencing token the Lease shows for its current (or last) term: its holder
    writes it into the annotation ``lease-sidecar/fencing-token`` at each renew (None
    before the first)."""
    obj = json.loads(cp.kubectl("-n", namespace, "get", "lease", f"lease-sidecar.{lease}",
                                "-o", "json").stdout)
    return Record.from_object(obj).shown_token


def role_column(cp: ControlPlane, namespace: str) -> dict[str, str]:
    """``kubectl get pods -L lease-role`` as {pod: role}, parsed from the printed table."""
    out = cp.kubectl("-n", namespace, "get", "pods", "-L", "lease-role").stdout
    lines = out.strip().splitlines()
    header = lines[0].split()
    column = header.index("LEASE-ROLE")
    roles = {}
    for line in lines[1:]:
        cells = line.split()
        # An empty label cell prints as nothing, so the row is one cell short.
        roles[cells[0]] = cells[column] if len(cells) == len(header) else ""
    return roles


def leaders(processes: list[SidecarProcess]) -> list[SidecarProcess]:
    return [p for p in processes if p.proc and p.proc.poll() is None and p.leader() == 200]


class LeaderLabels:
    """Polls which pods of a namespace are labelled ``lease-role=leader`` (admin, one LIST
    every ``interval`` seconds, in a thread) and keeps the longest stretch during which
    two or more were: the "never two ``leader`` pods for longer than 5 s" check.

    A stretch runs from the first sample that saw two leaders to the first that saw at
    most one (or to :meth:`stop`). A LIST that fails (the apiserver is down) is no sample:
    it neither starts nor ends a stretch. The thread stops by itself after ``limit`` s.
    """

    def __init__(self, cp: ControlPlane, namespace: str, interval: float = 0.1,
                 limit: float = 600.0) -> None:
        self._url = (f"{cp.server}/api/v1/namespaces/{namespace}/pods"
                     "?labelSelector=lease-role%3Dleader")
        self._ssl = cp.admin_ssl_context()
        self._interval, self._limit = interval, limit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.samples = 0  # LISTs answered
        self.longest = 0.0  # seconds: the longest stretch with two or more leaders
        self.worst: list[str] = []  # the pods of that stretch's first sample
        self._since: float | None = None
        self._seen: list[str] = []

    def __enter__(self) -> LeaderLabels:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._close(time.monotonic())

    def assert_never_two_longer_than(self, bound: float) -> None:
        self.stop()
        assert self.samples > 0, "the leader-label poller got no answer"
        assert self.longest < bound, (
            f"two or more pods labelled leader for {self.longest:.2f} s: {self.worst}")

    def _close(self, now: float) -> None:
        if self._since is not None and now - self._since > self.longest:
            self.longest, self.worst = now - self._since, self._seen
        self._since = None

    def _run(self) -> None:
        ends = time.monotonic() + self._limit
        while not self._stop.is_set() and time.monotonic() < ends:
            try:
                with urllib.request.urlopen(self._url, timeout=1, context=self._ssl) as answer:
                    items = json.loads(answer.read())["items"]
            except (urllib.error.URLError, OSError, ValueError):
                items = None
            now = time.monotonic()
            if items is not None:
                self.samples += 1
                names = sorted(item["metadata"]["name"] for item in items)
                if len(names) >= 2 and self._since is None:
                    self._since, self._seen = now, names
                elif len(names) < 2:
                    self._close(now)
            self._stop.wait(self._interval)


@dataclass
class Event:
    at: float  # time.monotonic() when the event arrived here
    kind: str  # "lease" or "pod"
    name: str
    version: int  # resourceVersion (an etcd revision: comparable across objects)
    holder: str | None = None  # lease: holderIdentity
    transitions: int | None = None
    acquired: float | None = None  # lease: acquireTime as a wall-clock timestamp
    renewed: float | None = None  # lease: renewTime as a wall-clock timestamp
    wall: float = 0.0  # time.time() when the event arrived here
    role: str | None = None  # pod: lease-role label


@dataclass
class Recorder:
    """Watches the Leases and Pods of one namespace as admin and keeps every event.

    Gives the order of writes (resourceVersions share one etcd revision counter) and the
    arrival times, for ordering assertions and the benchmark's lag figures.
    """

    kubeconfig: Path
    namespace: str
    events: list[Event] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Recorder:
        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        coordination, core = client.CoordinationV1Api(api), client.CoreV1Api(api)
        for kind, lister in (("lease", coordination.list_namespaced_lease),
                             ("pod", core.list_namespaced_pod)):
            thread = threading.Thread(target=self._run, args=(kind, lister), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self, kind: str, lister: Any) -> None:
        version = None
        while not self._stop.is_set():
            stream = watch.Watch()
            kwargs: dict[str, Any] = {"timeout_seconds": 5, "deserialize": False}
            if version:
                kwargs["resource_version"] = version
            try:
                for event in stream.stream(lister, self.namespace, **kwargs):
                    obj = event["object"]
                    version = obj["metadata"]["resourceVersion"]
                    self._add(kind, obj)
                    if self._stop.is_set():
                        return
            except Exception:
                version = None  # 410 Gone or a hiccup: start over from the current state
                time.sleep(0.1)

    def _add(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        found = Event(time.monotonic(), kind, meta["name"], int(meta["resourceVersion"]),
                      wall=time.time())
        if kind == "lease":
            spec = obj.get("spec") or {}
            found.holder = spec.get("holderIdentity") or ""
            found.transitions = spec.get("leaseTransitions")
            found.acquired = unix_time_or_none(spec.get("acquireTime"))
            found.renewed = unix_time_or_none(spec.get("renewTime"))
        else:
            found.role = (meta.get("labels") or {}).get("lease-role")
        with self._lock:
            self.events.append(found)

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self.events)

    def first(self, after: float, timeout: float, match: Callable[[Event], bool]) -> Event:
        """The first event that arrived at or after monotonic ``after`` and matches; waits."""
        deadline = time.monotonic() + timeout
        while True:
            for found in self.snapshot():
                if found.at >= after and match(found):
                    return found
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no matching event within {timeout}s")
            time.sleep(0.005)


def sidecars_in_pods(cp: ControlPlane, namespace: str, workdir: Path, kubeconfig: Path,
                     pods: tuple[str, ...], extra: Mapping[str, Sequence[str]] | None = None,
                     ) -> Iterator[list[SidecarProcess]]:
    """One sidecar per pod (the Pod objects made first; ``extra`` maps a pod to more
    arguments for its sidecar), all up and one of them leading; stopped when the
    generator closes. For fixtures: ``yield from sidecars_in_pods(...)``."""
    create_pods(cp, namespace, *pods)
    extra = extra or {}
    procs = [sidecar(workdir, pod, namespace, kubeconfig, *extra.get(pod, ())) for pod in pods]
    with serving(procs):
        wait_until(lambda: leaders(procs), timeout=15)
        yield procs


def interop_sidecars(cp: ControlPlane, namespace: str, workdir: Path,
                     kubeconfig: Path) -> list[SidecarProcess]:
    """Two sidecars (pods ``pod-a``, ``pod-b``, no pod label) on the ``interop`` lease,
    the one the client-go elector tests share with them; not started yet."""
    create_pods(cp, namespace, "pod-a", "pod-b")
    return [sidecar(workdir, pod, namespace, kubeconfig, "--pod-label", "off",
                    lease="interop") for pod in ("pod-a", "pod-b")]
