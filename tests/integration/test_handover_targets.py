"""Hand-over targets that can lead, with real sidecar processes.

A hand-over names a successor, and the other standbys stand aside for it. A successor
that never takes the lease — a typo, a terminating pod, a pod whose sidecar runs in role
``api`` or is not Ready — used to keep them standing aside for a whole lease duration,
with nobody leading. Now:

- where a sidecar can see its group's pods (in a pod, with the pod label), ``POST
  /handover?to=`` checks the target first and refuses one that cannot lead with ``409``
  and the reason (SQLite and ``kubernetes``, their Pod objects on the real apiserver);
- where it cannot (outside pods), the hint that holds the others back lives one retry
  interval past the release, not a lease duration (SQLite and PostgreSQL rows);
- two requests at once: one hands over, the other is refused saying what is under way.

No two claims ever overlap (the recorder polls every sidecar).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from testkit.handover import FAST, LEASE_DURATION, backend_args
from testkit.kube_support import create_pods, install_rbac, mark_ready, role_column
from testkit.kube_support import sidecar as kube_sidecar
from testkit.support import (
    ClaimRecorder,
    ReadyEndpoint,
    SidecarProcess,
    get_json,
    one_leader,
    post_json,
    serving,
    wait_until,
)
from testkit.testbed.kube import ControlPlane

RENEW_INTERVAL = 0.3  # testkit.handover.FAST


def first_claim_after(recorder: ClaimRecorder, identity: str, after: float) -> float | None:
    return min((seen for who, seen, _ in recorder.claims if who == identity and seen >= after),
               default=None)


def leaderless_gap(recorder: ClaimRecorder, old: str, after: float) -> float:
    """From the old leader's last claim running out to anyone else's first claim."""
    firsts = [seen for who, seen, _ in recorder.claims if who != old and seen >= after]
    assert firsts, "nobody led after the hand-over"
    first = min(firsts)
    last = max(until for who, seen, until in recorder.claims if who == old and seen < first)
    return max(0.0, first - last)


@pytest.mark.parametrize("backend", ["sqlite", "postgres-row"])
def test_a_successor_that_never_comes_holds_the_others_back_one_retry_interval(
        backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    dsn = (str(tmp_path / "leases.db") if backend == "sqlite"
           else request.getfixturevalue("pg_dsn"))
    procs = [SidecarProcess(tmp_path, f"{backend}-{i}", args=backend_args(backend, dsn))
             for i in range(3)]
    with serving(procs):
        leader = wait_until(lambda: one_leader(procs, timeout=0.5), timeout=30)
        time.sleep(LEASE_DURATION + 0.5)  # both standbys campaign
        with ClaimRecorder(procs) as recorder:
            recorder.seen_a_claim()
            sent = time.time()
            status, body, _ = post_json(f"{leader.url}/handover/handover?to=web-typo")
            assert status == 202, body
            wait_until(lambda: one_leader([p for p in procs if p is not leader],
                                          timeout=0.5), timeout=10, interval=0.01)
            time.sleep(0.3)
        assert recorder.overlaps() == []
        gap = leaderless_gap(recorder, leader.identity, sent)
        # The hint: the last claim (one horizon) and a retry interval (1.25 renew
        # intervals); then up to a retry interval (+20 %) until a standby looks again,
        # and round trips. The hint lived a lease duration (2 s) before.
        assert gap < 0.1 + 1.25 * RENEW_INTERVAL + 1.2 * RENEW_INTERVAL + 0.3, gap
        assert body["checked"].startswith("not checked: this sidecar cannot see its "
                                          "group's pods")


def test_two_requests_at_once_one_hands_over_the_other_says_what_is_under_way(
        tmp_path: Path) -> None:
    procs = [SidecarProcess(tmp_path, f"s-{i}", args=backend_args(
        "sqlite", str(tmp_path / "leases.db"))) for i in range(3)]
    with serving(procs):
        leader = wait_until(lambda: one_leader(procs, timeout=0.5), timeout=30)
        time.sleep(LEASE_DURATION + 0.5)
        first, second = [p.identity for p in procs if p is not leader]
        answers: dict[str, tuple[int, dict[str, object]]] = {}

        def ask(to: str) -> None:
            status, body, _ = post_json(f"{leader.url}/handover/handover?to={to}")
            answers[to] = (status, body)

        threads = [threading.Thread(target=ask, args=(to,)) for to in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        statuses = sorted(status for status, _ in answers.values())
        assert statuses == [202, 409], answers
        winner = next(to for to, (status, _) in answers.items() if status == 202)
        loser = next(body for status, body in answers.values() if status == 409)
        assert loser["error"] == f"already stepping down: handed over to {winner}"
        new = next(p for p in procs if p.identity == winner)
        wait_until(lambda: new.leader() == 200, timeout=10)


# -- in pods: the target checked against the group ---------------------------------------

def pod_note(cp: ControlPlane, namespace: str, pod: str) -> dict:
    """The pod's ``lease-sidecar/lease`` annotation as its sidecar last wrote it."""
    got = json.loads(cp.kubectl("-n", namespace, "get", "pod", pod, "-o", "json").stdout)
    return json.loads(got["metadata"].get("annotations", {}).get("lease-sidecar/lease", "{}"))


def terminating_pod(cp: ControlPlane, namespace: str, pod: str, group: str) -> None:
    """A Ready standby pod of the group, deleted but held by a finalizer."""
    create_pods(cp, namespace, pod)
    cp.kubectl("-n", namespace, "patch", "pod", pod, "--type=merge", "-p", json.dumps(
        {"metadata": {"finalizers": ["lease-sidecar.test/hold"],
                      "labels": {"lease-sidecar/group": group, "lease-role": "standby"}}}))
    mark_ready(cp, namespace, pod)
    cp.kubectl("-n", namespace, "delete", "pod", pod, "--wait=false")


def release_finalizer(cp: ControlPlane, namespace: str, pod: str) -> None:
    cp.kubectl("-n", namespace, "patch", "pod", pod, "--type=merge", "-p",
               json.dumps({"metadata": {"finalizers": None}}), check=False)


@pytest.mark.kube
@pytest.mark.parametrize("backend", ["sqlite", "kubernetes"])
def test_in_pods_a_target_that_cannot_lead_is_refused_with_the_reason(
        backend: str, control_plane: ControlPlane, kube_namespace: str,
        tmp_path: Path) -> None:
    cp, namespace = control_plane, kube_namespace
    lease = "jobs"
    kubeconfig = install_rbac(cp, namespace)
    pods = ("pod-a", "pod-b", "pod-api")
    create_pods(cp, namespace, *pods)
    mark_ready(cp, namespace, *pods)

    def start(pod: str, *extra: str) -> SidecarProcess:
        if backend == "kubernetes":
            return kube_sidecar(tmp_path, pod, namespace, kubeconfig, "--pod-label", "on",
                                *extra, lease=lease)
        return SidecarProcess(tmp_path, pod, args=[
            "--dsn", str(tmp_path / "leases.db"), "--name", lease, *FAST,
            "--pod-label", "on", *extra],
            env={"POD_NAME": pod, "POD_NAMESPACE": namespace, "KUBECONFIG": str(kubeconfig)})

    # pod-idle's application is not ready (LEASE_APP_READY_URL) while its pod is Ready:
    # only its sidecar's annotation shows that it sits out.
    idle_app = ReadyEndpoint(503)
    create_pods(cp, namespace, "pod-idle")
    mark_ready(cp, namespace, "pod-idle")
    procs = [start("pod-a"), start("pod-b"), start("pod-api", "--role", "api"),
             start("pod-idle", "--app-ready-url", idle_app.url)]
    terminating_pod(cp, namespace, "pod-gone", f"lease-sidecar.{lease}")
    try:
        with serving(procs):
            leader = wait_until(lambda: one_leader(procs[:2], timeout=0.5), timeout=30)
            standby = procs[1 - procs.index(leader)]
            wait_until(lambda: role_column(cp, namespace).get("pod-api") == "api"
                       and role_column(cp, namespace).get(standby.identity) == "standby"
                       and "the application is not ready" in
                       pod_note(cp, namespace, "pod-idle").get("sits_out", ""), timeout=15)
            mark_ready(cp, namespace, standby.identity, ready=False)
            refused = {
                "web-typo": f"no pod web-typo in namespace {namespace} (identities here "
                            "are pod names)",
                "pod-api": "pod pod-api runs its sidecar in role api, which never "
                           "campaigns",
                "pod-gone": "pod pod-gone is terminating",
                standby.identity: f"pod {standby.identity} is not Ready",
            }
            for to, why in refused.items():
                status, body, _ = post_json(f"{leader.url}/handover/{lease}?to={to}")
                assert (status, body) == (409, {
                    "handed_over": False, "error": f"cannot hand over to {to}: {why}"})
            status, body, _ = post_json(f"{leader.url}/handover/{lease}?to=pod-idle")
            assert status == 409 and body["error"].startswith(
                "cannot hand over to pod-idle: pod pod-idle's sidecar sits out (not "
                f"campaigning: the application is not ready: {idle_app.url} "), body
            assert leader.leader() == 200  # refused: it leads on
            mark_ready(cp, namespace, standby.identity)
            with ClaimRecorder(procs[:2]) as recorder:
                status, body, _ = post_json(
                    f"{leader.url}/handover/{lease}?to={standby.identity}")
                assert (status, body["to"], body["checked"]) == (202, standby.identity,
                                                                 "checked")
                wait_until(lambda: standby.leader() == 200, timeout=10, interval=0.01)
                time.sleep(0.3)
            assert recorder.overlaps() == []
            assert get_json(leader.url + "/leader")[0] == 503
            # Its application ready, the sidecar campaigns again and says so.
            idle_app.status = 200
            wait_until(lambda: "sits_out" not in pod_note(cp, namespace, "pod-idle"),
                       timeout=15)
    finally:
        idle_app.close()
        release_finalizer(cp, namespace, "pod-gone")
