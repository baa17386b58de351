"""Writes to the Lease that are not a sidecar's, on a real kube-apiserver, with three
real sidecar processes (3 s lease, 500 ms renew) polled every ~10-20 ms.

Each trial asserts what an operator relies on: no two sidecars' published claims overlap,
the fencing token never goes down or repeats across holders, and the old holder stops
claiming within 2 s of a write that ends its term (at once, from its watch). Two trials
per case here; ``python -m bench.bench_kubernetes_foreign`` runs ten and prints figures.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from testkit.kube_edits import OBJECT, Trial, patch, run_trial
from testkit.kube_support import (
    create_pods,
    install_rbac,
    leaders,
    lease_spec,
    lease_token,
    rbac_manifest,
    sidecar,
    sidecars_in_pods,
)
from testkit.support import ClaimRecorder, SidecarProcess, get_json, wait_until
from testkit.testbed.kube import ControlPlane

pytestmark = [pytest.mark.kube, pytest.mark.slow]

PODS = ("pod-a", "pod-b", "pod-c")
TRIALS = 2


@pytest.fixture
def trio(control_plane: ControlPlane, kube_namespace: str,
         tmp_path: Path) -> Iterator[list[SidecarProcess]]:
    kubeconfig = install_rbac(control_plane, kube_namespace)
    yield from sidecars_in_pods(control_plane, kube_namespace, tmp_path, kubeconfig, PODS)


# A Lease as helm (or kubectl) creates it: no spec.
EMPTY = json.dumps({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": OBJECT}})


def chart_role(cp: ControlPlane, namespace: str) -> Path:
    """deploy/rbac.yaml without create on Leases, as the chart's Role; its kubeconfig."""
    docs = list(yaml.safe_load_all(rbac_manifest()))
    role = next(d for d in docs if d["kind"] == "Role")
    role["rules"] = [r for r in role["rules"] if r.get("verbs") != ["create"]
                     or "leases" not in r["resources"]]
    cp.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump_all(docs))
    return cp.service_account_kubeconfig(namespace, "lease-sidecar", create=False)


def assert_safe(trial: Trial) -> None:
    assert trial.overlaps == 0, trial
    assert trial.token_regressions == 0, trial
    # A new term's token outranks the old term's: another leader's, or the holder's own
    # when it won the next term itself.
    if trial.token_after is not None and (trial.next_leader != trial.holder
                                          or trial.token_after not in trial.tokens_before):
        assert trial.token_after > max(trial.tokens_before), trial


@pytest.mark.parametrize("edit", ["holder-cleared", "released-by-hand", "holder-to-standby"])
def test_a_hand_edit_that_ends_the_term_never_gives_two_leaders(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess], edit: str
) -> None:
    for _ in range(TRIALS):
        trial = run_trial(control_plane, kube_namespace, trio, edit)
        assert_safe(trial)
        # The holder believed its watch: it stopped long before its next renew could
        # have told it (0.5 s) — well within the 2 s the issue allows.
        assert trial.stepped_down_s is not None and trial.stepped_down_s < 0.5, trial
        assert trial.next_leader is not None, trial


def test_a_duration_edited_to_1s_is_written_back_and_nobody_takes_over(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    for _ in range(TRIALS):
        trial = run_trial(control_plane, kube_namespace, trio, "duration-1s", settle=2.0)
        assert_safe(trial)
        assert trial.stepped_down_s is None and trial.next_leader == trial.holder, trial
        assert lease_spec(control_plane, kube_namespace)["leaseDurationSeconds"] == 3


def test_deleted_with_create_in_the_role_and_a_newcomer_started_at_once(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess],
    tmp_path: Path,
) -> None:
    """deploy/rbac.yaml grants create: the newcomer (and the standbys) may re-create the
    Lease at once, but none claims before the deleted object's holder can have stopped,
    and the new object's first token outranks every token of the deleted one."""
    create_pods(control_plane, kube_namespace, "pod-d")
    kubeconfig = install_rbac(control_plane, kube_namespace)
    newcomer = sidecar(tmp_path, "pod-d", kube_namespace, kubeconfig)
    try:
        trial = run_trial(control_plane, kube_namespace, trio, "deleted",
                          after_edit=newcomer.start)
        assert_safe(trial)
        assert trial.stepped_down_s is not None and trial.stepped_down_s < 2.0, trial
        assert trial.next_leader is not None and trial.token_after is not None, trial
        wait_until(lambda: lease_token(control_plane, kube_namespace) == trial.token_after,
                   timeout=10)
        holder = next(p for p in trio if p.identity == trial.holder)
        assert "the Lease object was deleted by someone else" in holder.logs()
    finally:
        newcomer.stop()


def test_deleted_with_the_charts_role_until_helm_brings_it_back(
    control_plane: ControlPlane, kube_namespace: str, tmp_path: Path
) -> None:
    """The chart's Role has no create: nobody can re-create the Lease. The holder stops
    at once anyway (its watch saw the deletion; a renew would be refused 403, 'forbidden
    to update'), nobody leads until the object is back, and when it comes back empty, as
    ``helm upgrade`` re-creates it, the next term's token outranks the deleted object's."""
    kubeconfig = chart_role(control_plane, kube_namespace)
    control_plane.kubectl("-n", kube_namespace, "create", "-f", "-", input=EMPTY)
    started = sidecars_in_pods(control_plane, kube_namespace, tmp_path, kubeconfig, PODS)
    procs = next(started)
    try:
        first = wait_until(lambda: leaders(procs), timeout=15)[0]
        before = int(get_json(first.url + "/leader")[1]["fencing_token"])
        trial = run_trial(control_plane, kube_namespace, procs, "deleted", settle=1.5)
        assert_safe(trial)
        assert trial.stepped_down_s is not None and trial.stepped_down_s < 2.0, trial
        assert leaders(procs) == []
        time.sleep(1.0)  # helm upgrade comes later
        control_plane.kubectl("-n", kube_namespace, "create", "-f", "-", input=EMPTY)
        leader = wait_until(lambda: leaders(procs), timeout=10)[0]
        token = int(get_json(leader.url + "/leader")[1]["fencing_token"])
        assert token > before
        wait_until(lambda: lease_token(control_plane, kube_namespace) == token, timeout=10)
        standby_logs = "".join(p.logs() for p in procs)
        assert "forbidden to create leases" in standby_logs
        assert "backend forbidden" in standby_logs
    finally:
        started.close()  # stops the sidecars


def test_a_standby_failing_with_backoff_wakes_on_the_watch(
    control_plane: ControlPlane, kube_namespace: str, tmp_path: Path
) -> None:
    """While its calls fail (here: 403, no create, while the Lease is missing) a standby
    backs off up to the lease duration, but once one renew interval has passed its watch
    wakes it when the Lease changes: it leads well within one backoff of the Lease coming
    back (without the watch: anywhere up to 3.6 s later)."""
    kubeconfig = chart_role(control_plane, kube_namespace)
    create_pods(control_plane, kube_namespace, "pod-a")
    proc = sidecar(tmp_path, "pod-a", kube_namespace, kubeconfig, "--pod-label", "off")
    proc.start()
    try:
        proc.wait_http()
        for _ in range(2):
            time.sleep(4.5)  # 403s, backing off to the lease duration (3 s, jittered)
            assert proc.leader() == 503
            made = time.monotonic()
            control_plane.kubectl("-n", kube_namespace, "create", "-f", "-", input=EMPTY)
            wait_until(lambda: proc.leader(timeout=0.5) == 200, timeout=6, interval=0.01)
            took = time.monotonic() - made
            assert took < 1.0, f"led {took:.2f}s after the Lease came back"
            control_plane.kubectl("-n", kube_namespace, "delete", "lease", OBJECT)
            wait_until(lambda: proc.leader(timeout=0.5) == 503, timeout=3)
        assert "backend forbidden" in proc.logs()
    finally:
        proc.stop()


def test_a_token_edited_down_by_hand_does_not_go_back(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    holder = wait_until(lambda: leaders(trio), timeout=15)[0]
    first = int(get_json(holder.url + "/leader")[1]["fencing_token"])
    count = lease_spec(control_plane, kube_namespace)["leaseTransitions"]
    # The holder writes its own count back; the next term still outranks the highest.
    patch(control_plane, kube_namespace, {"leaseTransitions": 0})
    wait_until(lambda: lease_spec(control_plane, kube_namespace)["leaseTransitions"]
               == count, timeout=3)
    holder.release()
    new = wait_until(lambda: (found := leaders(trio)) and found[0] is not holder
                     and found[0], timeout=10)
    assert int(get_json(new.url + "/leader")[1]["fencing_token"]) > first


def test_rbac_revoked_and_restored_for_leases(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    """The RoleBinding goes: the holder's renew is refused (403), so it stops at once and
    says "forbidden" with the verb and the resource; someone leads again once the binding
    is back, and never two at a time."""
    holder = wait_until(lambda: leaders(trio), timeout=15)[0]
    binding = json.loads(control_plane.kubectl("-n", kube_namespace, "get", "rolebinding",
                                               "lease-sidecar", "-o", "json").stdout)
    for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        binding["metadata"].pop(key, None)
    with ClaimRecorder(trio) as recorder:
        control_plane.kubectl("-n", kube_namespace, "delete", "rolebinding",
                              "lease-sidecar")
        revoked = time.monotonic()
        wait_until(lambda: leaders(trio) == [], timeout=5)
        assert time.monotonic() - revoked < 3.0  # within the validity (2 s) + a poll
        wait_until(lambda: "forbidden to update leases/lease-sidecar.jobs in namespace"
                   in holder.logs(), timeout=5)
        control_plane.kubectl("-n", kube_namespace, "create", "-f", "-",
                              input=json.dumps(binding))
        wait_until(lambda: len(leaders(trio)) == 1, timeout=20)
        time.sleep(0.5)
    assert recorder.overlaps() == []
    assert recorder.token_regressions() == []


def next_leader(procs: list[SidecarProcess], old: SidecarProcess) -> SidecarProcess:
    found: SidecarProcess = wait_until(
        lambda: (now := leaders(procs)) and now[0] is not old and now[0], timeout=10)
    return found


def test_a_saved_manifest_applied_while_scaled_to_0_does_not_lower_the_token(
    control_plane: ControlPlane, kube_namespace: str, tmp_path: Path
) -> None:
    """``kubectl apply`` of a Lease saved earlier, while no sidecar runs, puts an old
    ``leaseTransitions`` back, and the sidecars that start afterwards never saw the
    higher count. The token used to be the creation second above the count, so it went
    back by the count's difference; it is now the acquiring write's resourceVersion,
    which no apply can lower."""
    kubeconfig = install_rbac(control_plane, kube_namespace)
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
    started = sidecars_in_pods(control_plane, kube_namespace, tmp_path / "a", kubeconfig,
                               PODS)
    procs = next(started)
    try:
        leader = wait_until(lambda: leaders(procs), timeout=15)[0]
        saved = json.loads(control_plane.kubectl("-n", kube_namespace, "get", "lease",
                                                 OBJECT, "-o", "json").stdout)
        tokens = []
        for _ in range(3):  # three more terms: the count moves on past the saved one
            tokens.append(int(get_json(leader.url + "/leader")[1]["fencing_token"]))
            leader.release()
            leader = next_leader(procs, leader)
        tokens.append(int(get_json(leader.url + "/leader")[1]["fencing_token"]))
    finally:
        started.close()  # scaled to 0
    for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        saved["metadata"].pop(key, None)
    control_plane.kubectl("-n", kube_namespace, "apply", "-f", "-", input=json.dumps(saved))
    again = sidecars_in_pods(control_plane, kube_namespace, tmp_path / "b", kubeconfig,
                             PODS)
    fresh = next(again)
    try:
        leader = wait_until(lambda: leaders(fresh), timeout=20)[0]
        token = int(get_json(leader.url + "/leader")[1]["fencing_token"])
        assert token > max(tokens), (token, tokens)
    finally:
        again.close()


def test_an_annotation_without_a_zone_stops_nobody(
    control_plane: ControlPlane, kube_namespace: str, trio: list[SidecarProcess]
) -> None:
    """A person writes the hand-over hint's bound without a time zone. Comparing it with
    the aware renewTime raised TypeError on every read of the Lease: the holder's renews
    that committed counted as failed, every acquire as 'backend unreachable', and the
    watch task died, so nobody could lead. Now the value is ignored with one log line."""
    holder = wait_until(lambda: leaders(trio), timeout=15)[0]
    standby = next(p for p in trio if p is not holder)
    control_plane.kubectl(
        "-n", kube_namespace, "annotate", "--overwrite", "lease", OBJECT,
        f"lease-sidecar/preferred-holder={standby.identity}",
        "lease-sidecar/preferred-until=2026-12-01T10:00:00")
    time.sleep(2.0)  # four renew intervals
    assert leaders(trio) == [holder]
    assert get_json(holder.url + "/readyz")[0] == 200
    holder.release()
    new = wait_until(lambda: (found := leaders(trio)) and found[0] is not holder
                     and found[0], timeout=10)
    assert new is not None
    logs = "".join(p.logs() for p in trio)
    assert "ignoring the Lease's lease-sidecar/preferred-until" in logs
    assert "backend unreachable" not in logs
