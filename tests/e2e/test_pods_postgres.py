"""Real pods on the `postgres` backend (advisory lock): the database runs on the host and
pods reach it through the node's bridge address; the DSN comes from a Secret.

Run alone: python -m pytest tests/e2e/test_pods_postgres.py -m pods
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from testkit import pods_support as ps
from testkit.support import get_json
from testkit.testbed.cluster import Cluster
from testkit.testbed.postgres import PgServer

pytestmark = [pytest.mark.pods, pytest.mark.slow, pytest.mark.postgres]

RELEASE = "lspg"


@dataclass
class PgApp:
    cluster: Cluster
    namespace: str
    pg: PgServer
    database: str


def _holders(pg: PgServer, database: str) -> list[str]:
    """application_name (the sidecar's identity) of sessions holding an advisory lock."""
    out = pg.psql(
        "select a.application_name from pg_locks l join pg_stat_activity a using (pid) "
        f"where l.locktype = 'advisory' and l.granted and a.datname = '{database}'")
    return out.split()


@pytest.fixture(scope="module")
def pg_app(pod_cluster: Cluster, sidecar_image: str, pods_pg: PgServer) -> Iterator[PgApp]:
    c = pod_cluster
    ns = c.create_namespace("e2e-pg")
    database = f"e2e_{uuid.uuid4().hex[:8]}"
    pods_pg.create_database(database)
    dsn = pods_pg.dsn_for(database, host=c.node_ip)  # the bridge address, from the pod
    c.kubectl("-n", ns, "create", "secret", "generic", "lease-dsn", f"--from-literal=dsn={dsn}")
    ps.install_release(c, ns, sidecar_image, release=RELEASE, backend="postgres",
                       extra=("lease.dsnSecret.name=lease-dsn", "lease.name=e2e"))
    ps.deploy_app(c, ns, sidecar_image, "e2e")
    yield PgApp(c, ns, pods_pg, database)
    c.helm("uninstall", RELEASE, "-n", ns, check=False)
    c.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_one_leader_holds_the_lock_from_a_pod(pg_app: PgApp) -> None:
    c, ns = pg_app.cluster, pg_app.namespace
    leader = ps.wait_one_leader(c, ns)
    pods = ps.app_pods(c, ns)
    assert all(p["status"]["phase"] == "Running" for p in pods) and len(pods) == 3
    # The lock in PostgreSQL names the leader pod, and its session comes from the pod
    # network, not from the host.
    assert c.wait_for(lambda: _holders(pg_app.pg, pg_app.database) == [leader], 30,
                      "the advisory lock holder to be the leader pod")
    clients = pg_app.pg.psql(
        f"select distinct client_addr from pg_stat_activity where datname = '{pg_app.database}'"
        " and application_name <> ''").split()
    assert clients and all(a.startswith("10.244.0.") for a in clients), clients
    leader_pod = next(p for p in pods if p["metadata"]["name"] == leader)
    body = json.loads(ps.leader_file_path(c, leader_pod).read_text())
    assert body["holder"] == leader


def test_leader_pod_deletion_moves_the_lock(pg_app: PgApp) -> None:
    c, ns = pg_app.cluster, pg_app.namespace
    old = ps.wait_one_leader(c, ns)
    with ps.PodObserver(c, ns) as observer:
        c.wait_for(lambda: observer.leader_now() == old, 30, "the observer to see the leader")
        deleted_at = time.time()
        c.kubectl("-n", ns, "delete", "pod", old, "--wait=false")
        successor = c.wait_for(lambda: observer.first_claim_after(deleted_at, exclude=old),
                               60, "another pod to claim leadership")
        c.wait_for(lambda: old not in ps.roles(c, ns), 60, "the deleted pod to be gone")
        new = ps.wait_one_leader(c, ns)
        end = time.time()
    verdict = observer.verdict(deleted_at - 1, end)
    assert verdict.overlaps == []
    assert verdict.fencing == []
    assert verdict.longest_gap <= ps.GRACEFUL_GAP_BOUND, verdict.gaps
    assert successor.identity == new != old
    assert _holders(pg_app.pg, pg_app.database) == [new]
    assert ps.two_leader_labels(observer.label_history()) == []


def test_database_outage_fails_closed_without_restarts(pg_app: PgApp) -> None:
    """Probes under failure: while PostgreSQL is down nobody leads, /readyz says so,
    /healthz does not, so the kubelet neither restarts the sidecars (liveness) nor takes
    the pods out of their Services (the chart's readiness is /healthz); once the server is
    back, one pod leads again."""
    c, ns, pg = pg_app.cluster, pg_app.namespace, pg_app.pg
    ps.wait_one_leader(c, ns)
    pods = ps.app_pods(c, ns)
    ips = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
    pg.stop("immediate")
    try:
        def all_fail_closed() -> bool:
            return all(get_json(f"http://{ip}:8099/leader")[0] == 503 for ip in ips.values())

        c.wait_for(all_fail_closed, 30, "every sidecar to answer 503 on /leader")

        def none_ready() -> bool:
            return all(get_json(f"http://{ip}:8099/readyz")[0] == 503 for ip in ips.values())

        # /readyz is the last backend call's outcome: the leader's session ends at once,
        # a standby between two tries (say, standing aside for a named successor) learns
        # of the outage at its next one, within a retry interval (2 s + 20 %).
        c.wait_for(none_ready, 10, "every sidecar to answer 503 on /readyz")
        for name, ip in ips.items():
            assert get_json(f"http://{ip}:8099/healthz")[0] == 200, name
        # Longer than two readiness periods (5 s) and one liveness period (10 s).
        time.sleep(12)
        for name, ip in ips.items():
            assert get_json(f"http://{ip}:8099/leader")[0] == 503, name
        for pod in ps.app_pods(c, ns):
            ready = [x for x in pod["status"]["conditions"] if x["type"] == "Ready"]
            assert ready[0]["status"] == "True", pod["metadata"]["name"]
            sidecar = next(x for x in pod["status"]["initContainerStatuses"]
                           if x["name"] == ps.SIDECAR)
            assert sidecar["restartCount"] == 0
    finally:
        pg.start()
    leader = ps.wait_one_leader(c, ns, timeout=90)
    assert c.wait_for(lambda: _holders(pg, pg_app.database) == [leader], 30, "the lock holder")
