"""Shared fixtures. Test-bed plugins (real PostgreSQL, real kube-apiserver, the one-node
cluster that runs real pods) register here, and the suite's order is set here."""

import os
import time
from pathlib import Path

import pytest

pytest_plugins: list[str] = [
    "tests.testbed.pg_fixtures",
    "tests.testbed.pgbouncer_fixtures",
    "tests.testbed.kube_fixtures",
    "tests.testbed.cluster_fixtures",
]

# What scripts/test builds in the background on a fresh machine, in the order it builds
# them: the control plane's tools first, then the one-node cluster's and the image.
NEEDS_BUILT = {"kube": 1, "tools": 1, "pods": 2, "image": 2}
# Modules marked ``quiet`` judge a window that machine load can stretch (a real
# sidecar's renews on SQLite, the advisory lock's termination notice): they run last and
# wait for the background builds to end (scripts/test names the file that says so), so a
# fresh machine's compilers and disk writes do not starve them.
QUIET_RANK = 3
BUILDS_DONE_WAIT = 1800.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that need nothing built run first, then those that need the control plane
    or helm/promtool, then real pods and the image, then the ``quiet`` ones (order kept
    within each group and module): on a fresh machine scripts/test builds them in the
    background meanwhile, and a test that needs one before it is ready waits for its
    build lock. A module moves as a whole, so its module-scoped fixtures are set up
    once."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        needs = [NEEDS_BUILT[m.name] for m in item.iter_markers() if m.name in NEEDS_BUILT]
        needs += [QUIET_RANK for _ in item.iter_markers("quiet")]
        rank[module] = max([rank.get(module, 0), *needs])
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])


@pytest.fixture(autouse=True)
def _after_the_background_builds(request: pytest.FixtureRequest) -> None:
    """A ``quiet`` test waits (bounded) until scripts/test's background builds have ended,
    successfully or not; outside scripts/test there is nothing to wait for."""
    done = os.environ.get("LEASE_BACKGROUND_BUILD_DONE")
    if done is None or request.node.get_closest_marker("quiet") is None:
        return
    deadline = time.monotonic() + BUILDS_DONE_WAIT
    while not Path(done).exists() and time.monotonic() < deadline:
        time.sleep(1.0)
