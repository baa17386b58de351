"""The kubernetes backend's expiry rule (client-go's skew-tolerant rule) on a fake clock.

Pure logic, no apiserver: the rule decides from what this contender observed and when,
on its own monotonic clock, so a hand-driven clock tests it without sleeping. The real
Lease round trips are covered by tests/integration/test_kubernetes_backend.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from sidecar.base.errors import ConfigError
from sidecar.lease.kubernetes import validate
from sidecar.lease.kubernetes.expiry import Observer
from sidecar.lease.kubernetes.record import (
    OLD_LAYOUT_LIMIT,
    Record,
    fencing_token,
    micro_time,
    next_count,
)
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


# When the terms of these tests last renewed: before any release below.
RENEWED = "2023-12-31T23:59:50.000000Z"


def released(version: str, recorded: bool = False) -> Record:
    """A release as client-go's and ours write it: no holder, duration 1, acquireTime =
    renewTime = the release time; ``recorded``: with our release record (its term)."""
    at = "2024-01-01T00:00:00.000000Z"
    found = Record(holder="", duration=1, transitions=1, version=version, acquire_time=at,
                   renew_time=at)
    return replace(found, released_term=found.term_id()) if recorded else found


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
    observer.observe(released("6"))
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
    observer.observe(released("3", recorded=True))
    assert (observer.free_in("me"), observer.claim_delay()) == (0.0, 0.0)


def test_a_release_found_first_without_our_record_is_waited_out(clock: FakeClock) -> None:
    """client-go's release, or a hand edit that looks like one (the holder cleared and
    the duration set to 1 on a term never renewed: its two times are equal, as a
    release's are): found first, nothing tells when it was written, and its holder may
    be claiming still (found by the simulator: a sidecar started after such an edit led
    beside the holder). It may be taken; the first claim waits a lease duration."""
    observer = Observer(clock, cap=10)
    observer.observe(released("3"))
    assert (observer.free_in("me"), observer.claim_delay()) == (0.0, 10.0)


def test_a_record_naming_us_that_we_did_not_write_is_waited_out_like_anyones(
        clock: FakeClock) -> None:
    """A first look that finds our own identity as holder (our process restarted, a
    StatefulSet pod's name on a second pod, a hand edit) finds another process's term:
    it may still be claiming, with any duration a person set. We wait for it to run out
    as every standby does (taking it over at once made the standbys wait for our new
    term as well), and a term we then take may claim at once."""
    observer = Observer(clock, cap=10)
    observer.observe(record("me", "5", duration=1))
    assert observer.free_in("me") == pytest.approx(10.0)
    assert observer.free_in("other") == pytest.approx(10.0)
    clock.now += 10
    assert observer.free_in("me") == 0.0
    observer.observe(record("me", "6", duration=10), took_over=True)
    assert observer.claim_delay() == 0.0


def test_a_term_naming_us_renewed_by_a_twin_is_still_waited_out(clock: FakeClock) -> None:
    """The record found first keeps being renewed under our name (a StatefulSet pod's
    twin still runs): we keep waiting, as for any live holder."""
    observer = Observer(clock, cap=10)
    observer.observe(record("me", "5", duration=10))
    clock.now += 5
    observer.observe(record("me", "6", duration=10))
    assert observer.free_in("me") == pytest.approx(10.0)


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
    again) but not claim before that holder's term has run out, counted from the
    deletion (its last renewal came before it)."""
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7", duration=10))
    clock.now += 4
    observer.observe(None)
    assert observer.free_in("me") == 0.0
    assert observer.claim_delay() == pytest.approx(10.0)
    clock.now += 10
    assert observer.claim_delay() == 0.0


def test_a_stale_view_counts_the_guard_from_the_edit_it_shows(clock: FakeClock) -> None:
    """A standby whose watch stalled (or was down, or in a re-list) saw the holder's
    record change last at 0 s; the holder went on renewing unseen, until a person cleared
    it at 60 s. That holder may claim for one duration after its last renewal, which came
    before the clear: the guard runs from the clear. The old rule counted from 0 s, so
    the guard lay in the past and the standby claimed beside the holder."""
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7", duration=10))
    clock.now += 60
    observer.observe(record("", "90", duration=10))
    assert observer.free_in("me") == 0.0
    assert observer.claim_delay() == pytest.approx(10.0)


def test_an_object_recreated_with_an_empty_spec_is_no_release(clock: FakeClock) -> None:
    """A tool deleted the held Lease and created it again with an empty spec, and the
    watch showed only the new object: no holder and no duration is not a release (the
    old rule read duration 0 as one), and a new uid ends the term it replaced."""
    observer = Observer(clock, cap=10)
    observer.observe(replace(record("other", "7", duration=10), uid="a"))
    clock.now += 3
    observer.observe(replace(record("", "9", duration=0), uid="b"))
    assert observer.free_in("me") == 0.0
    assert observer.claim_delay() == pytest.approx(10.0)


def test_a_first_look_assumes_the_longest_duration_of_ours(clock: FakeClock) -> None:
    """Someone set leaseDurationSeconds to 1 just before this sidecar started: the holder
    may still claim for its own duration, which a first look cannot know; it waits our
    lease duration at least. The old rule took the lease over 1 s later."""
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7", duration=1))
    clock.now += 2
    assert observer.free_in("me") == pytest.approx(8.0)


def test_an_hour_by_hand_stalls_only_until_written_back(clock: FakeClock) -> None:
    """A person set the duration of a holder that is gone to an hour; once somebody
    writes it back, the group waits no more than its own lease duration."""
    observer = Observer(clock, cap=10)
    observer.observe(record("gone", "7", duration=10))
    observer.observe(record("gone", "8", duration=3600))
    assert observer.free_in("me") == pytest.approx(3600.0)
    clock.now += 100
    observer.observe(record("gone", "9", duration=10))
    assert observer.free_in("me") == pytest.approx(10.0)


def test_a_released_lease_deleted_by_hand_is_free_at_once(clock: FakeClock) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7", renew_time=RENEWED))
    observer.observe(released("8"))
    observer.observe(None)
    assert (observer.free_in("me"), observer.claim_delay()) == (0.0, 0.0)


# A term of "other" (duration 10) seen at 0 s, then a write to the Lease at ``edited`` s;
# at ``asked`` s: may we start a term (free_in), and how long until we may claim.
@pytest.mark.parametrize(("edit", "edited", "asked", "free_in", "claim_delay"), [
    # Cleared without the release's duration 1: not a release, the holder may claim
    # for a duration after the clear.
    pytest.param(record("", "8", duration=10), 3, 3, 0.0, 10.0,
                 id="a holder cleared by hand is free but guarded"),
    pytest.param(released("8"), 3, 3, 0.0, 0.0, id="a proper release needs no guard"),
    # Cleared and duration 1 on a term never renewed: both times are the acquisition's,
    # equal as a release's are, but no later than the term's renewal.
    pytest.param(Record(holder="", duration=1, transitions=1, version="8",
                        acquire_time=RENEWED, renew_time=RENEWED),
                 3, 3, 0.0, 10.0, id="a release by hand on a term never renewed is none"),
    # Cleared and duration 1 by a patch (the times left as the holder wrote them): looks
    # like a release to the old rule, but the holder may not have heard of it.
    pytest.param(record("", "8", duration=1, renew_time="2024-01-01T00:00:09.000000Z"),
                 3, 3, 0.0, 10.0, id="a release by hand is no release"),
    # holder -> me by a write that is not ours: we may start a term, not claim before
    # other's term can have run out, counted from the write.
    pytest.param(record("me", "8", duration=10), 1, 1, 0.0, 10.0,
                 id="named holder by hand is ours but guarded"),
    # third's own term counts with its duration as written, but other's term still runs.
    pytest.param(record("third", "8", duration=1), 1, 2, 0.0, 9.0,
                 id="holder changed by hand to a third with duration 1"),
])
def test_a_write_by_hand_after_a_term(clock: FakeClock, edit: Record, edited: float,
                                      asked: float, free_in: float,
                                      claim_delay: float) -> None:
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7", duration=10, renew_time=RENEWED))
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


def test_a_sidecars_hint_counts_only_as_long_as_its_bound(clock: FakeClock) -> None:
    """A hand-over hint names a standby that never comes (a typo, outside a pod where the
    target cannot be checked): the others defer to it for the hint's own bound, not a
    whole lease duration."""
    obj = {"metadata": {"name": "lease-sidecar.x", "resourceVersion": "8", "uid": "u",
                        "annotations": {"lease-sidecar/preferred-holder": "pdo-b",
                                        "lease-sidecar/preferred-until":
                                            "2026-12-01T10:00:03.000000Z"}},
           "spec": {"holderIdentity": "", "leaseDurationSeconds": 1,
                    "acquireTime": "2026-12-01T10:00:00.500000Z",
                    "renewTime": "2026-12-01T10:00:00.500000Z"}}
    observer = Observer(clock, cap=10)
    observer.observe(record("other", "7"))
    observer.observe(Record.from_object(obj))
    assert observer.free_in("me") == pytest.approx(2.5)
    assert observer.free_in("pdo-b") == 0.0


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
    body = Record("pod-a", 3, next_count(-1), "", "t", "t").body("lease-sidecar.x")
    assert body["metadata"] == {"name": "lease-sidecar.x"}
    assert body["spec"]["leaseTransitions"] == OLD_LAYOUT_LIMIT
    assert (body["apiVersion"], body["kind"]) == ("coordination.k8s.io/v1", "Lease")


def test_the_token_is_the_acquiring_writes_resource_version_above_2_52() -> None:
    """etcd's revision grows with every write in the cluster and nobody can set it: a
    count edited down by hand, a manifest applied again or the object re-created cannot
    make a later term's token smaller. The old token (creation second above the count)
    went down with a count edited down."""
    assert fencing_token("1234") == 2**52 + 1234
    assert fencing_token("1235") > fencing_token("1234")  # type: ignore[operator]  # ints here
    # Above every token of the earlier layout until 2106, and JSON-safe.
    assert fencing_token("1") > (2**32 - 1) * 2**20 + 2**20 - 1  # type: ignore[operator]  # int
    assert fencing_token(str(2**52 - 1)) == 2**53 - 1
    assert fencing_token(str(2**52)) is None
    assert fencing_token("opaque-version") is None


def test_the_count_stays_past_the_earlier_layouts_limit() -> None:
    """Sidecars of the earlier token layout refuse to lead at 2**20 terms: writing the
    count at least that high keeps them from leading, with a smaller token, after a newer
    sidecar during a rolling upgrade."""
    assert next_count(-1) == next_count(0) == next_count(7) == OLD_LAYOUT_LIMIT
    assert next_count(OLD_LAYOUT_LIMIT + 5) == OLD_LAYOUT_LIMIT + 6
    assert next_count(2**31 - 1) == OLD_LAYOUT_LIMIT  # starts over before int32 ends


# Values a person can write (the apiserver accepts them; most of them are annotations,
# whose values may be any string).
@pytest.mark.parametrize(("where", "key", "value"), [
    ("annotations", "lease-sidecar/preferred-until", "2026-12-01T10:00:00"),  # no zone
    ("annotations", "lease-sidecar/preferred-until", "garbage"),
    ("annotations", "lease-sidecar/preferred-until", ""),
    ("annotations", "lease-sidecar/released-term", "not-a-term"),
    ("annotations", "lease-sidecar/fencing-token", "-1"),
    ("annotations", "lease-sidecar/fencing-token", "9" * 40),
    ("spec", "leaseDurationSeconds", "15"),
    ("spec", "leaseTransitions", -3),
    ("spec", "holderIdentity", 7),
    ("spec", "renewTime", "yesterday"),
    ("metadata", "creationTimestamp", "not a time"),
    ("metadata", "annotations", ["not", "a", "map"]),
])
def test_any_value_a_person_writes_is_read_without_an_error(where: str, key: str,
                                                            value: object) -> None:
    """One hand-written annotation raised TypeError on every read of the Lease (a
    preferred-until without a zone compared with the aware renewTime): every renew that
    committed counted as failed, every acquire as 'backend unreachable', and the watch
    task died. Now each value that does not fit is ignored with one log line."""
    obj: dict[str, Any] = {
        "metadata": {"name": "lease-sidecar.x", "resourceVersion": "9", "uid": "u",
                     "creationTimestamp": "2026-12-01T09:00:00Z",
                     "annotations": {"lease-sidecar/preferred-holder": "pod-b"}},
        "spec": {"holderIdentity": "pod-a", "leaseDurationSeconds": 15,
                 "leaseTransitions": 3, "renewTime": "2026-12-01T10:00:00.000000Z"}}
    if where == "metadata":
        obj["metadata"][key] = value
    else:
        target = obj["spec"] if where == "spec" else obj["metadata"]["annotations"]
        target[key] = value
    parsed = Record.from_object(obj)
    assert parsed.version == "9"
    parsed.expires_at()
    parsed.body("lease-sidecar.x")
    Observer(FakeClock(), cap=10).observe(parsed)
