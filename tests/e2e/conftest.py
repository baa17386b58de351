"""Fixtures of the end-to-end tests on real pods (the one-node cluster)."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from testkit.testbed import gobuild
from testkit.testbed.cluster import Cluster
from testkit.testbed.postgres import PgServer
from tests.testbed.pg_fixtures import serve


@dataclass
class LogFollower:
    """``kubectl logs -f`` of one container, each line with the time it arrived."""

    cluster: Cluster
    namespace: str
    pod: str
    container: str
    lines: list[tuple[float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._proc = subprocess.Popen(
            [str(gobuild.ensure_binary("kubectl")), f"--kubeconfig={self.cluster.kubeconfig}",
             "-n", self.namespace, "logs", "-f", self.pod, "-c", self.container],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait_done(self, timeout: float) -> None:
        """Until the container has exited (the stream ends), at most ``timeout``."""
        self._thread.join(timeout)
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)


@pytest.fixture
def follow_logs(pod_cluster: Cluster) -> Iterator[Callable[[str, str, str], LogFollower]]:
    """``follow_logs(namespace, pod, container)``; every follower is ended after the test."""
    made: list[LogFollower] = []

    def follow(namespace: str, pod: str, container: str) -> LogFollower:
        made.append(LogFollower(pod_cluster, namespace, pod, container))
        return made[-1]

    yield follow
    for follower in made:
        follower.wait_done(0)


@pytest.fixture(scope="session")
def pods_pg(pod_cluster: Cluster) -> Iterator[PgServer]:
    """A PostgreSQL on the host that pods reach at the node IP (the bridge address)."""
    yield from serve(PgServer(extra_listen=[pod_cluster.node_ip],
                              client_networks=[pod_cluster.pod_cidr]), "postgres for pods")
