"""pytest fixtures for the one-node cluster (:mod:`testkit.testbed.cluster`).

Registered in tests/conftest.py.  Fixtures:

* ``pod_cluster`` (session): one cluster for the whole run, started on first use.
* ``sidecar_image`` (session): the project's image, built (cached) and loaded into it.
* ``cluster_host_free`` (function): stops the session cluster first, for tests that start
  clusters of their own (only one runs per machine).  Tests using it are moved to the end
  of the run, so the session cluster starts at most once.

Where the host cannot run a cluster (not root, no CAP_NET_ADMIN/CAP_SYS_ADMIN, no cgroup
v1) the tests that need it are skipped with one line saying why.  Anything else that
keeps the cluster from starting (a build, a missing package, a component that exits)
FAILS them: a silently skipped suite would let CI go green without a single real pod.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from testkit.testbed import gobuild, tinyimages
from testkit.testbed.cluster import Cluster, ClusterError, unavailable_reason

_STARTED: list[Cluster] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    late = [i for i in items if "cluster_host_free" in getattr(i, "fixturenames", ())]
    if late:
        items[:] = [i for i in items if i not in late] + late


def skip_unless_possible() -> None:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def pod_cluster() -> Iterator[Cluster]:
    skip_unless_possible()
    cluster = Cluster()
    failure = ""
    try:
        cluster.start()
    except gobuild.BuildError as exc:
        failure = f"one-node cluster: building a component failed:\n{exc}"
    except (ClusterError, tinyimages.ImageError, TimeoutError) as exc:
        failure = f"one-node cluster: did not start:\n{exc}"
    if failure:
        cluster.stop()
        pytest.fail(failure, pytrace=False)
    if cluster.stale_found:
        print("one-node cluster: swept what a killed earlier run left behind:\n  "
              + "\n  ".join(cluster.stale_found), file=sys.stderr)
    _STARTED.append(cluster)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_host_free() -> None:
    skip_unless_possible()
    for cluster in _STARTED:
        cluster.stop()


@pytest.fixture(scope="session")
def sidecar_image(pod_cluster: Cluster) -> str:
    """The lease-sidecar image ref, loaded into the node (imagePullPolicy: Never)."""
    from testkit.pods_support import load_sidecar_image

    try:
        return load_sidecar_image(pod_cluster)
    except Exception as exc:  # the image bed names its own failure
        pytest.fail(f"sidecar image: could not build or load it:\n{exc}", pytrace=False)
