"""The kubernetes backend's expiry rule (client-go's skew-tolerant rule) on a fake clock.

Pure logic, no apiserver: the rule decides from what this contender observed and when,
on its own monotonic clock, so a hand-driven clock tests it without sleeping. The real
Lease round trips are covered by tests/integration/test_kubernetes_backend.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from sidecar.base.errors import ConfigError
from sidecar.lease.kubernetes import validate
from sidecar.lease.kubernetes.expiry import Observer
from sidecar.lease.kubernetes.record import Record, micro_time
from sidecar.settings import Settings, StoreSettings


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(holder: str, version: str, duration: int = 10, transitions: int = 1,
           renew_time: str | None = None) -> Record:
    return Record(holder=holder, duration=duration, transitions=transitions, version=version,
                  renew_time=renew_time)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_nothing_observed_yet_means_look_first(clock: FakeClock) -> None:
    assert Observer(clock, cap=10).free_in("me") == 0.0


def test_standby_waits_a_full_duration_from_when_it_saw_the_record(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "5", duration=10))
    clock.now += 9.9
    assert observer.free_in("me") == pytest.approx(0.1)
    clock.now += 0.1
    assert observer.free_in("me") == 0.0


def test_a_renewal_restarts_the_wait(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "5"))
    clock.now += 8
    assert observer.observe(record("other", "6"))  # the holder renewed
    clock.now += 8
    assert observer.free_in("me") == pytest.approx(2.0)


def test_seeing_the_same_record_again_does_not_restart_the_wait(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "5"))
    clock.now += 8
    assert not observer.observe(record("other", "5"))  # a dead holder's record, re-read
    clock.now += 2
    assert observer.free_in("me") == 0.0


def test_wall_clock_times_in_the_record_are_ignored(clock: FakeClock) -> None:
    """A renewTime far in the past (holder's clock behind) or future changes nothing."""
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "5", renew_time="1999-01-01T00:00:00.000000Z"))
    assert observer.free_in("me") == pytest.approx(10.0)
    observer.observe(record("other", "6", renew_time="2999-01-01T00:00:00.000000Z"))
    clock.now += 10
    assert observer.free_in("me") == 0.0


def test_the_record_duration_counts_not_ours(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "5", duration=30))
    clock.now += 15
    assert observer.free_in("me") == pytest.approx(15.0)


def test_a_released_lease_is_free_at_once(clock: FakeClock) -> None:
    """A release (holder "", duration 1) ends the term without a guard."""
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "5"))
    observer.observe(record("", "6", duration=1))
    assert observer.free_in("me") == 0.0


def test_a_missing_object_is_free_but_a_first_term_waits_one_duration(
    clock: FakeClock,
) -> None:
    """Nobody can say whether a holder of a deleted object still claims: a newcomer may
    create the object at once, but its first claim waits one (own) lease duration."""
    observer = Observer(clock, cap=10)
    observer.observe(None)
    assert observer.free_in("me") == 0.0
    assert observer.claim_delay() == pytest.approx(10.0)
    clock.now += 4
    assert observer.claim_delay() == pytest.approx(6.0)


def test_a_never_held_object_found_first_waits_like_a_missing_one(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("", "3", duration=0))
    assert observer.free_in("me") == 0.0
    assert observer.claim_delay() == pytest.approx(10.0)


def test_a_released_object_found_first_needs_no_wait(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("", "3", duration=1, renew_time="2024-01-01T00:00:00.000000Z"))
    assert (observer.free_in("me"), observer.claim_delay()) == (0.0, 0.0)


def test_our_own_record_is_ours(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("me", "5"))
    assert observer.free_in("me") == 0.0
    assert observer.free_in("other") == pytest.approx(10.0)


def test_a_lagging_watch_event_does_not_restart_the_wait(clock: FakeClock) -> None:
    """A GET already showed version 7; the watch then delivers the older version 6."""
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7"))
    clock.now += 5
    assert not observer.observe(record("other", "6"))
    assert observer.free_in("me") == pytest.approx(5.0)


def test_a_deleted_then_recreated_object_counts_as_a_change(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7"))
    assert observer.observe(None)
    clock.now += 3
    assert observer.observe(record("third", "9"))
    assert observer.free_in("me") == pytest.approx(10.0)


def test_a_held_lease_deleted_by_hand_guards_its_holders_term(clock: FakeClock) -> None:
    """Its holder may still be claiming: a term of ours may start (create the object
    again) but not claim before that holder's term, as we saw it, has run out."""
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7", duration=10))
    clock.now += 4
    observer.observe(None)
    assert observer.free_in("me") == 0.0
    assert observer.claim_delay() == pytest.approx(6.0)
    clock.now += 6
    assert observer.claim_delay() == 0.0


def test_a_released_lease_deleted_by_hand_is_free_at_once(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7"))
    observer.observe(record("", "8", duration=1))
    observer.observe(None)
    assert (observer.free_in("me"), observer.claim_delay()) == (0.0, 0.0)


# A term of "other" (duration 10) seen at 0 s, then a write to the Lease at ``edited`` s;
# at ``asked`` s: may we start a term (free_in), and how long until we may claim.
@pytest.mark.parametrize(("edit", "edited", "asked", "free_in", "claim_delay"), [
    # Cleared without the release's duration 1: not a release, the holder may claim.
    pytest.param(record("", "8", duration=10), 3, 3, 0.0, 7.0,
                 id="a holder cleared by hand is free but guarded"),
    pytest.param(record("", "8", duration=1), 3, 3, 0.0, 0.0,
                 id="a proper release needs no guard"),
    # holder -> me by a write that is not ours: we may start a term, not claim at once.
    pytest.param(record("me", "8", duration=10), 1, 1, 0.0, 9.0,
                 id="named holder by hand is ours but guarded"),
    # third's own term counts with its duration as written, but other's term still runs.
    pytest.param(record("third", "8", duration=1), 1, 2, 0.0, 8.0,
                 id="holder changed by hand to a third with duration 1"),
])
def test_a_write_by_hand_after_a_term(clock: FakeClock, edit: Record, edited: float,
                                      asked: float, free_in: float,
                                      claim_delay: float) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7", duration=10))
    clock.now += edited
    observer.observe(edit)
    clock.now += asked - edited
    assert observer.free_in("me") == free_in
    assert observer.claim_delay() == pytest.approx(claim_delay)


def test_a_duration_edited_down_does_not_shorten_the_wait(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7", duration=10))
    clock.now += 2
    observer.observe(record("other", "8", duration=1))
    clock.now += 2
    assert observer.free_in("me") == pytest.approx(8.0)


def test_named_holder_by_hand_is_ours_but_guarded(clock: FakeClock) -> None:
    """holder -> me by a write that is not ours: we may start a term, not claim at once."""
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7", duration=10))
    clock.now += 1
    observer.observe(record("me", "8", duration=10))
    assert observer.free_in("me") == 0.0
    assert observer.claim_delay() == pytest.approx(9.0)


def test_a_long_duration_by_hand_is_capped_at_our_own(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7", duration=3600))
    observer.observe(record("", "8", duration=3600))
    assert observer.claim_delay() == pytest.approx(10.0)


def test_a_free_lease_with_a_preferred_holder_waits_for_it(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7"))
    observer.observe(replace(record("", "8", duration=1), preferred_holder="pref"))
    assert observer.free_in("pref") == 0.0
    assert observer.free_in("me") == pytest.approx(10.0)


def test_opaque_versions_compare_by_difference(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "abc"))
    clock.now += 5
    assert observer.observe(record("other", "abd"))
    assert observer.free_in("me") == pytest.approx(10.0)


def test_micro_time_always_has_six_fraction_digits() -> None:
    assert micro_time(0.0) == "1970-01-01T00:00:00.000000Z"
    assert micro_time(1.5) == "1970-01-01T00:00:01.500000Z"


def test_record_round_trips_through_the_wire_format() -> None:
    obj = {"metadata": {"name": "lease-sidecar.x", "resourceVersion": "42"},
           "spec": {"holderIdentity": "pod-a", "leaseDurationSeconds": 15,
                    "leaseTransitions": 3, "acquireTime": "2024-01-01T00:00:00.000000Z",
                    "renewTime": "2024-01-01T00:00:05.000000Z"}}
    parsed = Record.from_object(obj)
    assert parsed == Record("pod-a", 15, 3, "42", "2024-01-01T00:00:00.000000Z",
                            "2024-01-01T00:00:05.000000Z")
    assert parsed.body("lease-sidecar.x")["spec"] == obj["spec"]
    assert parsed.body("lease-sidecar.x")["metadata"]["resourceVersion"] == "42"
    assert parsed.expires_at() is not None
    assert parsed.expires_at().isoformat() == "2024-01-01T00:00:20+00:00"


def test_a_fresh_object_has_no_holder_fields() -> None:
    parsed = Record.from_object({"metadata": {"resourceVersion": "1"}, "spec": {}})
    assert (parsed.holder, parsed.transitions, parsed.expires_at()) == ("", 0, None)


@pytest.mark.parametrize("name", ["default", "jobs.nightly", "a-b-c", "x9"])
def test_valid_object_names(name: str) -> None:
    validate(Settings(names=(name,)))
    assert Settings().store.key(name) == f"lease-sidecar.{name}"


@pytest.mark.parametrize("name", ["Upper", "under_score", "trailing-", "-leading", "a..b"])
def test_invalid_object_names_are_a_settings_error(name: str) -> None:
    with pytest.raises(ConfigError, match=r"LEASE_NAME / --name: .* not a valid Kubernetes"):
        validate(Settings(names=(name,)))


def test_the_key_prefix_is_part_of_the_name() -> None:
    with pytest.raises(ConfigError):
        validate(Settings(store=StoreSettings(key_prefix="My_App")))
    validate(Settings(store=StoreSettings(key_prefix="")))
    assert StoreSettings(key_prefix="").key("default") == "default"


def test_a_write_changes_only_the_five_fields_we_own() -> None:
    """Read-modify-write: labels, annotations, ownerReferences, spec fields of others and
    fields this code has never heard of go back as they came."""
    obj = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
           "metadata": {"name": "lease-sidecar.x", "namespace": "ns", "uid": "u-1",
                        "resourceVersion": "42", "labels": {"team": "a"},
                        "annotations": {"example.com/x": "1"},
                        "ownerReferences": [{"kind": "ConfigMap", "name": "o", "uid": "u-2"}],
                        "someFutureMeta": {"k": "v"}},
           "spec": {"holderIdentity": "pod-a", "leaseDurationSeconds": 15,
                    "leaseTransitions": 3, "acquireTime": "2024-01-01T00:00:00.000000Z",
                    "renewTime": "2024-01-01T00:00:05.000000Z", "preferredHolder": "pod-z",
                    "strategy": "OldestEmulationVersion", "someFutureSpec": 7},
           "someFutureTop": True}
    pristine = json.loads(json.dumps(obj))
    record = replace(Record.from_object(obj), holder="pod-b", transitions=4, duration=3,
                     acquire_time="2024-01-01T00:01:00.000000Z",
                     renew_time="2024-01-01T00:01:00.000000Z")
    body = record.body("lease-sidecar.x")
    assert obj == pristine  # the object we read is not changed in place
    assert body["spec"] == {**pristine["spec"], "holderIdentity": "pod-b",
                            "leaseDurationSeconds": 3, "leaseTransitions": 4,
                            "acquireTime": "2024-01-01T00:01:00.000000Z",
                            "renewTime": "2024-01-01T00:01:00.000000Z"}
    # The resourceVersion and the uid guard the write: a renew cannot re-create an object
    # deleted by hand (see Record.body).
    assert body["metadata"] == pristine["metadata"]
    assert body["someFutureTop"] is True


def test_a_new_object_is_written_from_scratch() -> None:
    body = Record("pod-a", 3, 0, "", "t", "t").body("lease-sidecar.x")
    assert body["metadata"] == {"name": "lease-sidecar.x"}
    assert body["spec"]["leaseTransitions"] == 0
    assert (body["apiVersion"], body["kind"]) == ("coordination.k8s.io/v1", "Lease")


def test_the_token_puts_the_creation_second_above_the_count() -> None:
    obj = {"metadata": {"resourceVersion": "1", "creationTimestamp": "2026-01-01T00:00:00Z"},
           "spec": {"leaseTransitions": 7}}
    parsed = Record.from_object(obj)
    created = 1767225600
    assert parsed.created == created
    assert parsed.token() == created * 2**20 + 7
    assert parsed.token() <= 2**53 - 1
    later = Record.from_object({**obj, "metadata": {**obj["metadata"],
                                                    "creationTimestamp": "2026-01-01T00:00:01Z"},
                                "spec": {}})
    # A re-created object's first term outranks any term of one created a second before.
    assert later.token() > parsed.token(2**20 - 1)
