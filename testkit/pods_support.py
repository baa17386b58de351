"""What the end-to-end tests and bench/bench_pods.py share: the chart installed with its
injector, an opted-in application Deployment, and an observer that watches every pod's
leadership claims and labels on one clock.

The application container runs the sidecar image's own Python (the image is loaded
anyway) with :data:`APP_SCRIPT`: one thread long-polls ``$LEASE_LEADER_URL?wait=…`` and
logs each answer's role, another reads ``$LEASE_LEADER_FILE`` and checks its
``valid_until``. Every log line is JSON with ``t`` = the node's wall clock, which is the
clock the observer uses too (one machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit.chaos.checker import Interval, claim_time, fencing_violations, find_gaps, find_overlaps
from testkit.chaos.recorder import Recorder, Span, Target
from testkit.support import REPO, unix_time
from testkit.testbed.cluster import Cluster

CHART = REPO / "charts" / "lease-sidecar"
APP_LABEL = "e2e-app"
SIDECAR = "lease-sidecar"  # the chart's sidecar.containerName
# The app container's readiness file (app_deployment(ready_file=True)): its emptyDir.
READY_VOLUME, READY_FILE = "ready", "ok"
CLAIM_HORIZON = 0.25  # the chart's default lease.claimHorizon
# The test pods' own containers run as the sidecar image's user, as the chart runs it.
RESTRICTED_CONTAINER = {"runAsNonRoot": True, "runAsUser": 10001,
                        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                        "capabilities": {"drop": ["ALL"]}}
# The chart's renew interval on the database backends (a standby's retry period). On
# kubernetes it defaults to a third of the validity (4.67 s), but standbys there learn of
# a release from their Lease watch, not from a retry, so the bound below holds for both.
RENEW_INTERVAL = 2.0
# The leaderless gap a graceful handover (pod deletion, rolling restart) may cause: the
# old holder releases on SIGTERM; a standby takes the lease when its watch reports that,
# or at the latest on its next retry (renew interval + 20 % jitter), then waits one claim
# horizon; 1 s of slack for a loaded two-core machine. A release that did not happen
# would show as a gap of a whole lease duration (15 s), far beyond it. Typical gaps are
# a few hundred milliseconds (bench/bench_pods.py).
GRACEFUL_GAP_BOUND = 1.2 * RENEW_INTERVAL + CLAIM_HORIZON + 1.0

APP_SCRIPT = r'''
import json, os, signal, threading, time, urllib.error, urllib.request
from datetime import datetime

URL, FILE = os.environ["LEASE_LEADER_URL"], os.environ["LEASE_LEADER_FILE"]
lock = threading.Lock()

def log(**fields):
    with lock:
        print(json.dumps({"t": time.time(), **fields}), flush=True)

def on_term(signum, frame):
    # PID 1 gets no default SIGTERM action: without a handler the pod would wait out
    # its whole grace period.
    log(event="exit")
    os._exit(0)

signal.signal(signal.SIGTERM, on_term)

def ask(url, etag):
    request = urllib.request.Request(url, headers={"If-None-Match": etag} if etag else {})
    try:
        with urllib.request.urlopen(request, timeout=15) as response:
            return response.status, json.load(response), response.headers.get("ETag")
    except urllib.error.HTTPError as err:
        return err.code, json.load(err), err.headers.get("ETag")
    except OSError as err:
        return 0, {"error": str(err)}, None

def poll():
    status, body, etag = ask(URL, None)  # no wait: the sidecar must already answer
    log(event="first-poll", status=status, role="leader" if status == 200 else "standby")
    while True:
        if status == 0:
            time.sleep(0.2)
        status, body, etag = ask(URL + "?wait=1", etag)
        log(event="poll", status=status, role="leader" if status == 200 else "standby",
            holder=body.get("holder"), token=body.get("fencing_token"))

def read_file():
    last = None
    while True:
        try:
            with open(FILE) as fh:
                body = json.load(fh)
            until = datetime.fromisoformat(body["valid_until"].replace("Z", "+00:00"))
            now = time.time()
            seen = ("leader", until.timestamp() > now)
            if seen != last or not seen[1]:
                log(event="file", leader=True, valid=seen[1],
                    left_ms=round((until.timestamp() - now) * 1000))
        except FileNotFoundError:
            seen = ("standby", None)
            if seen != last:
                log(event="file", leader=False)
        last = seen
        time.sleep(0.05)

threading.Thread(target=read_file, daemon=True).start()
poll()
'''


# --------------------------------------------------------------------------- install


def sidecar_image_archive(target: str = "sidecar",
                          digest: str | None = None) -> tuple[Path, str]:
    """One of the project's images (Dockerfile target ``sidecar`` or ``operator``) as
    (docker-archive, ref): built by the image test bed (cached on a hash of its inputs),
    or a prebuilt archive named by ``LEASE_TESTBED_SIDECAR_ARCHIVE=<path>=<ref>``
    (``LEASE_TESTBED_OPERATOR_ARCHIVE`` for the operator)."""
    prebuilt = os.environ.get(f"LEASE_TESTBED_{target.upper()}_ARCHIVE")
    if prebuilt:
        path, _, ref = prebuilt.partition("=")
        return Path(path), ref
    from testkit.testbed import image  # the Dockerfile build; heavy, so only when needed

    return image.build_image(target, digest)


def load_sidecar_image(cluster: Cluster) -> str:
    """Load both images into the node; the sidecar's ref (the operator's is the same
    with ``-operator`` after the repository, as :func:`install_release` assumes)."""
    archive, sidecar = sidecar_image_archive("sidecar")
    if sidecar not in cluster.images():
        cluster.load_image(archive)
    archive, operator = sidecar_image_archive("operator", digest=sidecar.rsplit(":", 1)[1])
    if operator not in cluster.images():
        cluster.load_image(archive)
    if operator != operator_ref(sidecar):
        raise RuntimeError(f"the operator image {operator} is not named after the sidecar "
                           f"image {sidecar} (LEASE_TESTBED_OPERATOR_ARCHIVE?)")
    return sidecar


def operator_ref(sidecar: str) -> str:
    repo, tag = sidecar.rsplit(":", 1)
    return f"{repo}-operator:{tag}"


def install_release(
    cluster: Cluster,
    namespace: str,
    image: str,
    *,
    release: str = "ls",
    backend: str = "kubernetes",
    extra: tuple[str, ...] = (),
    service_account: str = "app",
) -> str:
    """``helm install`` the chart with its injector into ``namespace``; wait for it.

    The injector only serves this namespace: several releases may run at once, and a
    pod must be injected by its own release's settings.
    """
    repo, tag = image.rsplit(":", 1)
    selector = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    sets = [
        f"image.repository={repo}",
        f"image.tag={tag}",
        f"image.operatorRepository={repo}-operator",
        f"image.sqlserverRepository={repo}-sqlserver",
        "image.pullPolicy=Never",
        "injector.enabled=true",
        f"lease.backend={backend}",
        f"rbac.extraServiceAccounts={{{service_account}}}",
        *extra,
    ]
    args = ["install", release, str(CHART), "-n", namespace, "--wait", "--timeout", "180s",
            "--set-json", f"injector.namespaceSelector={json.dumps(selector)}"]
    for value in sets:
        args += ["--set", value]
    cluster.kubectl("-n", namespace, "create", "serviceaccount", service_account)
    cluster.helm(*args, timeout=240)
    return release


def app_deployment(name: str, image: str, lease: str, replicas: int = 3,
                   service_account: str = "app", grace: int = 30,
                   ready_file: bool = False) -> str:
    """A Deployment opted in to injection by label, naming its lease (the injector refuses
    a pod that does not); its app is :data:`APP_SCRIPT`. With ``ready_file`` the app
    container is Ready only while :func:`ready_file_path` exists (an exec readiness probe
    every second on an emptyDir the host writes)."""
    app: dict[str, Any] = {
        "name": "app",
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["python", "-u", "-c", APP_SCRIPT],
        "resources": {"requests": {"cpu": "5m", "memory": "16Mi"},
                      "limits": {"memory": "64Mi"}},
        "securityContext": RESTRICTED_CONTAINER,
    }
    volumes = []
    if ready_file:
        app["volumeMounts"] = [{"name": READY_VOLUME, "mountPath": "/ready"}]
        # The app runs on the sidecar image: Python, and no shell or coreutils.
        app["readinessProbe"] = {"exec": {"command": [
            "python", "-I", "-S", "-c",
            f"import os, sys; sys.exit(not os.path.exists('/ready/{READY_FILE}'))"]},
                                 "periodSeconds": 1, "failureThreshold": 1}
        volumes = [{"name": READY_VOLUME, "emptyDir": {}}]
    return json.dumps({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": APP_LABEL}},
            "template": {
                "metadata": {"labels": {"app": APP_LABEL, "lease-sidecar/inject": "true"},
                             "annotations": {"lease-sidecar/name": lease}},
                "spec": {
                    "serviceAccountName": service_account,
                    "terminationGracePeriodSeconds": grace,
                    "containers": [app],
                    **({"volumes": volumes} if volumes else {}),
                },
            },
        },
    })


def deploy_app(cluster: Cluster, namespace: str, image: str, lease: str, name: str = "web",
               replicas: int = 3, ready_file: bool = False) -> str:
    """Apply :func:`app_deployment`; wait until rolled out (with ``ready_file``, whose
    apps are not Ready yet: until every pod runs with its sidecar Ready)."""
    cluster.kubectl("-n", namespace, "apply", "-f", "-",
                    input=app_deployment(name, image, lease, replicas, ready_file=ready_file))
    if not ready_file:
        wait_rolled_out(cluster, namespace, name)
        return name

    def running() -> bool:
        pods = app_pods(cluster, namespace)
        return len(pods) == replicas and all(
            any(s["name"] == SIDECAR and s.get("ready")
                for s in p["status"].get("initContainerStatuses", []))
            and any(s["name"] == "app" and "running" in (s.get("state") or {})
                    for s in p["status"].get("containerStatuses", []))
            for p in pods)

    cluster.wait_for(running, 180, f"{replicas} pods running, their sidecars Ready", 0.5)
    return name


def wait_rolled_out(cluster: Cluster, namespace: str, name: str, timeout: int = 180) -> None:
    cluster.kubectl("-n", namespace, "rollout", "status", f"deployment/{name}",
                    f"--timeout={timeout}s", timeout=timeout + 10)


# --------------------------------------------------------------------------- reading


def app_pods(cluster: Cluster, namespace: str, *, live_only: bool = True) -> list[dict[str, Any]]:
    pods = cluster.kubectl_json("-n", namespace, "get", "pods", "-l", f"app={APP_LABEL}")["items"]
    if live_only:
        pods = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return pods


def roles(cluster: Cluster, namespace: str) -> dict[str, str]:
    """Pod name -> lease-role label, from ``kubectl get pods -L lease-role``."""
    out = cluster.kubectl("-n", namespace, "get", "pods", "-l", f"app={APP_LABEL}",
                          "-L", "lease-role", "--no-headers").stdout
    table = {}
    for line in out.splitlines():
        cols = line.split()
        table[cols[0]] = cols[-1]
    return table


def log_events(cluster: Cluster, namespace: str, pod: str, container: str = "app",
               previous: bool = False) -> list[dict[str, Any]]:
    """The container's JSON log lines (the app's and the sidecar's are both JSON)."""
    args = ["-n", namespace, "logs", pod, "-c", container]
    if previous:
        args.append("--previous")
    out = cluster.kubectl(*args, check=False).stdout
    events = []
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events


def sidecar_time(event: dict[str, Any]) -> float:
    """The sidecar's log timestamp (``ts``, ISO 8601) as a Unix time."""
    return unix_time(event["ts"])


def ready_at(pod: dict[str, Any], container: str) -> float | None:
    for status in pod["status"].get("initContainerStatuses", []) + pod["status"].get(
            "containerStatuses", []):
        if status["name"] == container and status.get("started"):
            started = status["state"].get("running", {}).get("startedAt")
            if started:
                return unix_time(started)
    return None


# --------------------------------------------------------------------------- observing


@dataclass
class LabelEvent:
    t: float
    pod: str
    role: str | None
    deleting: bool
    kind: str  # ADDED / MODIFIED / DELETED


@dataclass
class Verdict:
    overlaps: list[Interval]
    gaps: list[Interval]
    fencing: list[str]
    anomalies: list[str]
    spans: int

    @property
    def longest_gap(self) -> float:
        return max((g.length for g in self.gaps), default=0.0)


@dataclass
class PodObserver:
    """Watches one namespace's app pods: their labels (a watch stream, in the
    apiserver's order) and every sidecar's claims through its pod IP and its leader file
    (tests/bench chaos recorder, one clock).  Pods are added as they get an IP and
    dropped once deleted."""

    cluster: Cluster
    namespace: str
    http_interval: float = 0.02
    file_interval: float = 0.01
    labels: list[LabelEvent] = field(default_factory=list)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # last seen object
    first_seen: dict[str, float] = field(default_factory=dict)
    # When the watch first showed the pod with an IP (sandbox and network up), its
    # sidecar container running, the sidecar container ready / the whole pod Ready.
    ip_seen: dict[str, float] = field(default_factory=dict)
    sidecar_running: dict[str, float] = field(default_factory=dict)
    sidecar_ready: dict[str, float] = field(default_factory=dict)
    pod_ready: dict[str, float] = field(default_factory=dict)
    # (when, pod, ready): every change of the app container's ``ready`` the watch showed.
    app_ready: list[tuple[float, str, bool]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.recorder = Recorder([], CLAIM_HORIZON, interval=self.file_interval,
                                 http_interval=self.http_interval, http_timeout=0.5)
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._watch: subprocess.Popen[str] | None = None
        self._watch_thread: threading.Thread | None = None
        self._watched: set[str] = set()
        self.started_at = 0.0
        self._lock = threading.Lock()

    def __enter__(self) -> PodObserver:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.started_at = time.time()
        self._loop_thread.start()
        asyncio.run_coroutine_threadsafe(self.recorder.start(), self._loop).result(10)
        self._watch = subprocess.Popen(
            [*self._kubectl(), "-n", self.namespace, "get", "pods", "-l", f"app={APP_LABEL}",
             "--watch", "--output-watch-events", "-o", "json"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        self._watch_thread = threading.Thread(target=self._read_watch, daemon=True)
        self._watch_thread.start()
        self.cluster.wait_for(lambda: self.pods, 30, "the pod watch's first events")

    def created_since_start(self) -> dict[str, float]:
        """Pods created after :meth:`start`, with when the watch first showed them."""
        with self._lock:
            return {n: t for n, t in self.first_seen.items()
                    if _created(self.pods[n]) >= int(self.started_at)}

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.terminate()
            self._watch.wait(timeout=10)
        asyncio.run_coroutine_threadsafe(self.recorder.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)

    def _kubectl(self) -> list[str]:
        from testkit.testbed import gobuild

        return [str(gobuild.ensure_binary("kubectl")), f"--kubeconfig={self.cluster.kubeconfig}"]

    def _read_watch(self) -> None:
        assert self._watch is not None and self._watch.stdout is not None
        decoder = json.JSONDecoder()
        buffer = ""
        for chunk in iter(lambda: self._watch.stdout.readline(), ""):  # type: ignore[union-attr]  # stdout=PIPE
            buffer += chunk
            while buffer.strip():
                try:
                    event, end = decoder.raw_decode(buffer.lstrip())
                except ValueError:
                    break
                buffer = buffer.lstrip()[end:]
                self._on_event(event)

    def _on_event(self, event: dict[str, Any]) -> None:
        now = time.time()
        pod = event["object"]
        name = pod["metadata"]["name"]
        kind = event["type"]
        with self._lock:
            self.pods[name] = pod
            self.first_seen.setdefault(name, now)
            statuses = pod["status"].get("initContainerStatuses", [])
            if pod["status"].get("podIP"):
                self.ip_seen.setdefault(name, now)
            if any(x["name"] == SIDECAR and "running" in (x.get("state") or {})
                   for x in statuses):
                self.sidecar_running.setdefault(name, now)
            if any(x["name"] == SIDECAR and x.get("ready") for x in statuses):
                self.sidecar_ready.setdefault(name, now)
            conditions = pod["status"].get("conditions", [])
            if any(x["type"] == "Ready" and x["status"] == "True" for x in conditions):
                self.pod_ready.setdefault(name, now)
            app = any(x["name"] == "app" and x.get("ready")
                      for x in pod["status"].get("containerStatuses", []))
            was = next((r for _, p, r in reversed(self.app_ready) if p == name), False)
            if app != was:
                self.app_ready.append((now, name, app))
            self.labels.append(LabelEvent(
                now, name, pod["metadata"].get("labels", {}).get("lease-role"),
                bool(pod["metadata"].get("deletionTimestamp")), kind))
        ip = pod["status"].get("podIP")
        if kind == "DELETED":
            self._loop.call_soon_threadsafe(self.recorder.remove_target, name)
        elif ip and name not in self._watched:
            self._watched.add(name)
            target = Target(name, f"http://{ip}:8099", leader_file_path(self.cluster, pod))
            self._loop.call_soon_threadsafe(self.recorder.add_target, target)

    # -- judging ---------------------------------------------------------------------

    def spans(self) -> list[Span]:
        return list(self.recorder.spans)

    def verdict(self, begin: float, end: float) -> Verdict:
        spans = [s for s in self.spans() if s.end > begin and s.start < end]
        merged = claim_time(spans)
        return Verdict(find_overlaps(merged), find_gaps(merged, begin, end),
                       fencing_violations(spans), list(self.recorder.anomalies), len(spans))

    def first_claim_after(self, t: float, exclude: str | None = None) -> Span | None:
        later = [s for s in self.spans() if s.start >= t and s.identity != exclude]
        return min(later, key=lambda s: s.start) if later else None

    def leader_now(self) -> str | None:
        return self.recorder.leader_now()

    def label_history(self) -> list[LabelEvent]:
        with self._lock:
            return list(self.labels)


def _created(pod: dict[str, Any]) -> float:
    return unix_time(pod["metadata"]["creationTimestamp"])  # whole seconds


def two_leader_labels(history: list[LabelEvent]) -> list[str]:
    """Moments in the watch stream (the apiserver's order) when two pods were labelled
    ``leader`` at once; empty when never."""
    current: dict[str, str | None] = {}
    found = []
    for ev in history:
        if ev.kind == "DELETED":
            current.pop(ev.pod, None)
        else:
            current[ev.pod] = ev.role
        leaders = sorted(p for p, r in current.items() if r == "leader")
        if len(leaders) > 1:
            found.append(f"{ev.t:.3f}: {leaders}")
    return found


def wait_one_leader(cluster: Cluster, namespace: str, replicas: int = 3,
                    timeout: float = 60) -> str:
    """Wait until ``-L lease-role`` shows exactly one leader and replicas-1 standbys."""
    def one() -> str | None:
        table = roles(cluster, namespace)
        leaders = [p for p, r in table.items() if r == "leader"]
        standbys = [p for p, r in table.items() if r == "standby"]
        live = {p["metadata"]["name"] for p in app_pods(cluster, namespace)}
        if len(leaders) == 1 and len(standbys) == replicas - 1 and set(table) == live:
            return leaders[0]
        return None

    return cluster.wait_for(one, timeout, "one leader and the rest standby", 0.3)


def leader_file_path(cluster: Cluster, pod: dict[str, Any]) -> Path:
    return cluster.empty_dir(pod["metadata"]["uid"], "lease-state") / "leader"


def ready_file_path(cluster: Cluster, pod: dict[str, Any]) -> Path:
    """The file whose presence makes the app container Ready (``ready_file=True``)."""
    return cluster.empty_dir(pod["metadata"]["uid"], READY_VOLUME) / READY_FILE
