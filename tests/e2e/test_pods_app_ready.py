"""Lead only while the app can work, in real pods: the chart with
``lease.appReadyContainers={app}``, an app container whose exec readiness probe passes
only while a file the test creates in its emptyDir exists, and a kubelet that probes it
every second. A pod whose app is never Ready never leads; a leader whose app turns not
Ready hands over within ``LEASE_APP_UNREADY_AFTER`` + one hand-over, with no two pods
claiming at once (every pod's ``/leader`` polled every 20 ms, its leader file every
10 ms), and says so in its metrics and a ``LeaseHandedOver`` Event.

Run alone: python -m pytest tests/e2e/test_pods_app_ready.py -m pods   (needs root)
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest

from testkit import pods_support as ps
from testkit.testbed.cluster import Cluster

pytestmark = [pytest.mark.pods, pytest.mark.slow]

RELEASE = "ls"
LEASE = "appready"
UNREADY_AFTER = 2.0
# One hand-over, bounded as every graceful hand-over in these tests is: the standby takes
# the lease when its Lease watch reports the release, or at the latest on its next retry
# (a renew interval + 20 % jitter), then waits one claim horizon; 1 s of slack.
HANDOVER_BOUND = ps.GRACEFUL_GAP_BOUND


def sidecar_get(observer: ps.PodObserver, pod: str, path: str) -> str:
    ip = observer.pods[pod]["status"]["podIP"]
    try:
        with urllib.request.urlopen(f"http://{ip}:8099{path}", timeout=5) as answer:
            return str(answer.read().decode())
    except urllib.error.HTTPError as err:
        return str(err.read().decode())


def metric(text: str, line_start: str) -> float | None:
    return next((float(line.split()[-1]) for line in text.splitlines()
                 if line.startswith(line_start)), None)


def set_ready(cluster: Cluster, observer: ps.PodObserver, pod: str, ready: bool) -> float:
    """Create or remove the pod's readiness file; when it was done."""
    path = ps.ready_file_path(cluster, observer.pods[pod])
    if ready:
        path.write_text("ok\n")
    else:
        path.unlink()
    return time.time()


def app_ready_seen(observer: ps.PodObserver, pod: str, ready: bool, after: float) -> float | None:
    """When the pod watch first showed the app container's ``ready`` as ``ready`` after
    ``after``."""
    return next((t for t, p, r in list(observer.app_ready) if p == pod and r == ready
                 and t >= after), None)


def test_lead_only_while_the_app_container_is_ready(pod_cluster: Cluster,
                                                    sidecar_image: str) -> None:
    c = pod_cluster
    ns = c.create_namespace("e2e-appready")
    try:
        ps.install_release(c, ns, sidecar_image, release=RELEASE, extra=(
            f"lease.name={LEASE}", "lease.appReadyContainers={app}",
            f"lease.appUnreadyAfter={UNREADY_AFTER:.0f}s"))
        ps.deploy_app(c, ns, sidecar_image, LEASE, ready_file=True)
        with ps.PodObserver(c, ns) as observer:
            pods = sorted(p["metadata"]["name"] for p in ps.app_pods(c, ns))
            first, second, never = pods
            c.wait_for(lambda: len(observer.recorder.targets) == 3, 30,
                       "the observer to poll every pod")
            begin = time.time()

            # 1. No app is Ready: for more than two renew intervals nobody claims.
            time.sleep(2 * ps.RENEW_INTERVAL + 1.0)
            assert observer.spans() == [], "a pod whose app was not Ready led"
            for pod in pods:
                # Each sidecar reads its pod's status from its own watch; on a loaded
                # node the first event may come later than the wait above (it says
                # "readiness not checked yet" meanwhile, and does not campaign either).
                def reason(pod: str = pod) -> str:
                    status = json.loads(sidecar_get(observer, pod, "/status"))
                    return str(status["leases"][0]["reason"])

                c.wait_for(lambda pod=pod: "container app is not Ready" in reason(pod), 30,
                           f"{pod}'s sidecar to see its app not Ready")
                assert "not campaigning" in reason(pod), reason(pod)
            assert observer.spans() == [], "a pod whose app was not Ready led"

            # 2. Two apps become Ready: one of them leads; the third never does.
            for pod in (first, second):
                set_ready(c, observer, pod, True)
            leader = c.wait_for(lambda: observer.leader_now(), 30,
                                "a pod whose app is Ready to lead")
            assert leader in (first, second)
            standby = second if leader == first else first
            c.wait_for(lambda: app_ready_seen(observer, standby, True, begin), 30,
                       "the standby's app to be Ready")
            time.sleep(0.5)

            # 3. The leader's app turns not Ready: the standby leads within
            # LEASE_APP_UNREADY_AFTER + one hand-over of the pod status saying so.
            removed = set_ready(c, observer, leader, False)
            unready = c.wait_for(lambda: app_ready_seen(observer, leader, False, removed), 30,
                                 "the pod watch to show the leader's app not Ready")
            took_over = c.wait_for(lambda: observer.first_claim_after(removed,
                                                                      exclude=leader),
                                   30, "the standby to lead")
            c.wait_for(lambda: observer.leader_now() == standby, 10,
                       "the observer to see the new leader")
            time.sleep(1.0)
            end = time.time()
            metrics = sidecar_get(observer, leader, "/metrics")
            old_status = json.loads(sidecar_get(observer, leader, "/status"))
            history = observer.label_history()
            verdict = observer.verdict(begin, end)
            spans = observer.spans()

        took = took_over.start - unready
        print(f"\napp not Ready (pod watch) -> the standby's first claim: {took * 1000:.0f} ms "
              f"(LEASE_APP_UNREADY_AFTER {UNREADY_AFTER:.0f} s); the probe saw the file "
              f"gone after {(unready - removed) * 1000:.0f} ms")
        assert took_over.identity == standby
        assert verdict.overlaps == [], "two pods claimed leadership at once"
        assert verdict.fencing == []
        assert ps.two_leader_labels(history) == []
        assert not [s for s in spans if s.identity == never], "the never-Ready pod led"
        assert UNREADY_AFTER - 0.3 <= took <= UNREADY_AFTER + HANDOVER_BOUND, took
        # The old leader, not Ready, does not claim again; its status says why it let go.
        assert not [s for s in spans if s.identity == leader and s.start > took_over.start]
        assert old_status["leases"][0]["reason"] == "handed over (app-unready)"
        # Metrics: the hand-over by its reason, and the time led while not Ready.
        assert metric(metrics, f'lease_sidecar_handovers_total{{lease="{LEASE}",'
                               'reason="app-unready"}') == 1.0
        unready_led = metric(metrics, "lease_sidecar_app_unready_leading_seconds_total")
        assert unready_led is not None and UNREADY_AFTER - 0.5 <= unready_led <= took + 1.0
        # The Event, a Warning about the old leader's pod.
        def handed_over() -> list[dict[str, Any]]:
            items = c.kubectl_json("-n", ns, "get", "events", "--field-selector",
                                   f"involvedObject.name={leader}")["items"]
            return [e for e in items if e.get("reason") == "LeaseHandedOver"]

        events = c.wait_for(handed_over, 30, "the LeaseHandedOver Event")
        assert events[0]["type"] == "Warning"
        assert "(app-unready)" in events[0]["message"], events[0]
    finally:
        c.helm("uninstall", RELEASE, "-n", ns, check=False)
        c.kubectl("delete", "namespace", ns, "--wait=false", check=False)
