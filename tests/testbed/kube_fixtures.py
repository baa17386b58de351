"""pytest fixtures for the real Kubernetes control plane (etcd + kube-apiserver).

Load with ``pytest_plugins = ["tests.testbed.kube_fixtures"]`` in tests/conftest.py or
``-p tests.testbed.kube_fixtures`` on the command line.

If the tools cannot be built (no Go, no module proxy, compile error) or the control plane
does not start, the fixture FAILS instead of skipping: a silently skipped suite would let
CI go green without ever touching a real apiserver.

To add kube-apiserver flags (admission webhooks, feature gates), override the
``kube_apiserver_extra_args`` fixture in a conftest.py::

    @pytest.fixture(scope="session")
    def kube_apiserver_extra_args() -> list[str]:
        return ["--feature-gates=SomeGate=true"]
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.testbed import gobuild
from testkit.testbed.kube import COORDINATED_LEADER_ELECTION, ControlPlane, ControlPlaneError


@pytest.fixture(scope="session")
def kube_apiserver_extra_args() -> list[str]:
    """Extra kube-apiserver flags; override in a conftest to change the control plane."""
    return []


def running(cp: ControlPlane, what: str) -> Iterator[ControlPlane]:
    """Start ``cp``, yield it, stop it; a start that fails FAILS the test, naming ``what``."""
    failure = ""
    try:
        cp.start()
    except gobuild.BuildError as exc:
        failure = (
            f"{what}: building the tools failed (fix the build or prebuild with "
            f"scripts/build-testbed-tools; cache: {gobuild.cache_root()}):\n{exc}"
        )
    except ControlPlaneError as exc:
        failure = f"{what}: control plane did not start:\n{exc}"
    if failure:
        # Outside the except block, so the report shows the message, not a chained trace.
        cp.stop()
        pytest.fail(failure, pytrace=False)
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(scope="session")
def control_plane(kube_apiserver_extra_args: list[str]) -> Iterator[ControlPlane]:
    """One control plane for the whole session (startup costs several seconds)."""
    yield from running(ControlPlane(apiserver_extra_args=kube_apiserver_extra_args),
                       "kube test bed")


@pytest.fixture(scope="module")
def coordinated_control_plane() -> Iterator[ControlPlane]:
    """A control plane of its own with CoordinatedLeaderElection on, for the tests of
    ``spec.preferredHolder`` (see :data:`COORDINATED_LEADER_ELECTION`)."""
    yield from running(ControlPlane(apiserver_extra_args=COORDINATED_LEADER_ELECTION),
                       "kube test bed with CoordinatedLeaderElection")


@pytest.fixture(scope="session")
def clientgo_elector() -> Path:
    """The client-go leader-election binary (testkit/clientgo), built once."""
    try:
        return gobuild.ensure_binary("clientgo-elector")
    except gobuild.BuildError as exc:
        pytest.fail(f"clientgo-elector could not be built: {exc}", pytrace=False)


@pytest.fixture
def kube_namespace(control_plane: ControlPlane) -> str:
    """A fresh namespace (with a ``default`` ServiceAccount) for one test.

    Not deleted afterwards: without a namespace controller it would only hang in
    Terminating; the whole etcd is thrown away at the end of the session.
    """
    return control_plane.create_namespace()
