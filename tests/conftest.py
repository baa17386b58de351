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
# sidecar's renews on SQLite, the advisory lock's termination notice): they run last. They
# and the tests in real pods (whose hand-overs are timed) wait for scripts/test's
# background jobs to end (the builds, the simulator; it names the files that say so), so
# a fresh machine's compilers and the simulator do not starve them.
QUIET_RANK = 3
WAITS_FOR_BACKGROUND = NEEDS_BUILT["pods"]
BACKGROUND_DONE_WAIT = 1800.0


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
def _after_the_background_jobs(request: pytest.FixtureRequest) -> None:
    """A ``quiet`` test, or one in real pods or of the image, waits (bounded) until
    scripts/test's background jobs have ended, successfully or not; outside scripts/test
    there is nothing to wait for."""
    done = os.environ.get("LEASE_BACKGROUND_DONE")
    node = request.node
    if done is None or not (node.get_closest_marker("quiet") is not None or any(
            NEEDS_BUILT.get(m.name, 0) >= WAITS_FOR_BACKGROUND for m in node.iter_markers())):
        return
    deadline = time.monotonic() + BACKGROUND_DONE_WAIT
    while (not all(Path(f).exists() for f in done.split(os.pathsep))
           and time.monotonic() < deadline):
        time.sleep(1.0)
