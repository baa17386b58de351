"""Shared fixtures. Test-bed plugins (real PostgreSQL, real kube-apiserver, the one-node
cluster that runs real pods) register here, and the suite's order is set here."""

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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that need nothing built run first, then those that need the control plane
    or helm/promtool, then real pods and the image (order kept within each group and
    module): on a fresh machine scripts/test builds them in the background meanwhile, and
    a test that needs one before it is ready waits for its build lock. A module moves as a
    whole, so its module-scoped fixtures are set up once."""
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        needs = [NEEDS_BUILT[m.name] for m in item.iter_markers() if m.name in NEEDS_BUILT]
        rank[module] = max([rank.get(module, 0), *needs])
    items.sort(key=lambda item: rank[item.nodeid.split("::", 1)[0]])
