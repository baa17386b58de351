"""One rolling update in real pods with ``lease.shutdownHandover=youngest-ready``: the
leader's pod hands the lease to the youngest Ready pod (a new one), so leadership changes
hands exactly once, no two pods ever claim at once, and the chart's leader Service ends
up with the new leader as its only endpoint. The figures over many rollouts (and without
youngest-ready) are bench/bench_rollout.py's.

Run alone: python -m pytest tests/e2e/test_pods_rollout.py -m pods   (needs root)
"""

from __future__ import annotations

import pytest

from testkit import pods_support as ps
from testkit import rollout_support as rs
from testkit.testbed.cluster import Cluster

pytestmark = [pytest.mark.pods, pytest.mark.slow]

RELEASE = "ls"


def test_one_rollout_one_handover_and_the_service_follows(pod_cluster: Cluster,
                                                         sidecar_image: str) -> None:
    c = pod_cluster
    ns = c.create_namespace("e2e-rollout")
    service_values, service = rs.leader_service_values(RELEASE)
    try:
        ps.install_release(c, ns, sidecar_image, release=RELEASE, extra=(
            "lease.name=rollout", "lease.shutdownHandover=youngest-ready", *service_values))
        ps.deploy_app(c, ns, sidecar_image, "rollout")
        ps.wait_one_leader(c, ns)
        watch = rs.SliceWatch(c, ns, service)
        try:
            with ps.PodObserver(c, ns) as observer:
                row = rs.rollout(c, ns, observer)
                leader_ip = rs.pod_ip(observer, row["final_leader"])
                c.wait_for(lambda: watch.ready_now() == {leader_ip}, 30,
                           "the leader Service's endpoints to be the leader only")
                settled = watch.ready_now()
        finally:
            watch.stop()
        assert row["overlaps"] == 0, "two pods claimed leadership at once"
        assert row["fencing_violations"] == 0
        assert row["two_leader_labels"] == 0
        assert row["handovers"] == 1, row["moves"]
        assert row["to_old_pod"] == 0, row["moves"]
        assert row["gaps"][0] <= ps.GRACEFUL_GAP_BOUND, row["gaps"]
        # Whoever the Service's endpoints reach is the leader, and says so.
        for address in settled:
            status, body = rs.leader_answers(address)
            assert (status, body.get("identity")) == (200, row["final_leader"]), body
    finally:
        c.helm("uninstall", RELEASE, "-n", ns, check=False)
        c.kubectl("delete", "namespace", ns, "--wait=false", check=False)
