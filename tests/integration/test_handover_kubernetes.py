"""Deliberate hand-over on the kubernetes backend, with a real kube-apiserver whose
CoordinatedLeaderElection gate is on (without it the apiserver drops
``spec.preferredHolder``): the leader writes the named standby into ``preferredHolder``,
then steps down as on SIGTERM; the other standbys defer to it (:mod:`sidecar.lease.
kubernetes.expiry`), sidecars and client-go electors alike. No two overlapping claims.
With the gate off (the default, which drops the field) the hint annotations do it for
sidecar standbys.
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest

from sidecar.lease.kubernetes.record import HINT_ANNOTATION
from testkit.clientgo_support import GoElector
from testkit.kube_support import (
    install_rbac,
    interop_sidecars,
    leaders,
    lease_spec,
    mark_ready,
    sidecars_in_pods,
)
from testkit.support import ClaimRecorder, SidecarProcess, post_json, wait_until
from testkit.testbed.kube import ControlPlane

pytestmark = pytest.mark.kube

PODS = ("pod-a", "pod-b", "pod-c")
LEASE_DURATION = 3.0  # testkit.kube_support.FAST
CLAIM_HORIZON = 0.25  # the default
# Two claim horizons, plus the round trips (preferredHolder, release, acquire through the
# watch) on a 2-core machine shared with other tests.
BOUND = 2 * CLAIM_HORIZON + 1.0


def only_leader(procs: list[SidecarProcess]) -> SidecarProcess | None:
    found = leaders(procs)
    return found[0] if len(found) == 1 else None


def leader_and_a_standby(procs: list[SidecarProcess],
                         rng: random.Random) -> tuple[SidecarProcess, SidecarProcess]:
    """The one leader, once a lease duration has passed (both standbys campaign again),
    and one of its standbys picked at random: the hand-over's target."""
    leader = wait_until(lambda: only_leader(procs), timeout=15)
    time.sleep(LEASE_DURATION + 0.5)
    return leader, rng.choice([p for p in procs if p is not leader])


def test_the_named_standby_leads_and_a_later_sigterm_is_not_held_back(
        coordinated_control_plane: ControlPlane, tmp_path: Path) -> None:
    cp = coordinated_control_plane
    namespace = cp.create_namespace()
    kubeconfig = install_rbac(cp, namespace)
    started = sidecars_in_pods(cp, namespace, tmp_path, kubeconfig, PODS)
    procs = next(started)
    mark_ready(cp, namespace, *PODS)  # a hand-over's target must be Ready
    rng = random.Random(21)
    try:
        with ClaimRecorder(procs) as recorder:
            recorder.seen_a_claim()
            for _ in range(2):
                leader, target = leader_and_a_standby(procs, rng)
                sent = time.monotonic()
                status = post_json(f"{leader.url}/handover?to={target.identity}")[0]
                assert status == 202
                wait_until(lambda t=target: t.leader() == 200, timeout=10, interval=0.01)
                took = time.monotonic() - sent
                assert took <= BOUND, f"the named standby led {took:.2f}s after the request"
                assert lease_spec(cp, namespace)["preferredHolder"] == target.identity
            # The served preference must not hold the next SIGTERM hand-over back by a
            # lease duration: the release clears a preferredHolder naming the releaser.
            holder = wait_until(lambda: only_leader(procs), timeout=5)
            holder.signal(signal.SIGTERM)
            stopped = time.monotonic()
            rest = [p for p in procs if p is not holder]
            wait_until(lambda: only_leader(rest), timeout=10, interval=0.01)
            assert time.monotonic() - stopped < 1.5
            time.sleep(0.3)
        assert recorder.overlaps() == []
        assert "preferredHolder" not in lease_spec(cp, namespace)
    finally:
        started.close()


def test_without_the_feature_gate_the_hint_annotation_names_the_standby(
        control_plane: ControlPlane, kube_namespace: str, tmp_path: Path) -> None:
    """The session's apiserver has CoordinatedLeaderElection off, as clusters have by
    default: it drops ``preferredHolder``, so without the annotations both standbys raced
    for the release and the named one won about half the time (in a rollout with
    ``LEASE_SHUTDOWN_HANDOVER=youngest-ready``, an old pod often won). Four hand-overs to
    a standby picked at random: the named one leads every time, no overlap."""
    namespace = kube_namespace
    kubeconfig = install_rbac(control_plane, namespace)
    started = sidecars_in_pods(control_plane, namespace, tmp_path, kubeconfig, PODS)
    procs = next(started)
    mark_ready(control_plane, namespace, *PODS)  # a hand-over's target must be Ready
    rng = random.Random(2121)
    try:
        with ClaimRecorder(procs) as recorder:
            recorder.seen_a_claim()
            for _ in range(4):
                leader, target = leader_and_a_standby(procs, rng)
                assert post_json(f"{leader.url}/handover?to={target.identity}")[0] == 202
                wait_until(lambda t=target: only_leader(procs) is t, timeout=10,
                           interval=0.01)
                lease = json.loads(control_plane.kubectl(
                    "-n", namespace, "get", "lease", "lease-sidecar.jobs", "-o",
                    "json").stdout)
                assert "preferredHolder" not in lease["spec"]  # the gate is off
                assert lease["metadata"]["annotations"][HINT_ANNOTATION] == target.identity
            time.sleep(0.3)
        assert recorder.overlaps() == []
    finally:
        started.close()


def test_a_clientgo_elector_as_the_named_target(
        coordinated_control_plane: ControlPlane, clientgo_elector: Path, tmp_path: Path) -> None:
    """The other sidecar defers to the client-go elector named; client-go (polling every
    100 ms) leads only after the sidecar's last claim ran out."""
    cp = coordinated_control_plane
    namespace = cp.create_namespace()
    kubeconfig = install_rbac(cp, namespace, ("lease-sidecar.interop",))
    procs = interop_sidecars(cp, namespace, tmp_path, kubeconfig)
    go = GoElector(clientgo_elector, tmp_path, "go-1", namespace, kubeconfig)
    try:
        for proc in procs:
            proc.start()
        holder = wait_until(lambda: only_leader(procs), timeout=15)
        go.start()
        time.sleep(1.0)  # client-go is a standby now
        with ClaimRecorder(procs) as recorder:
            recorder.seen_a_claim()
            sent = time.time()
            assert post_json(f"{holder.url}/handover/interop?to=go-1")[0] == 202
            wait_until(go.leading, timeout=10, interval=0.01)
            time.sleep(0.5)
        started = go.first("started")
        assert started is not None
        assert started["at"] - sent <= BOUND + 0.2, started["at"] - sent  # its 100 ms poll
        assert max(until for _, _, until in recorder.claims) <= started["at"]
        assert leaders(procs) == []
    finally:
        go.stop()
        for proc in procs:
            proc.stop()
