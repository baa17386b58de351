"""The kubernetes backend's next-holder hint where the apiserver drops
``spec.preferredHolder`` (its CoordinatedLeaderElection gate off, the default): the hint
annotations, counting while the Lease's ``renewTime`` is not past their bound. Pure
parsing; the round trips are in tests/integration/test_handover_kubernetes.py."""

from __future__ import annotations

from typing import Any

from sidecar.lease.kubernetes.lease import preferring
from sidecar.lease.kubernetes.record import (
    HINT_ANNOTATION,
    HINT_UNTIL_ANNOTATION,
    Record,
    micro_time,
)

T = 1_796_000_000.0


def lease(renewed: float, annotations: dict[str, str] | None = None,
          preferred: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"holderIdentity": "", "leaseDurationSeconds": 1,
                            "leaseTransitions": 3, "renewTime": micro_time(renewed)}
    if preferred is not None:
        spec["preferredHolder"] = preferred
    return {"metadata": {"name": "lease-sidecar.jobs", "resourceVersion": "7",
                         "annotations": annotations or {}}, "spec": spec}


def hint(holder: str, until: float) -> dict[str, str]:
    return {HINT_ANNOTATION: holder, HINT_UNTIL_ANNOTATION: micro_time(until)}


def test_a_hint_counts_while_the_release_is_within_its_bound() -> None:
    assert Record.from_object(lease(T + 0.4, hint("pod-c", T + 15))).preferred_holder == "pod-c"


def test_a_hint_left_behind_goes_stale_with_a_later_renew() -> None:
    # A later holder renewed (or released) after the bound: the hint is history.
    assert Record.from_object(lease(T + 15.1, hint("pod-c", T + 15))).preferred_holder == ""


def test_the_spec_field_wins_where_the_apiserver_keeps_it() -> None:
    obj = lease(T, hint("pod-c", T + 15), preferred="pod-b")
    assert Record.from_object(obj).preferred_holder == "pod-b"


def test_a_hand_edited_hint_is_no_hint() -> None:
    bad = {HINT_ANNOTATION: "pod-c", HINT_UNTIL_ANNOTATION: "tomorrow"}
    assert Record.from_object(lease(T, bad)).preferred_holder == ""
    assert Record.from_object(lease(T, {HINT_ANNOTATION: "pod-c"})).preferred_holder == ""


def test_preferring_writes_and_clears_both_and_keeps_other_annotations() -> None:
    mine = {"example.com/contact": "oncall"}
    record = Record.from_object(lease(T, dict(mine)))
    named = preferring(record, "pod-c", micro_time(T + 15))
    assert named.source["spec"]["preferredHolder"] == "pod-c"
    assert named.source["metadata"]["annotations"] == {**mine, **hint("pod-c", T + 15)}
    # As the apiserver without the gate returns it: the field gone, the hint kept.
    dropped = named.source
    dropped["spec"].pop("preferredHolder")
    assert Record.from_object(dropped).preferred_holder == "pod-c"
    cleared = preferring(Record.from_object(dropped), "")
    assert cleared.source["metadata"]["annotations"] == mine
    assert cleared.preferred_holder == ""
