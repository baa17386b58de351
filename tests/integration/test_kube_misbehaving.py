"""Real sidecar processes against a misbehaving apiserver (testkit/fake_apiserver.py, a
real HTTP server on loopback): one that closes every watch at once, one whose watches
stall, and a pod object of more than a MiB. The client's own behaviour in detail:
tests/unit/test_kube_client_faults.py."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.fake_apiserver import LEASES, FakeApiserver
from testkit.kube_support import FAST
from testkit.support import SidecarProcess, get_json, one_leader, serving, wait_until

NS = "team"


@pytest.fixture
def fake() -> Iterator[FakeApiserver]:
    with FakeApiserver() as server:
        yield server


def on_kubernetes(fake: FakeApiserver, tmp_path: Path, name: str,
                  *timing: str) -> SidecarProcess:
    kubeconfig = fake.kubeconfig(tmp_path / f"kc-{name}.json", NS)
    return SidecarProcess(tmp_path, name, args=[
        "--backend", "kubernetes", "--name", "jobs", "--pod-label", "off",
        *(timing or FAST)], env={"KUBECONFIG": str(kubeconfig)})


def test_an_instantly_closing_server_gets_at_most_a_few_watches_a_second(fake, tmp_path):
    """Every watch ended at once used to be re-opened at once: 10,366 requests in 2 s."""
    fake.close_watches = True
    proc = on_kubernetes(fake, tmp_path, "a")
    with serving([proc]):
        wait_until(lambda: proc.leader() == 200, timeout=10)  # calls work, watches do not
        since = time.monotonic()
        time.sleep(5.0)
        watches = fake.watches(since)
        assert len(watches) <= 10, f"{len(watches)} watch requests in 5 s"
        # The lease is held all along: the holder's renews are its only other requests.
        assert proc.leader() == 200
        assert {r.method for r in fake.calls(since)} == {"PUT"}


def test_a_standby_whose_watch_stalled_takes_a_release_within_two_renew_intervals(
        fake, tmp_path):
    """A watch that delivers nothing looks idle: the standby kept believing the holder
    it last saw, and took over only when that lease ran out (10 s here)."""
    timing = ("--lease-duration", "10s", "--renew-interval", "500ms")
    procs = [on_kubernetes(fake, tmp_path, name, *timing) for name in ("a", "b")]
    with serving(procs):
        leader = wait_until(lambda: one_leader(procs), timeout=15)
        standby = procs[1 - procs.index(leader)]
        time.sleep(1.0)  # both watches open and current
        fake.stall_watches = True
        time.sleep(0.2)
        released = time.monotonic()
        leader.signal(signal.SIGTERM)
        wait_until(lambda: standby.leader() == 200, timeout=12, interval=0.02)
        took = time.monotonic() - released
        # Quiet for two renew intervals (1 s) + the look's grace (0.5 s), then the
        # standby reads the Lease at its next retry (0.5 s) and waits one claim horizon.
        assert took < 3.5, took
        looks = [r for r in fake.calls(released, "GET")
                 if "PartialObjectMetadata" in r.headers.get("accept", "")]
        assert looks, "the standby never looked at the Lease"


def test_a_pod_of_more_than_a_mebibyte_is_read(fake, tmp_path):
    """aiohttp's line reader refused a watch line over its buffer (``LineTooLong``), so
    a big pod's readiness was never seen and its sidecar never campaigned."""
    fake.put_pod(NS, "pod-a", ready=True, padding=1_500_000)
    kubeconfig = fake.kubeconfig(tmp_path / "kc.json", NS)
    proc = SidecarProcess(tmp_path, "pod-a", args=[
        "--dsn", str(tmp_path / "leases.db"), "--name", "jobs", *FAST, "--pod-label", "off",
        "--app-ready-containers", "app", "--app-unready-after", "1s"],
        env={"POD_NAME": "pod-a", "POD_NAMESPACE": NS, "KUBECONFIG": str(kubeconfig)})
    with serving([proc]):
        wait_until(lambda: proc.leader() == 200, timeout=10)
        fake.put_pod(NS, "pod-a", ready=False, padding=1_500_000)
        wait_until(lambda: proc.leader() == 503, timeout=5)  # handed over (app-unready)
        wait_until(lambda: "container app is not Ready" in get_json(
            proc.url + "/status")[1]["leases"][0]["reason"], timeout=5)


def test_the_fake_serves_the_lease_a_sidecar_writes(fake, tmp_path):
    """The fake is good enough to hold a lease on: a check of the harness itself."""
    proc = on_kubernetes(fake, tmp_path, "a")
    with serving([proc]):
        wait_until(lambda: proc.leader() == 200, timeout=10)
        spec = fake.get(LEASES.format(ns=NS) + "/lease-sidecar.jobs")["spec"]
        assert spec["holderIdentity"] == "a"
