"""Kubernetes Events on the pod, against a real kube-apiserver.

Real sidecar processes (kubernetes backend, 3 s lease) run as if in Pending Pod objects,
authenticated as the deploy/rbac.yaml ServiceAccount; they are stopped with real
signals. Assertions read what an operator reads: ``kubectl get events --field-selector
involvedObject.name=<pod>`` and ``kubectl describe pod``; the burst test also counts the
Event writes with a watch.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config, watch

from sidecar.publish.events import MIN_WRITE_INTERVAL, VOLUNTARY
from testkit.kube_support import (
    SERVICE_ACCOUNT,
    install_rbac,
    leaders,
    lease_token,
    rbac_manifest,
    sidecars_in_pods,
)
from testkit.support import SidecarProcess, wait_until
from testkit.testbed.kube import ControlPlane

pytestmark = [pytest.mark.kube, pytest.mark.slow]

PODS = ("web-0", "web-1")


def events_of(cp: ControlPlane, ns: str, pod: str) -> list[dict[str, Any]]:
    out = cp.kubectl("-n", ns, "get", "events", "--field-selector",
                     f"involvedObject.name={pod}", "-o", "json").stdout
    return json.loads(out)["items"]


def wait_event(cp: ControlPlane, ns: str, pod: str, reason: str,
               timeout: float = 10) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        return next((e for e in events_of(cp, ns, pod) if e["reason"] == reason), None)
    return wait_until(found, timeout=timeout, interval=0.2)


def pod_uid(cp: ControlPlane, ns: str, pod: str) -> str:
    return json.loads(cp.kubectl("-n", ns, "get", "pod", pod, "-o", "json").stdout)[
        "metadata"]["uid"]


def log_lines(proc: SidecarProcess) -> list[dict[str, Any]]:
    lines = []
    for line in proc.logs().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


@pytest.fixture
def pair(control_plane: ControlPlane, kube_namespace: str,
         tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    kubeconfig = install_rbac(control_plane, kube_namespace)
    yield from _run_pair(control_plane, kube_namespace, tmp_path, kubeconfig)


def _run_pair(cp: ControlPlane, ns: str, tmp_path: Path,
              kubeconfig: Path) -> Iterator[list[SidecarProcess]]:
    return sidecars_in_pods(cp, ns, tmp_path, kubeconfig, PODS)


def test_a_term_and_its_release_show_on_each_pod(
    control_plane: ControlPlane, kube_namespace: str, pair: list[SidecarProcess]
) -> None:
    cp, ns = control_plane, kube_namespace
    old = leaders(pair)[0]
    other = next(p for p in pair if p is not old)
    token = lease_token(cp, ns)
    elected = wait_event(cp, ns, old.identity, "LeaderElected")
    assert elected["type"] == "Normal"
    assert elected["message"] == f"acquired lease jobs, fencing token {token}"
    assert elected["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": ns,
                                         "name": old.identity,
                                         "uid": pod_uid(cp, ns, old.identity)}
    assert elected["source"] == {"component": "lease-sidecar"}
    assert elected["reportingComponent"] == "lease-sidecar"
    assert elected["reportingInstance"] == old.identity
    assert elected["count"] == 1
    assert events_of(cp, ns, other.identity) == []  # a standby has nothing to report

    old.signal(signal.SIGTERM)
    assert old.proc is not None and old.proc.wait(10) == 0
    # Posted on the way out, after the release (the stop flush).
    released = wait_event(cp, ns, old.identity, "LeaseReleased", timeout=2)
    assert released["type"] == "Normal"
    assert released["message"] == f"released lease jobs, fencing token {token}: shutdown"
    wait_until(lambda: leaders([other]), timeout=10)
    successor = wait_event(cp, ns, other.identity, "LeaderElected")
    # The successor's token is its own term's (the resourceVersion of its acquiring
    # write): larger than the one before, by however many writes came between; the Lease
    # shows it from the successor's first renew on.
    wait_until(lambda: (lease_token(cp, ns) or 0) > token, timeout=10)
    successor_token = lease_token(cp, ns)
    assert successor["message"] == f"acquired lease jobs, fencing token {successor_token}"
    assert successor["reportingInstance"] == other.identity

    # What an operator sees.
    described = cp.kubectl("-n", ns, "describe", "pod", old.identity).stdout
    events = described[described.index("Events:"):]
    for reason in ("LeaderElected", "LeaseReleased"):
        line = next(x for x in events.splitlines() if reason in x)
        assert "lease-sidecar" in line and "lease jobs" in line, line


def test_a_refused_renew_is_a_warning(
    control_plane: ControlPlane, kube_namespace: str, pair: list[SidecarProcess]
) -> None:
    cp, ns = control_plane, kube_namespace
    holder = leaders(pair)[0]
    token = lease_token(cp, ns)
    # Someone else writes the Lease: the holder's next renew is refused.
    cp.kubectl("-n", ns, "patch", "lease", "lease-sidecar.jobs", "--type", "merge",
               "-p", json.dumps({"spec": {"holderIdentity": "intruder"}}))
    lost = wait_event(cp, ns, holder.identity, "LeaseLost")
    assert lost["type"] == "Warning"
    status = json.loads(urllib.request.urlopen(holder.url + "/status", timeout=3).read())
    reason = next(t["reason"] for t in reversed(status["leases"][0]["transitions"])
                  if t["event"] == "lost")
    assert reason.startswith("lost lease")
    assert lost["message"] == f"lost lease jobs, fencing token {token}: {reason}"


def test_a_killed_leaders_label_is_demoted_with_an_event_on_its_pod(
    control_plane: ControlPlane, kube_namespace: str, pair: list[SidecarProcess]
) -> None:
    cp, ns = control_plane, kube_namespace
    old = leaders(pair)[0]
    new = next(p for p in pair if p is not old)
    wait_event(cp, ns, old.identity, "LeaderElected")
    old.signal(signal.SIGKILL)
    wait_until(lambda: leaders([new]), timeout=10)
    demoted = wait_event(cp, ns, old.identity, "StaleLabelDemoted")
    # The new term's token, as the Lease shows it from the new holder's first renew on.
    token = int(demoted["message"].rsplit(" ", 1)[1])
    wait_until(lambda: lease_token(cp, ns) == token, timeout=10)
    assert demoted["type"] == "Normal"
    assert demoted["involvedObject"]["uid"] == pod_uid(cp, ns, old.identity)
    assert demoted["related"]["name"] == new.identity
    assert demoted["related"]["uid"] == pod_uid(cp, ns, new.identity)
    assert demoted["reportingInstance"] == new.identity
    assert demoted["message"] == (f"lease-role leader -> standby: {new.identity} holds "
                                  f"lease jobs, fencing token {token}")
    # A killed sidecar says nothing more: no LeaseReleased for it.
    assert "LeaseReleased" not in {e["reason"] for e in events_of(cp, ns, old.identity)}


class EventWrites:
    """Counts writes of Event objects in one namespace (watch: ADDED and MODIFIED)."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.api = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        self.namespace = namespace
        self.seen: list[tuple[str, str]] = []
        self._stop = threading.Event()
        listed = self.api.list_namespaced_event(namespace)
        self.before = len(listed.items)  # written before the watch began
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        args=(listed.metadata.resource_version,))
        self._thread.start()

    def _run(self, version: str) -> None:
        while not self._stop.is_set():
            stream = watch.Watch()
            for change in stream.stream(self.api.list_namespaced_event, self.namespace,
                                        resource_version=version, timeout_seconds=2,
                                        deserialize=False):
                obj = change["object"]
                version = obj["metadata"]["resourceVersion"]
                self.seen.append((change["type"], obj["metadata"]["name"]))

    def stop(self) -> list[tuple[str, str]]:
        time.sleep(2.5)  # let the watch deliver the last writes
        self._stop.set()
        self._thread.join(5)
        return self.seen


def test_a_burst_of_transitions_is_one_series_per_reason(
    control_plane: ControlPlane, kube_namespace: str, pair: list[SidecarProcess]
) -> None:
    cp, ns = control_plane, kube_namespace
    writes = EventWrites(cp.kubeconfig, ns)
    started = time.monotonic()
    for _ in range(6):  # hand the lease back and forth
        holder = leaders(pair)[0]
        assert holder.release() == 202
        wait_until(lambda h=holder: leaders([p for p in pair if p is not h]), timeout=15)
    for proc in pair:
        proc.signal(signal.SIGTERM)
    for proc in pair:
        assert proc.proc is not None and proc.proc.wait(10) == 0
    seconds = time.monotonic() - started
    seen = writes.stop()

    objects = 0
    transitions = 0
    for proc in pair:
        lines = log_lines(proc)
        # What the elector did, from its own log lines, as (reason, type) -> [lines].
        expected: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for line in lines:
            if line["msg"] == "acquired lease":
                key = ("LeaderElected", "Normal")
            elif line["msg"] == "stepped down" and line["reason"].startswith("lost lease"):
                key = ("LeaseLost", "Warning")
            elif line["msg"] == "stepped down":
                key = ("LeaseReleased", "Normal" if line["reason"] in VOLUNTARY else "Warning")
            else:
                continue
            expected.setdefault(key, []).append(line)
            transitions += 1
        # Normally only these two (a stalled machine may add a Warning step-down).
        assert {("LeaderElected", "Normal"), ("LeaseReleased", "Normal")} <= set(expected)
        series: dict[tuple[str, str], dict[str, Any]] = {}
        for event in events_of(cp, ns, proc.identity):
            key = (event["reason"], event["type"])
            assert key not in series, f"one object per series: {key}"
            series[key] = event
        assert set(series) == set(expected)
        objects += len(series)
        for key, occurred in expected.items():
            # Every occurrence counted; the note follows the latest one.
            assert series[key]["count"] == len(occurred), key
            last = occurred[-1]
            if key[0] == "LeaderElected":
                note = f"acquired lease jobs, fencing token {last['fencing_token']}"
            else:
                verb = "lost" if key[0] == "LeaseLost" else "released"
                note = (f"{verb} lease jobs, fencing token {last['fencing_token']}: "
                        f"{last['reason']}")
            assert series[key]["message"] == note
    assert transitions >= 14  # 6 hand-overs, the first term and the last release
    assert objects <= 6
    # One create per series, then at most one write per interval, plus the stop flush.
    assert writes.before + sum(kind == "ADDED" for kind, _ in seen) == objects
    assert writes.before + len(seen) <= objects * (2 + int(seconds // MIN_WRITE_INTERVAL)), seen
    print(f"\n{transitions} transitions in {seconds:.1f}s -> {objects} Event objects, "
          f"{len(seen)} writes")


def test_without_events_permission_leadership_is_untouched(
    control_plane: ControlPlane, kube_namespace: str, tmp_path: Path
) -> None:
    cp, ns = control_plane, kube_namespace
    documents = list(yaml.safe_load_all(rbac_manifest()))
    role = next(d for d in documents if d["kind"] == "Role")
    role["rules"] = [r for r in role["rules"] if r["resources"] != ["events"]]
    cp.kubectl("-n", ns, "apply", "-f", "-", input=yaml.safe_dump_all(documents))
    kubeconfig = cp.service_account_kubeconfig(ns, SERVICE_ACCOUNT, create=False)
    assert cp.kubectl("auth", "can-i", "create", "events", "-n", ns, kubeconfig=kubeconfig,
                      check=False).stdout.strip() == "no"

    def failures(proc: SidecarProcess) -> list[dict[str, Any]]:
        return [x for x in log_lines(proc) if x["msg"].startswith("posting pod events failed")]

    runs = _run_pair(cp, ns, tmp_path, kubeconfig)
    pair = next(runs)
    try:
        first = leaders(pair)[0]
        second = next(p for p in pair if p is not first)
        assert first.release() == 202  # released, then the other one leads
        wait_until(lambda: leaders([second]), timeout=15)
        time.sleep(3.5)  # the first sits out one lease duration, then stands by again
        sent = time.monotonic()
        second.signal(signal.SIGTERM)
        wait_until(lambda: leaders([first]), timeout=10)
        takeover = time.monotonic() - sent
        assert second.proc is not None and second.proc.wait(10) == 0

        # Leadership moved as usual, with events that could not be posted ...
        assert takeover < 5
        assert events_of(cp, ns, first.identity) == events_of(cp, ns, second.identity) == []
        for proc in pair:
            assert [x for x in log_lines(proc) if x["msg"] == "acquired lease"]
            # ... and one line says so, not one per event.
            [failed] = failures(proc)
            assert "forbidden" in failed["error"].lower() and failed["level"] == "warning"

        # Granted later: the failed writes are tried again and carry every occurrence.
        install_rbac(cp, ns)
        elected = wait_event(cp, ns, first.identity, "LeaderElected", timeout=45)
        acquired = [x for x in log_lines(first) if x["msg"] == "acquired lease"]
        # Both terms (more if a stalled machine cost it one), none lost.
        assert elected["count"] == len(acquired) >= 2, (elected, acquired)
        wait_event(cp, ns, first.identity, "LeaseReleased", timeout=10)
        assert [x["msg"] for x in log_lines(first) if "pod events" in x["msg"]] == [
            failures(first)[0]["msg"], "posting pod events works again"]
    finally:
        for _ in runs:
            pass
