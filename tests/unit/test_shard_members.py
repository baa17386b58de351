"""Member records read back: a Kubernetes member Lease counts while its resourceVersion
changed within one lease duration on the reader's own clock; an advisory session's
name is read back as the member's identity."""

from __future__ import annotations

from typing import Any

from sidecar.lease.kubernetes.group import KubeShardGroup
from sidecar.lease.postgres_advisory.group import group_tag, holder_name, member_name
from sidecar.settings import Settings, Timing
from tests.unit.fakes import FakeClock


def record(name: str, holder: str, version: str, duration: int = 15) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration}}


async def test_a_member_lease_counts_while_it_changes_on_our_clock() -> None:
    clock = FakeClock()
    settings = Settings(identity="me", timing=Timing())
    group = KubeShardGroup(None, None, settings, clock, "lease-sidecar.work")  # type: ignore[arg-type]  # no call reaches them
    items = [record("a", "pod-a", "10"), record("b", "pod-b", "20")]
    assert group._live(items, advertise=True) == ("me", "pod-a", "pod-b")
    clock.advance(14.0)
    items = [record("a", "pod-a", "11"), record("b", "pod-b", "20")]  # b stopped renewing
    assert group._live(items, advertise=True) == ("me", "pod-a", "pod-b")
    clock.advance(1.5)  # b unchanged for 15.5 s of our clock: gone; a changed 1.5 s ago
    assert group._live(items, advertise=False) == ("pod-a",)
    # A record with no holder (a member that left) never counts.
    assert group._live([record("a", "", "12")], advertise=False) == ()


def test_an_advisory_sessions_name_reads_back_as_the_member() -> None:
    tag = group_tag("lease-sidecar.work")
    assert tag.startswith("lease-shards ") and len(tag) == len("lease-shards ") + 9
    assert holder_name(tag + "pod-a") == "pod-a"
    assert holder_name("pod-b") == "pod-b"  # a lease's own session: its identity
    # An identity longer than application_name allows is cut the same way everywhere.
    long = "x" * 80
    assert member_name("lease-sidecar.work", long) == "x" * (63 - len(tag))
