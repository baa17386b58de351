"""The kubernetes backend's release record (``lease-sidecar/released-term``): it counts
only on a released Lease that still counts the term it names. Pure parsing; the round
trips are in tests/integration/test_kubernetes_backend.py and the hand edits in
tests/integration/test_kubernetes_foreign_writes.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from sidecar.lease.kubernetes.record import RELEASED_ANNOTATION, Record


def lease(holder: str = "pod-a", duration: int = 3, transitions: int = 3,
          annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "lease-sidecar.jobs", "resourceVersion": "7",
                         "creationTimestamp": "2026-12-02T08:00:00Z",
                         "annotations": {"example.com/team": "payments", **(annotations or {})}},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration,
                     "leaseTransitions": transitions}}


def released_by_us() -> Record:
    """Our release: holder cleared, duration 1, the count kept, the record written."""
    held = Record.from_object(lease())
    at = "2026-12-02T08:01:00.000000Z"
    return replace(held, holder="", duration=1, acquire_time=at,
                   renew_time=at).recording_release(True)


def test_our_release_records_its_term_and_the_next_acquire_finds_it() -> None:
    record = released_by_us()
    body = record.body("lease-sidecar.jobs")
    assert body["metadata"]["annotations"][RELEASED_ANNOTATION] == record.term_id()
    assert body["metadata"]["annotations"]["example.com/team"] == "payments"
    assert Record.from_object(body).claims_ended


def test_an_acquire_removes_the_record_and_keeps_other_annotations() -> None:
    taken = released_by_us().recording_release(False)
    annotations = taken.body("lease-sidecar.jobs")["metadata"]["annotations"]
    assert RELEASED_ANNOTATION not in annotations and "example.com/team" in annotations
    assert not Record.from_object(taken.body("lease-sidecar.jobs")).claims_ended


@pytest.mark.parametrize(("edit", "why"), [
    ({"holder": "pod-b", "duration": 3}, "a term of client-go, which keeps metadata"),
    ({"transitions": 4}, "a later term released, or cleared by hand"),
    ({"duration": 3}, "holder cleared by hand: no release"),
])
def test_a_record_of_another_term_or_state_does_not_count(edit: dict[str, Any],
                                                          why: str) -> None:
    record = released_by_us()
    stale = lease(**{"holder": "", "duration": 1, "transitions": 3, **edit},
                  annotations={RELEASED_ANNOTATION: record.term_id()})
    stale["spec"].update(acquireTime=record.acquire_time, renewTime=record.renew_time)
    assert not Record.from_object(stale).claims_ended, why
