"""The ``kubernetes`` backend against a real kube-apiserver, with real sidecar processes.

Each sidecar runs as the ServiceAccount of deploy/rbac.yaml (so these tests also prove the
Role is enough), believes it runs in a Pending Pod object, and uses a 3 s lease.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from sidecar.lease.kubernetes.record import RELEASED_ANNOTATION
from testkit.clientgo_support import GoElector
from testkit.kube_support import (
    Recorder,
    create_pods,
    install_rbac,
    interop_sidecars,
    leaders,
    lease_spec,
    lease_token,
    sidecar,
    sidecars_in_pods,
)
from testkit.support import REPO, ClaimRecorder, SidecarProcess, get_json, wait_until
from testkit.testbed.kube import ControlPlane

pytestmark = [pytest.mark.kube, pytest.mark.slow]

PODS = ("pod-a", "pod-b", "pod-c")


@pytest.fixture
def sa_kubeconfig(control_plane: ControlPlane, kube_namespace: str) -> Path:
    return install_rbac(control_plane, kube_namespace)


@pytest.fixture
def trio(control_plane: ControlPlane, kube_namespace: str, sa_kubeconfig: Path,
         tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    """Three contenders, each in its own pod, all up and one of them leading."""
    yield from sidecars_in_pods(control_plane, kube_namespace, tmp_path, sa_kubeconfig, PODS)


def the_leader(procs: list[SidecarProcess], timeout: float = 10) -> SidecarProcess:
    found = wait_until(lambda: leaders(procs), timeout=timeout)
    assert len(found) == 1, [p.identity for p in found]
    return found[0]


def assert_next_term(cp: ControlPlane, namespace: str, new: SidecarProcess,
                     transitions: int) -> None:
    """The Lease names ``new`` as its holder, in the term after ``transitions``."""
    spec = lease_spec(cp, namespace)
    assert spec["holderIdentity"] == new.identity
    assert spec["leaseTransitions"] == transitions + 1


def test_exactly_one_leads_and_the_lease_names_it(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    leader = the_leader(trio)
    codes = sorted(p.leader() for p in trio)
    assert codes == [200, 503, 503]
    spec = lease_spec(control_plane, kube_namespace)
    assert spec["holderIdentity"] == leader.identity
    assert spec["leaseDurationSeconds"] == 3
    _, body, _ = get_json(leader.url + "/leader")
    # 2**52 + the resourceVersion of the write that began the term, shown on the Lease
    # from the holder's first renew on.
    assert 2**52 < body["fencing_token"] < 2**53
    wait_until(lambda: lease_token(control_plane, kube_namespace) == body["fencing_token"],
               timeout=10)
    assert spec["acquireTime"].endswith("Z") and spec["renewTime"] >= spec["acquireTime"]
    for standby in (p for p in trio if p is not leader):
        _, body, _ = get_json(standby.url + "/leader")
        assert body["leader"] is False and body["holder"] == leader.identity
        # Losing the race is not an error: the standbys never called the backend down.
        assert "backend unreachable" not in standby.logs()
        assert get_json(standby.url + "/readyz")[0] == 200


def test_the_holder_renews(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    leader = the_leader(trio)
    before = lease_spec(control_plane, kube_namespace)
    wait_until(lambda: lease_spec(control_plane, kube_namespace)["renewTime"]
               > before["renewTime"], timeout=5)
    after = lease_spec(control_plane, kube_namespace)
    assert after["holderIdentity"] == leader.identity
    assert after["leaseTransitions"] == before["leaseTransitions"]  # same term, same token
    assert after["acquireTime"] == before["acquireTime"]


def test_sigterm_releases_and_a_standby_leads_within_a_second(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    old = the_leader(trio)
    token = lease_spec(control_plane, kube_namespace)["leaseTransitions"]
    rest = [p for p in trio if p is not old]
    recorder = Recorder(control_plane.kubeconfig, kube_namespace).start()
    try:
        time.sleep(0.5)  # let the recorder's watches open
        sent = time.monotonic()
        old.signal(signal.SIGTERM)
        new = the_leader(rest, timeout=5)
        took = time.monotonic() - sent
        assert old.proc is not None and old.proc.wait(10) == 0
        # The lease was released (holder cleared, duration 1 like client-go's
        # ReleaseOnCancel) before the standby took it: not a TTL expiry.
        release = recorder.first(sent, 5, lambda e: e.kind == "lease" and e.holder == "")
        taken = recorder.first(sent, 5, lambda e: e.kind == "lease"
                               and e.holder == new.identity)
        assert release.version < taken.version
    finally:
        recorder.stop()
    assert took < 1.0, f"standby led {took:.3f}s after SIGTERM (lease is 3s)"
    assert_next_term(control_plane, kube_namespace, new, token)
    # The release recorded the ended term, so the new holder claimed without waiting a
    # horizon of its own; its write removed the record.
    acquired = [json.loads(line) for line in new.logs().splitlines()
                if '"acquired lease"' in line]
    assert acquired and acquired[-1]["previous_claims_ended"] is True, acquired
    assert acquired[-1]["claim_delay_ms"] == 0.0, acquired
    annotations = json.loads(control_plane.kubectl(
        "-n", kube_namespace, "get", "lease", "lease-sidecar.jobs", "-o", "json"
    ).stdout)["metadata"].get("annotations") or {}
    assert RELEASED_ANNOTATION not in annotations


def test_sigkill_is_taken_over_after_about_the_lease_duration(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    old = the_leader(trio)
    token = lease_spec(control_plane, kube_namespace)["leaseTransitions"]
    rest = [p for p in trio if p is not old]
    killed = time.monotonic()
    old.signal(signal.SIGKILL)
    # Before one lease duration has passed since the last renewal nobody may lead.
    # (The last renewal was at most one renew interval, 0.5 s, before the kill.)
    time.sleep(2.0)
    assert leaders(rest) == []
    new = the_leader(rest, timeout=6)
    took = time.monotonic() - killed
    assert 2.4 <= took <= 5.0, f"took over after {took:.2f}s with a 3s lease"
    assert_next_term(control_plane, kube_namespace, new, token)


def test_fencing_tokens_grow_across_holders(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    tokens = []
    alive = list(trio)
    for _ in range(2):
        leader = the_leader(alive)
        tokens.append(get_json(leader.url + "/leader")[1]["fencing_token"])
        leader.signal(signal.SIGTERM)
        alive.remove(leader)
    leader = the_leader(alive)
    tokens.append(get_json(leader.url + "/leader")[1]["fencing_token"])
    assert tokens == sorted(set(tokens)), tokens
    wait_until(lambda: lease_token(control_plane, kube_namespace) == tokens[-1], timeout=10)


def test_an_unreachable_apiserver_means_not_leader_and_no_crash(
    control_plane: ControlPlane, kube_namespace: str, sa_kubeconfig: Path, tmp_path: Path
) -> None:
    # The same credentials, pointed at a port where nothing listens.
    dead = tmp_path / "dead.kubeconfig"
    dead.write_text(sa_kubeconfig.read_text().replace(control_plane.server,
                                                      "https://127.0.0.1:9"))
    create_pods(control_plane, kube_namespace, "pod-x")
    proc = sidecar(tmp_path, "pod-x", kube_namespace, dead).start()
    try:
        proc.wait_http()
        time.sleep(2.0)
        assert proc.proc is not None and proc.proc.poll() is None
        assert proc.leader() == 503
        assert get_json(proc.url + "/readyz")[0] == 503
        logged = [line for line in proc.logs().splitlines() if "backend unreachable" in line]
        assert logged and "kubernetes: get leases/lease-sidecar.jobs in namespace" in logged[0]
        assert "Traceback" not in proc.logs()
    finally:
        assert proc.stop() == 0


def test_a_name_that_is_no_kubernetes_object_name_is_a_settings_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--backend", "kubernetes",
         "--name", "Nightly_Jobs", "--state-dir", str(tmp_path), "--pod-label", "off",
         "--http-addr", "127.0.0.1:0"],
        cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a valid Kubernetes object name" in lines[-1], result.stderr


def test_a_new_lease_counts_from_2_20_and_each_term_adds_1(
    control_plane: ControlPlane, kube_namespace: str, sa_kubeconfig: Path, tmp_path: Path
) -> None:
    """leaseTransitions counts terms from 2**20 (where sidecars of the earlier token
    layout stop leading, record.OLD_LAYOUT_LIMIT); a release keeps the count and writes,
    as client-go's does, holder "", leaseDurationSeconds 1, acquireTime = renewTime =
    release time. Each term's token is above the last one's."""
    first = sidecar(tmp_path, "pod-a", kube_namespace, sa_kubeconfig, "--pod-label", "off")
    first.start()
    try:
        first.wait_http()
        wait_until(lambda: first.leader() == 200, timeout=15)
        token = get_json(first.url + "/leader")[1]["fencing_token"]
        held = lease_spec(control_plane, kube_namespace)
        assert (held["holderIdentity"], held["leaseTransitions"]) == ("pod-a", 2**20)
    finally:
        assert first.stop() == 0
    released = lease_spec(control_plane, kube_namespace)
    assert released["holderIdentity"] == ""
    assert released["leaseDurationSeconds"] == 1
    assert released["leaseTransitions"] == 2**20
    assert released["acquireTime"] == released["renewTime"] > held["renewTime"]
    second = sidecar(tmp_path, "pod-b", kube_namespace, sa_kubeconfig, "--pod-label", "off")
    second.start()
    try:
        second.wait_http()
        wait_until(lambda: second.leader() == 200, timeout=15)
        assert get_json(second.url + "/leader")[1]["fencing_token"] > token
        assert lease_spec(control_plane, kube_namespace)["leaseTransitions"] == 2**20 + 1
    finally:
        assert second.stop() == 0


def test_fields_we_do_not_own_survive_acquire_renew_and_release(
    coordinated_control_plane: ControlPlane, tmp_path: Path
) -> None:
    cp = coordinated_control_plane
    namespace = cp.create_namespace()
    kubeconfig = install_rbac(cp, namespace)
    cp.kubectl("-n", namespace, "create", "configmap", "owner")
    owner_uid = json.loads(cp.kubectl("-n", namespace, "get", "configmap", "owner",
                                      "-o", "json").stdout)["metadata"]["uid"]
    labels = {"app.kubernetes.io/name": "jobs", "team": "payments"}
    annotations = {"example.com/contact": "oncall@example.com"}
    owners = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner_uid}]
    foreign_spec = {"preferredHolder": "pod-z", "strategy": "OldestEmulationVersion"}
    cp.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "lease-sidecar.jobs", "labels": labels,
                     "annotations": annotations, "ownerReferences": owners},
        "spec": {**foreign_spec, "leaseTransitions": 41}}))

    def lease() -> dict:
        return json.loads(cp.kubectl("-n", namespace, "get", "lease", "lease-sidecar.jobs",
                                     "-o", "json").stdout)

    def assert_kept(obj: dict, when: str) -> None:
        meta, spec = obj["metadata"], obj["spec"]
        assert meta.get("labels") == labels, when
        assert annotations.items() <= (meta.get("annotations") or {}).items(), when
        assert meta.get("ownerReferences") == owners, when
        assert {k: spec.get(k) for k in foreign_spec} == foreign_spec, when

    assert_kept(lease(), "as created (is the feature gate on?)")
    proc = sidecar(tmp_path, "pod-a", namespace, kubeconfig, "--pod-label", "off").start()
    try:
        proc.wait_http()
        acquired = wait_until(lambda: (obj := lease())["spec"].get("holderIdentity") == "pod-a"
                              and obj, timeout=15)
        assert_kept(acquired, "after acquire")
        spec = acquired["spec"]
        assert spec["leaseTransitions"] == 2**20 and spec["acquireTime"] == spec["renewTime"]
        renewed = wait_until(lambda: (obj := lease())["spec"]["renewTime"] > spec["renewTime"]
                             and obj, timeout=5)
        assert_kept(renewed, "after renew")
        assert renewed["spec"]["leaseTransitions"] == 2**20
        assert renewed["spec"]["acquireTime"] == spec["acquireTime"]
    finally:
        assert proc.stop() == 0
    released = lease()
    assert_kept(released, "after release")
    assert released["spec"]["holderIdentity"] == ""
    assert released["spec"]["leaseDurationSeconds"] == 1
    assert released["spec"]["leaseTransitions"] == 2**20
    assert released["spec"]["acquireTime"] == released["spec"]["renewTime"] \
        > renewed["spec"]["renewTime"]


def test_preferred_holder_ends_the_term_and_the_preferred_standby_leads(
    coordinated_control_plane: ControlPlane, tmp_path: Path
) -> None:
    """client-go's cooperative end of term: the holder stops renewing once
    ``preferredHolder`` names someone else. Ours also unpublishes, waits out its claims
    and releases (as on SIGTERM), so the preferred standby leads within 2 s + one horizon
    with no overlap, while the third defers to it; the field stays as it was written."""
    cp = coordinated_control_plane
    namespace = cp.create_namespace()
    kubeconfig = install_rbac(cp, namespace)
    started = sidecars_in_pods(cp, namespace, tmp_path, kubeconfig, PODS)
    procs = next(started)
    try:
        for _ in range(2):  # twice: the second hand-off starts from a preferred holder
            holder = the_leader(procs)
            before = get_json(holder.url + "/leader")[1]["fencing_token"]
            target = next(p for p in procs if p is not holder)
            with ClaimRecorder(procs) as recorder:
                time.sleep(0.3)
                sent = time.time()
                cp.kubectl("-n", namespace, "patch", "lease", "lease-sidecar.jobs",
                           "--type", "merge",
                           "-p", json.dumps({"spec": {  # the apiserver wants both
                               "strategy": "OldestEmulationVersion",
                               "preferredHolder": target.identity}}))
                wait_until(lambda t=target: t.leader() == 200, timeout=5, interval=0.01)
                took = time.time() - sent
                time.sleep(0.5)
            assert recorder.overlaps() == []
            assert recorder.token_regressions() == []
            assert took < 2.25, f"the preferred standby led {took:.2f}s after the patch"
            assert leaders(procs) == [target]
            assert get_json(target.url + "/leader")[1]["fencing_token"] > before
            assert f"end of term: preferredHolder set to {target.identity}" in holder.logs()
            spec = json.loads(cp.kubectl("-n", namespace, "get", "lease",
                                         "lease-sidecar.jobs", "-o", "json").stdout)["spec"]
            assert spec["preferredHolder"] == target.identity
            assert spec["holderIdentity"] == target.identity
    finally:
        started.close()


def preferred(cp: ControlPlane, namespace: str, identity: str) -> float:
    """Set preferredHolder (with the strategy the apiserver requires); the wall time."""
    sent = time.time()
    cp.kubectl("-n", namespace, "patch", "lease", INTEROP_OBJECT, "--type", "merge",
               "-p", json.dumps({"spec": {"strategy": "OldestEmulationVersion",
                                          "preferredHolder": identity}}))
    return sent


INTEROP_OBJECT = "lease-sidecar.interop"


def test_preferred_holder_hands_over_from_a_sidecar_to_clientgo(
    coordinated_control_plane: ControlPlane, clientgo_elector: Path, tmp_path: Path
) -> None:
    """The sidecar yields to a client-go elector named preferredHolder; the other sidecar
    defers to it, and client-go (polling every 100 ms) starts leading only after the
    sidecar's last claim ran out (it releases after waiting its claims out)."""
    cp = coordinated_control_plane
    namespace = cp.create_namespace()
    kubeconfig = install_rbac(cp, namespace, (INTEROP_OBJECT,))
    procs = interop_sidecars(cp, namespace, tmp_path, kubeconfig)
    go = GoElector(clientgo_elector, tmp_path, "go-1", namespace, kubeconfig)
    try:
        for proc in procs:
            proc.start()
        holder = the_leader(procs, timeout=15)
        go.start()
        time.sleep(0.5)  # client-go is a standby now
        with ClaimRecorder(procs) as recorder:
            sent = preferred(cp, namespace, "go-1")
            wait_until(go.leading, timeout=5, interval=0.01)
            time.sleep(0.5)
        started = go.first("started")
        assert started is not None
        assert started["at"] - sent < 2.25, f"client-go led {started['at'] - sent:.2f}s after"
        last_until = max(until for _, _, until in recorder.claims)
        assert last_until <= started["at"], "a sidecar claim ran into client-go's term"
        assert leaders(procs) == []
        assert "end of term: preferredHolder set to go-1" in holder.logs()
    finally:
        go.stop()
        for proc in procs:
            proc.stop()


def test_preferred_holder_hands_over_from_coordinated_clientgo_to_a_sidecar(
    coordinated_control_plane: ControlPlane, clientgo_elector: Path, tmp_path: Path
) -> None:
    """A client-go elector in coordinated mode stops renewing once preferredHolder is set
    (client-go v0.37.2's end of term); after its renew deadline it releases and a sidecar
    leads, never before client-go stopped. The test names client-go holder by hand, as
    coordinated leader election's controller in the apiserver would."""
    cp = coordinated_control_plane
    namespace = cp.create_namespace()
    kubeconfig = install_rbac(cp, namespace, (INTEROP_OBJECT,))
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    cp.kubectl("-n", namespace, "create", "-f", "-", input=json.dumps({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": INTEROP_OBJECT},
        "spec": {"holderIdentity": "go-1", "leaseDurationSeconds": 3, "leaseTransitions": 5,
                 "acquireTime": now, "renewTime": now,
                 "strategy": "OldestEmulationVersion"}}))
    go = GoElector(clientgo_elector, tmp_path, "go-1", namespace, kubeconfig,
                   extra_args=("-coordinated",)).start()
    procs = interop_sidecars(cp, namespace, tmp_path, kubeconfig)
    try:
        wait_until(go.leading, timeout=10)
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.wait_http()
        time.sleep(1.0)
        assert leaders(procs) == []
        with ClaimRecorder(procs) as recorder:
            sent = preferred(cp, namespace, "pod-a")
            new = the_leader(procs, timeout=8)
            took = time.time() - sent
            time.sleep(0.5)
        stopped = go.first("stopped")
        assert stopped is not None, "client-go did not end its term"
        first_claim = min(seen for _, seen, _ in recorder.claims)
        assert first_claim >= stopped["at"], "a sidecar claimed while client-go led"
        # client-go's renew deadline (2 s) + its release + one claim horizon.
        assert took < 3.5, f"a sidecar led {took:.2f}s after preferredHolder was set"
        assert get_json(new.url + "/leader")[1]["fencing_token"] > 2**52
    finally:
        go.stop()
        for proc in procs:
            proc.stop()


def test_an_insecure_kubeconfig_logs_json_lines_only(
    control_plane: ControlPlane, kube_namespace: str, sa_kubeconfig: Path, tmp_path: Path
) -> None:
    """An unverified apiserver is worth one warning, as a JSON line like every other line
    (urllib3 used to warn on every request, in lines of its own)."""
    insecure = tmp_path / "insecure.kubeconfig"
    doc = yaml.safe_load(sa_kubeconfig.read_text())
    cluster = doc["clusters"][0]["cluster"]
    cluster.pop("certificate-authority-data")
    cluster["insecure-skip-tls-verify"] = True
    insecure.write_text(yaml.safe_dump(doc))
    create_pods(control_plane, kube_namespace, "pod-i")
    proc = sidecar(tmp_path, "pod-i", kube_namespace, insecure, "--pod-label", "off").start()
    try:
        proc.wait_http()
        wait_until(lambda: proc.leader() == 200, timeout=15)
        time.sleep(1.5)  # a few renews, each one request
    finally:
        assert proc.stop() == 0
    lines = proc.logs().splitlines()
    parsed = [json.loads(line) for line in lines]  # every line is JSON
    warned = [p for p in parsed if "insecure-skip-tls-verify" in p["msg"]]
    assert len(warned) == 1, warned
    assert warned[0]["logger"] == "sidecar.lease.kubernetes"
