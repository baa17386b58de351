"""The operator's label decisions (sidecar.operator.labels), without an apiserver; the
reconciler against a real one: tests/integration/test_operator.py."""

from __future__ import annotations

import json
from typing import Any

from sidecar.operator.labels import LeaseTruth, PodView, desired_labels, needs_lease

GROUP = "lease-sidecar.jobs"


def pod(name: str, label: str | None, role: str, token: int | None = None,
        backend: str = "postgres", group: str | None = GROUP) -> PodView:
    labels = {k: v for k, v in (("lease-role", label), ("lease-sidecar/group", group)) if v}
    note = {"lease": "jobs", "identity": name, "role": role, "fencing_token": token,
            "object": GROUP, "backend": backend}
    view = PodView.of({"metadata": {"name": name, "namespace": "ns", "resourceVersion": "1",
                                    "labels": labels,
                                    "annotations": {"lease-sidecar/lease": json.dumps(note)}}})
    assert view is not None
    return view


def test_a_pod_without_the_annotation_is_not_ours() -> None:
    bare: dict[str, Any] = {"metadata": {"name": "x", "labels": {"lease-role": "leader"}}}
    assert PodView.of(bare) is None
    bare["metadata"]["annotations"] = {"lease-sidecar/lease": "{not json"}
    assert PodView.of(bare) is None


def test_database_backends_keep_the_highest_token() -> None:
    pods = [pod("a", "leader", "leader", 4), pod("b", "leader", "leader", 5),
            pod("c", "standby", "standby"), pod("d", "api", "api")]
    assert desired_labels(pods, None, 0.0) == {"a": {"lease-role": "standby"}}


def test_edited_labels_are_put_back_by_the_annotation() -> None:
    pods = [pod("a", "standby", "leader", 5), pod("b", "leader", "standby"),
            pod("c", None, "standby", group=None), pod("d", "standby", "api", group="other")]
    assert desired_labels(pods, None, 0.0) == {
        "a": {"lease-role": "leader"}, "b": {"lease-role": "standby"},
        "c": {"lease-role": "standby", "lease-sidecar/group": GROUP},
        "d": {"lease-role": "api", "lease-sidecar/group": GROUP}}


def test_the_lease_object_decides_on_the_kubernetes_backend() -> None:
    pods = [pod("a", "leader", "leader", 9, "kubernetes"),
            pod("b", "leader", "leader", 3, "kubernetes")]
    assert needs_lease(pods)
    lease = LeaseTruth.of({"spec": {"holderIdentity": "b", "leaseDurationSeconds": 15,
                                    "renewTime": "2026-01-01T00:00:00.000000Z"}})
    at = lease.expires - 1  # type: ignore[operator]  # this lease has a renewTime
    # Not the highest token: the Lease names b.
    assert desired_labels(pods, lease, at) == {"a": {"lease-role": "standby"}}
    # Expired, nobody renews it: nobody leads.
    assert desired_labels(pods, lease, at + 2) == {"a": {"lease-role": "standby"},
                                                    "b": {"lease-role": "standby"}}
    assert desired_labels(pods, LeaseTruth.of(None), at) == {
        "a": {"lease-role": "standby"}, "b": {"lease-role": "standby"}}
