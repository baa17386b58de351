"""One sidecar holding 64 Lease names on the real kube-apiserver (several names per pod
are how roles are split). Each Lease keeps a watch open for minutes on a connection of
its own; with a pool of 8 connections shared by watches and calls, a sidecar with 8 names
held none ("0 of 8 held … Connection timeout": the connect timeout also counted the wait
for a free connection). What one more name costs: ``bench/bench_kubernetes.py --names``.
"""

from __future__ import annotations

import time
from itertools import pairwise
from pathlib import Path

import pytest

from testkit.kube_support import Event, Recorder, create_pods, install_rbac
from testkit.support import SidecarProcess, get_json, serving, wait_until
from testkit.testbed.kube import ControlPlane

pytestmark = [pytest.mark.kube, pytest.mark.slow]

NAMES = tuple(f"n{i:02d}" for i in range(64))
# A 10 s lease renewed every third of its validity (3 s, the backend's derived interval):
# 64 names are about 21 renews a second.
TIMING = ["--lease-duration", "10s"]
WATCH_FOR = 30.0  # seconds all must stay held, renewed on time


def renew_gaps(events: list[Event], names: tuple[str, ...]) -> dict[str, float]:
    """Per Lease, the longest time between two consecutive renews (``renewTime``) in
    ``events``: a watch shows every write, so no renew is missed the way sampling with
    ``kubectl get`` on a loaded machine missed them (each missed renew made a gap look
    a renew interval longer)."""
    renews: dict[str, set[float]] = {name: set() for name in names}
    for event in events:
        if event.kind == "lease" and event.renewed is not None and event.name in renews:
            renews[event.name].add(event.renewed)
    return {name: max((b - a for a, b in pairwise(sorted(times))), default=float("inf"))
            for name, times in renews.items()}


def test_64_lease_names_on_one_sidecar_are_all_held_and_renewed_on_time(
        control_plane: ControlPlane, kube_namespace: str, tmp_path: Path) -> None:
    cp, namespace = control_plane, kube_namespace
    kubeconfig = install_rbac(cp, namespace, tuple(f"lease-sidecar.{n}" for n in NAMES))
    create_pods(cp, namespace, "pod-a")
    proc = SidecarProcess(tmp_path, "pod-a", args=[
        "--backend", "kubernetes", "--name", ",".join(NAMES), *TIMING, "--pod-label", "off"],
        env={"POD_NAME": "pod-a", "POD_NAMESPACE": namespace, "KUBECONFIG": str(kubeconfig)})

    def leases() -> list[dict[str, object]]:
        return list(get_json(proc.url + "/status", timeout=5)[1]["leases"])

    with serving([proc]):
        # New Lease objects: each term waits one lease duration before its first claim.
        wait_until(lambda: all(lease["holding"] for lease in leases()), timeout=30,
                   interval=0.5)
        wait_until(lambda: all(get_json(f"{proc.url}/leader/{name}")[0] == 200
                               for name in NAMES), timeout=20, interval=0.5)
        recorder = Recorder(cp.kubeconfig, namespace).start()
        try:
            time.sleep(WATCH_FOR)
        finally:
            recorder.stop()
        gaps = renew_gaps(recorder.snapshot(), tuple(f"lease-sidecar.{n}" for n in NAMES))
        status = leases()
        events = {t["event"] for lease in status for t in lease["transitions"]}
        # Every Lease renewed again and again (a Lease with fewer than two renews seen
        # has an infinite gap), never two renews further apart than the lease's
        # validity (10 s less the 1 s margin).
        assert max(gaps.values()) < 9.0, (sorted(gaps.items(), key=lambda kv: -kv[1])[:5],
                                          events)
        assert all(lease["holding"] for lease in status)
        assert events == {"acquired"}, events  # nothing lost, nothing released
        for name in NAMES:
            assert get_json(f"{proc.url}/leader/{name}")[0] == 200
