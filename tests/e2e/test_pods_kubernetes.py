"""The whole used-by story on real pods, `kubernetes` backend: the chart with its injector,
an opted-in 3-replica Deployment, the ServiceAccount token, native-sidecar order, leader
pod deletion and a rolling restart, all under a real kubelet.

Run alone: python -m pytest tests/e2e -m pods   (needs root; see testkit/testbed/cluster.py)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from testkit import pods_support as ps
from testkit.testbed.cluster import Cluster

pytestmark = [pytest.mark.pods, pytest.mark.slow]

LEASE_NAME = "e2e"
LEASE_OBJECT = f"lease-sidecar.{LEASE_NAME}"  # {keyPrefix}.{name}
RELEASE = "ls"


@dataclass
class App:
    cluster: Cluster
    namespace: str
    image: str
    deployment: str = "web"


@pytest.fixture(scope="module")
def app(pod_cluster: Cluster, sidecar_image: str) -> Iterator[App]:
    ns = pod_cluster.create_namespace("e2e-kube")
    ps.install_release(pod_cluster, ns, sidecar_image, release=RELEASE,
                       extra=(f"lease.name={LEASE_NAME}",))
    ps.deploy_app(pod_cluster, ns, sidecar_image, LEASE_NAME)
    yield App(pod_cluster, ns, sidecar_image)
    pod_cluster.helm("uninstall", RELEASE, "-n", ns, check=False)
    pod_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_injector_runs_in_cluster_behind_its_service(app: App) -> None:
    c, ns = app.cluster, app.namespace
    name = f"{RELEASE}-lease-sidecar-injector"
    deploy = c.kubectl_json("-n", ns, "get", "deployment", name)
    assert deploy["status"].get("readyReplicas") == deploy["spec"]["replicas"] == 2
    injector_ips = {p["status"]["podIP"] for p in c.kubectl_json(
        "-n", ns, "get", "pods", "-l", "app.kubernetes.io/component=injector")["items"]}
    slices = c.kubectl_json("-n", ns, "get", "endpointslices",
                            "-l", f"kubernetes.io/service-name={name}")["items"]
    served = {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]
              if e.get("conditions", {}).get("ready")}
    assert served == injector_ips and len(served) == 2
    hook = c.kubectl_json("get", "mutatingwebhookconfiguration", f"{ns}-{name}")["webhooks"][0]
    assert "url" not in hook["clientConfig"]  # the Service, as users get it
    assert hook["clientConfig"]["service"] == {
        "name": name, "namespace": ns, "path": "/lease-sidecar-inject", "port": 443}
    assert hook["clientConfig"].get("caBundle"), "the injector set its CA bundle"
    # The apiserver reached it there: every opted-in pod came out injected.
    for pod in ps.app_pods(c, ns):
        init = {x["name"]: x for x in pod["spec"].get("initContainers", [])}
        assert init[ps.SIDECAR]["restartPolicy"] == "Always"
        assert init[ps.SIDECAR]["image"] == app.image
        env = {e["name"] for e in pod["spec"]["containers"][0].get("env", [])}
        assert {"LEASE_LEADER_FILE", "LEASE_LEADER_URL"} <= env


def test_three_replicas_one_leader_everywhere(app: App) -> None:
    c, ns = app.cluster, app.namespace
    leader = ps.wait_one_leader(c, ns)
    pods = ps.app_pods(c, ns)
    assert len(pods) == 3
    for pod in pods:
        statuses = pod["status"]["containerStatuses"] + pod["status"]["initContainerStatuses"]
        assert pod["status"]["phase"] == "Running"
        assert [s["ready"] for s in statuses] == [True, True], pod["metadata"]["name"]  # 2/2
    lease = c.kubectl_json("-n", ns, "get", "lease", LEASE_OBJECT)
    assert lease["spec"]["holderIdentity"] == leader

    def app_roles() -> dict[str, str] | None:
        last = {}
        for pod in pods:
            name = pod["metadata"]["name"]
            polls = [e for e in ps.log_events(c, ns, name) if e.get("event") == "poll"]
            files = [e for e in ps.log_events(c, ns, name) if e.get("event") == "file"]
            if not polls or not files:
                return None
            last[name] = (polls[-1]["role"], files[-1])
        return last if sum(r == "leader" for r, _ in last.values()) == 1 else None

    seen = c.wait_for(app_roles, 30, "every app to have logged its role, one leader")
    assert {p for p, (role, _) in seen.items() if role == "leader"} == {leader}
    for name, (_, file_event) in seen.items():
        if name == leader:  # reads /run/lease/leader and finds a claim still valid
            assert file_event["leader"] and file_event["valid"], file_event
        else:
            assert file_event == {**file_event, "leader": False}
    # The host sees the same file through the pod's memory-backed emptyDir.
    leader_pod = next(p for p in pods if p["metadata"]["name"] == leader)
    body = json.loads(ps.leader_file_path(c, leader_pod).read_text())
    assert body["identity"] == body["holder"] == leader


def test_sidecar_uses_the_pod_service_account(app: App) -> None:
    c, ns = app.cluster, app.namespace
    leader = ps.wait_one_leader(c, ns)
    pod = c.kubectl_json("-n", ns, "get", "pod", leader)
    sidecar = next(x for x in pod["spec"]["initContainers"] if x["name"] == ps.SIDECAR)
    assert "KUBECONFIG" not in {e["name"] for e in sidecar.get("env", [])}
    assert pod["spec"]["serviceAccountName"] == "app"
    # From inside the sidecar container, with nothing but the pod's mounted token (and
    # the standard library: the sidecar image carries no Kubernetes client package).
    probe = r"""
import json, os, ssl, sys, urllib.error, urllib.request
lease, pod = sys.argv[1:3]
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{sa}/token").read().strip()
ns = open(f"{sa}/namespace").read()
base = (f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:"
        f"{os.environ['KUBERNETES_SERVICE_PORT']}")
tls = ssl.create_default_context(cafile=f"{sa}/ca.crt")
def call(method, path, body=None, kind="application/json"):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": kind})
    try:
        with urllib.request.urlopen(req, context=tls, timeout=20) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, None
def status(method, path, body=None, kind="application/json"):
    code = call(method, path, body, kind)[0]
    return 200 if 200 <= code < 300 else code
lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{lease}"
pod_path = f"/api/v1/namespaces/{ns}/pods/{pod}"
merge = "application/merge-patch+json"
_, review = call("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                 {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
print(json.dumps({
    "user": review["status"]["userInfo"]["username"],
    "get_lease": status("GET", lease_path),
    "delete_lease": status("DELETE", lease_path),
    "list_secrets": status("GET", f"/api/v1/namespaces/{ns}/secrets"),
    "patch_label": status("PATCH", pod_path,
                          {"metadata": {"labels": {"lease-role": "leader"}}}, merge),
    "patch_other": status("PATCH", pod_path,
                          {"metadata": {"annotations": {"e2e/probe": "1"}}}, merge),
}))
"""
    out = c.kubectl("-n", ns, "exec", leader, "-c", ps.SIDECAR, "--",
                    "python", "-c", probe, LEASE_OBJECT, leader, timeout=60).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {
        "user": f"system:serviceaccount:{ns}:app",
        "get_lease": 200,
        "delete_lease": 403,  # the chart's Role grants no delete
        "list_secrets": 403,  # nor secrets
        "patch_label": 200,  # the label patch's permission
        # Anything else on the pod: RBAC allows the patch, the chart's admission policy
        # (rbac.podPatchPolicy) refuses it.
        "patch_other": 403,
    }
    # And the sidecar's own writes went through under that Role: it holds the Lease and
    # labelled its pod.
    lease = c.kubectl_json("-n", ns, "get", "lease", LEASE_OBJECT)
    assert lease["spec"]["holderIdentity"] == leader
    assert pod["metadata"]["labels"]["lease-role"] == "leader"


def test_native_sidecar_is_answering_before_the_app_starts(app: App) -> None:
    c, ns = app.cluster, app.namespace
    for pod in ps.app_pods(c, ns):
        name = pod["metadata"]["name"]
        first = [e for e in ps.log_events(c, ns, name) if e.get("event") == "first-poll"]
        assert first, f"{name}: the app logged no first poll"
        # Its very first request, made without waiting, already got an HTTP answer.
        assert first[0]["status"] in (200, 503), first[0]
        sidecar_started = ps.ready_at(pod, ps.SIDECAR)
        app_started = ps.ready_at(pod, "app")
        assert sidecar_started is not None and app_started is not None
        assert sidecar_started <= app_started


def test_leader_pod_deletion_hands_over_in_order(app: App, follow_logs) -> None:
    c, ns = app.cluster, app.namespace
    old = ps.wait_one_leader(c, ns)
    with ps.PodObserver(c, ns) as observer:
        c.wait_for(lambda: observer.leader_now() == old, 30, "the observer to see the leader")
        app_log = follow_logs(ns, old, "app")
        sidecar_log = follow_logs(ns, old, ps.SIDECAR)
        time.sleep(0.5)  # both streams attached
        deleted_at = time.time()
        c.kubectl("-n", ns, "delete", "pod", old, "--wait=false")
        successor = c.wait_for(lambda: observer.first_claim_after(deleted_at, exclude=old),
                               60, "another pod to claim leadership")
        app_log.wait_done(60)
        sidecar_log.wait_done(60)
        c.wait_for(lambda: old not in ps.roles(c, ns), 60, "the deleted pod to be gone")
        ps.wait_one_leader(c, ns)
        end = time.time()
    verdict = observer.verdict(deleted_at - 1, end)
    assert verdict.overlaps == [], "two pods claimed leadership at once"
    assert verdict.fencing == []
    assert verdict.longest_gap <= ps.GRACEFUL_GAP_BOUND, verdict.gaps
    assert successor.identity != old

    # Order on deletion: the app stops first; the sidecar outlives it and releases after.
    app_exit = [json.loads(x)["t"] for _, x in app_log.lines if '"exit"' in x]
    stepped = [ps.sidecar_time(json.loads(x)) for _, x in sidecar_log.lines
               if '"stepped down"' in x]
    assert app_exit, "the app logged no exit (SIGTERM)"
    assert stepped, "the sidecar logged no step-down"
    assert deleted_at < app_exit[0] < stepped[0] <= successor.start

    # The label: never two pods labelled leader at once (in the apiserver's order), and
    # once the deleted pod stepped down its label never said leader again.
    history = observer.label_history()
    assert ps.two_leader_labels(history) == []
    mine = [e for e in history if e.pod == old and e.deleting]
    after_standby = [e for i, e in enumerate(mine)
                     if any(x.role == "standby" for x in mine[:i])]
    assert mine, "the watch saw the pod's deletion"
    assert all(e.role != "leader" for e in after_standby)


def test_rolling_restart_never_two_leaders(app: App) -> None:
    c, ns = app.cluster, app.namespace
    ps.wait_one_leader(c, ns)
    before = {p["metadata"]["name"] for p in ps.app_pods(c, ns)}
    with ps.PodObserver(c, ns) as observer:
        c.wait_for(observer.leader_now, 30, "the observer to see a leader")
        begin = time.time()
        c.kubectl("-n", ns, "rollout", "restart", f"deployment/{app.deployment}")
        ps.wait_rolled_out(c, ns, app.deployment)
        c.wait_for(lambda: not before & set(ps.roles(c, ns)), 120, "the old pods to be gone")
        ps.wait_one_leader(c, ns)
        c.wait_for(observer.leader_now, 30, "the observer to see the new leader")
        end = time.time()
    verdict = observer.verdict(begin, end)
    watched = set(observer.pods)
    assert len(watched) >= 6, f"expected 3 old and 3 new pods, watched {sorted(watched)}"
    assert verdict.overlaps == [], "two pods claimed leadership at once"
    assert verdict.fencing == []
    assert verdict.longest_gap <= ps.GRACEFUL_GAP_BOUND, verdict.gaps
    assert ps.two_leader_labels(observer.label_history()) == []
    # The sampling really ran: every pod's /leader polled at about 50 Hz.
    periods = [p for s in observer.recorder.http_stats.values() for p in s.periods]
    assert periods and sorted(periods)[len(periods) // 2] < 0.1


def test_injector_restart_refuses_then_injects(app: App) -> None:
    """With no injector, an opted-in pod is refused (failurePolicy Fail) and its
    ReplicaSet retries; once the injector is back it comes out injected, and the restarted
    injector kept its CA (the webhook's caBundle is unchanged)."""
    c, ns = app.cluster, app.namespace
    name = f"{RELEASE}-lease-sidecar-injector"
    webhook = f"{ns}-{name}"

    def ca_bundle() -> str:
        return c.kubectl_json("get", "mutatingwebhookconfiguration", webhook)[
            "webhooks"][0]["clientConfig"]["caBundle"]

    ca_before = ca_bundle()
    c.kubectl("-n", ns, "scale", f"deployment/{name}", "--replicas=0")
    c.wait_for(lambda: not c.kubectl_json("-n", ns, "get", "pods", "-l",
                                          "app.kubernetes.io/component=injector")["items"],
               60, "the injector pods to be gone")
    c.kubectl("-n", ns, "scale", f"deployment/{app.deployment}", "--replicas=4")

    def refused() -> bool:
        events = c.kubectl_json("-n", ns, "get", "events",
                                "--field-selector", "reason=FailedCreate")["items"]
        return any("failed calling webhook" in e.get("message", "") for e in events)

    c.wait_for(refused, 60, "the ReplicaSet's create to be refused by the webhook")
    assert len(ps.app_pods(c, ns)) == 3  # nothing was created without the sidecar
    c.kubectl("-n", ns, "scale", f"deployment/{name}", "--replicas=2")
    c.kubectl("-n", ns, "rollout", "status", f"deployment/{name}", "--timeout=120s",
              timeout=130)
    ps.wait_rolled_out(c, ns, app.deployment)
    pods = ps.app_pods(c, ns)
    assert len(pods) == 4
    for pod in pods:
        assert ps.SIDECAR in {x["name"] for x in pod["spec"].get("initContainers", [])}
    assert ca_bundle() == ca_before
    ps.wait_one_leader(c, ns, replicas=4)
    c.kubectl("-n", ns, "scale", f"deployment/{app.deployment}", "--replicas=3")
    ps.wait_rolled_out(c, ns, app.deployment)


def test_a_sidecar_without_a_token_is_not_ready_and_not_restarted(app: App) -> None:
    """automountServiceAccountToken: false with the sidecar declared by hand (the injector
    would refuse the pod; it leaves a pod that has the sidecar alone). Before, /healthz —
    the chart's probe path — said 200: the pod was Ready while its sidecar could never
    lead. Now readiness (/healthz) fails with the reason, and liveness (/livez) does not,
    since a restart brings no token: the app runs, the pod is not Ready, nothing restarts."""
    c, ns = app.cluster, app.namespace
    spec = json.loads(c.kubectl_json("-n", ns, "get", "configmap",
                                     f"{RELEASE}-lease-sidecar-injector")["data"]["sidecar.json"])
    sidecar = spec["container"]
    sidecar["env"] = [e if e["name"] != "LEASE_NAME" else {"name": "LEASE_NAME",
                                                           "value": LEASE_NAME}
                      for e in sidecar["env"]]
    name = "tokenless"
    c.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"serviceAccountName": "app", "automountServiceAccountToken": False,
                 "initContainers": [sidecar], "volumes": spec["volumes"],
                 "containers": [{"name": "app", "image": app.image, "imagePullPolicy": "Never",
                                 "command": ["python", "-c", "import time; time.sleep(3600)"],
                                 "securityContext": sidecar["securityContext"],
                                 "volumeMounts": [spec["appMount"]]}]}}))
    try:
        started = time.monotonic()
        # Past the start gate's window (30 s) and a few liveness periods (10 s).
        deadline = started + 180
        while True:
            pod = c.kubectl_json("-n", ns, "get", "pod", name)
            app_state = {s["name"]: s for s in pod["status"].get("containerStatuses") or []}
            if "running" in (app_state.get("app", {}).get("state") or {}):
                break
            assert time.monotonic() < deadline, pod["status"]
            time.sleep(1)
        time.sleep(max(0.0, started + 60 - time.monotonic()))
        pod = c.kubectl_json("-n", ns, "get", "pod", name)
        side = next(s for s in pod["status"]["initContainerStatuses"]
                    if s["name"] == ps.SIDECAR)
        assert side["restartCount"] == 0 and side["ready"] is False, side
        assert "running" in side["state"]
        ready = next(x for x in pod["status"]["conditions"] if x["type"] == "Ready")
        assert ready["status"] == "False"
        events = c.kubectl_json("-n", ns, "get", "events", "--field-selector",
                                f"involvedObject.name={name}")["items"]
        probes = [e["message"] for e in events if e["reason"] == "Unhealthy"]
        # Readiness fails with the reason; liveness never does. The start gate (the
        # chart's postStart hook: /livez answers) passed: no FailedPostStartHook.
        assert any(m.startswith("Readiness probe failed") for m in probes), probes
        assert not [m for m in probes if m.startswith("Liveness probe failed")], probes
        assert not [e for e in events if e["reason"] == "FailedPostStartHook"], events
        logs = c.kubectl("-n", ns, "logs", name, "-c", ps.SIDECAR).stdout
        lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
        said = [x for x in lines if "credentials" in x["msg"]]
        assert [x["msg"] for x in said] == [
            "no kubernetes credentials: this sidecar can never lead until it has some; "
            "/healthz and /readyz answer 503"]
        assert "no ServiceAccount token at" in said[0]["reason"]
    finally:
        c.kubectl("-n", ns, "delete", "pod", name, "--wait=false", check=False)
