"""One rolling update in real pods with ``lease.shutdownHandover=youngest-ready``: the
leader's pod hands the lease to the youngest Ready pod (a new one), so leadership changes
hands exactly once, no two pods ever claim at once, and the chart's leader Service ends
up with the new leader as its only endpoint: a client pod asking ``/leader`` through the
Service's ClusterIP every 20 ms (kube-proxy's rules) reaches only the new leader once
a request has reached it. The figures over many rollouts (and without
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
        client = rs.ServiceClient(c, ns, service, sidecar_image)
        try:
            with ps.PodObserver(c, ns) as observer:
                c.wait_for(lambda: client.history()[-1].status == 200, 30,
                           "the Service client to reach the leader")
                row = rs.rollout(c, ns, observer)
                through = rs.settled_through_service(c, client, row)
                leader_ip = rs.pod_ip(observer, row["final_leader"])
                settled = watch.ready_now()
        finally:
            client.stop()
            watch.stop()
        assert row["overlaps"] == 0, "two pods claimed leadership at once"
        assert row["fencing_violations"] == 0
        assert row["two_leader_labels"] == 0
        assert row["handovers"] == 1, row["moves"]
        assert row["to_old_pod"] == 0, row["moves"]
        assert row["gaps"][0] <= ps.GRACEFUL_GAP_BOUND, row["gaps"]
        assert settled == {leader_ip}
        # Through the ClusterIP: once a request reached the new leader, no later one
        # reached another pod.
        assert len(through) == 1, through
        assert through[0]["claim_to_client"] is not None, through
        assert through[0]["other_pod"] == 0, through
        print(f"\nthrough the Service: first claim -> a request reaches the new leader "
              f"{through[0]['claim_to_client'] * 1000:.0f} ms")
    finally:
        c.helm("uninstall", RELEASE, "-n", ns, check=False)
        c.kubectl("delete", "namespace", ns, "--wait=false", check=False)
