"""The pod Events' bookkeeping: which transition becomes which Event, and when a series
is written. What the apiserver makes of them is tested against a real one in
tests/integration/test_events.py; here the elector is the real one on the in-memory
lease of tests/unit/fakes.py, and the aggregator is driven with explicit times, since
its intervals (30 s, 10 min) are too long to wait out in a test.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from sidecar.elector import Elector
from sidecar.publish.events import (
    MAX_TRIES,
    MIN_WRITE_INTERVAL,
    QUEUE_SIZE,
    WINDOW,
    Aggregator,
    EventPublisher,
    Occurrence,
)
from sidecar.settings import Settings, Timing
from sidecar.state import LeaseState
from tests.unit.fakes import FakeClock, FakeLease

SETTINGS = Settings(timing=Timing(lease_duration=1.0, renew_interval=0.01, renew_deadline=0.5,
                                  safety_margin=0.1, claim_horizon=0.05), identity="web-0",
                    pod_name="web-0", pod_namespace="apps")


def occurrence(reason: str = "LeaderElected", note: str = "n", uid: str = "") -> Occurrence:
    regarding = {"name": "other", "uid": uid} if uid else None
    return Occurrence(reason, "Normal", "Acquire", "jobs", note, 0.0, regarding=regarding)


def queued(publisher: EventPublisher) -> list[Occurrence]:
    found = []
    with pytest.raises(asyncio.QueueEmpty):
        while True:
            item = publisher._queue.get_nowait()
            assert item is not None
            found.append(item)
    return found


async def test_each_step_down_of_the_real_elector_becomes_its_event():
    clock = FakeClock()
    lease = FakeLease(clock, valid_for=10.0, token=7)
    state = LeaseState(lease="jobs", identity="web-0", role="all",
                       claim_horizon=SETTINGS.timing.claim_horizon, clock=clock)
    elector = Elector(lease, state, SETTINGS.timing, SETTINGS.identity)
    publisher = EventPublisher(SETTINGS, [state])

    def step(token: int) -> None:
        lease.token = token
        publisher._catch_up(0, state)

    await elector._acquire_once()
    elector.request_release()
    await elector._renew_once()  # POST /release
    step(8)
    await elector._acquire_once()
    lease.fail = True
    clock.advance(11.0)
    await elector._renew_once()  # no renew succeeded within the validity
    step(9)
    lease.fail = False
    await elector._acquire_once()
    lease.grant = False
    await elector._renew_once()  # refused: someone else holds it
    step(10)
    lease.grant = True
    await elector._acquire_once()
    await elector.shutdown()  # SIGTERM
    step(11)

    got = [(o.reason, o.type, o.note) for o in queued(publisher)]
    assert got == [
        ("LeaderElected", "Normal", "acquired lease jobs, fencing token 7"),
        ("LeaseReleased", "Normal", "released lease jobs, fencing token 7: released on request"),
        ("LeaderElected", "Normal", "acquired lease jobs, fencing token 8"),
        ("LeaseReleased", "Warning", "released lease jobs, fencing token 8: "
                                     "lease validity ran out before a renew succeeded"),
        ("LeaderElected", "Normal", "acquired lease jobs, fencing token 9"),
        ("LeaseLost", "Warning",
         "lost lease jobs, fencing token 9: lost lease: held by someone-else"),
        ("LeaderElected", "Normal", "acquired lease jobs, fencing token 10"),
        ("LeaseReleased", "Normal", "released lease jobs, fencing token 10: shutdown"),
    ]
    # Only leadership is reported: an api-role state change is not.
    state.update("api role", reason="role api never contends")
    publisher._catch_up(0, state)
    assert queued(publisher) == []


def test_a_demoted_pod_is_the_regarding_object_and_we_are_related():
    state = LeaseState(lease="jobs", identity="web-0", role="all", claim_horizon=0.05)
    state.update(holding=True, fencing_token=4)
    publisher = EventPublisher(SETTINGS, [state])
    publisher.demoted({"metadata": {"name": "web-1", "namespace": "apps", "uid": "u-1",
                                    "labels": {"lease-role": "standby"}}})
    publisher.demoted({"metadata": {}})  # malformed: never raises into the label publisher
    [found] = queued(publisher)
    assert (found.reason, found.type, found.related) == ("StaleLabelDemoted", "Normal", True)
    assert found.regarding == {"apiVersion": "v1", "kind": "Pod", "namespace": "apps",
                               "name": "web-1", "uid": "u-1"}
    assert found.note == "lease-role leader -> standby: web-0 holds lease jobs, fencing token 4"


def test_a_full_queue_drops_without_waiting_and_logs_once(caplog):
    state = LeaseState(lease="jobs", identity="web-0", role="all", claim_horizon=0.05)
    publisher = EventPublisher(SETTINGS, [state])
    with caplog.at_level(logging.WARNING, logger="sidecar.publish.events"):
        for _ in range(QUEUE_SIZE + 10):
            publisher._offer(occurrence())  # no worker: nobody takes them
    assert len(queued(publisher)) == QUEUE_SIZE
    assert [r.getMessage() for r in caplog.records] == [
        "queueing pod events failed; further failures are not logged until it works"]


def test_the_first_occurrence_is_written_at_once_repeats_once_per_interval():
    agg = Aggregator()
    assert agg.next_due() is None
    agg.add(occurrence(note="token 1"), now=100.0)
    [series] = agg.due(100.0)
    agg.wrote(series, 100.0, ok=True)
    assert agg.next_due() is None
    for i, now in enumerate((101.0, 105.0, 120.0), start=2):
        agg.add(occurrence(note=f"token {i}"), now=now)
    assert agg.due(129.9) == []
    assert agg.next_due() == 100.0 + MIN_WRITE_INTERVAL
    [again] = agg.due(130.0)
    assert again is series and series.count == 4 and series.last.note == "token 4"
    assert series.first.note == "token 1"
    # Another reason is another series, written at once.
    agg.add(occurrence("LeaseReleased"), now=121.0)
    assert {s.last.reason for s in agg.due(121.0)} == {"LeaseReleased"}
    # Stopping writes every series with unwritten occurrences, interval or not.
    assert len(agg.due(121.0, force=True)) == 2


def test_a_series_ends_a_window_after_its_last_occurrence():
    agg = Aggregator()
    agg.add(occurrence(), now=0.0)
    first = agg.series[occurrence().key]
    agg.wrote(first, 0.0, ok=True)
    agg.add(occurrence(), now=WINDOW)  # within the window of the first: joins it
    assert agg.series[occurrence().key] is first and first.count == 2
    agg.wrote(first, WINDOW, ok=True)
    agg.add(occurrence(), now=2 * WINDOW + 1)  # a window after the last: a new object
    fresh = agg.series[occurrence().key]
    assert fresh is not first and fresh.count == 1 and agg.due(2 * WINDOW + 1) == [fresh]


def test_too_many_series_evict_the_idle_ones_or_drop():
    agg = Aggregator(capacity=2)
    assert agg.add(occurrence(uid="a"), now=0.0)
    assert agg.add(occurrence(uid="b"), now=1.0)
    # Both still have unwritten occurrences: nothing may be evicted.
    assert not agg.add(occurrence(uid="c"), now=2.0)
    for series in agg.due(2.0):
        agg.wrote(series, 2.0, ok=True)
    assert agg.add(occurrence(uid="c"), now=3.0)  # evicts the least recently seen, "a"
    assert {key[0] for key in agg.series} == {"b", "c"}


def test_a_failed_write_is_tried_again_a_few_times_then_waits_for_a_new_occurrence():
    agg = Aggregator()
    agg.add(occurrence(), now=0.0)
    now = 0.0
    for attempt in range(1, MAX_TRIES + 1):
        [series] = agg.due(now)
        agg.wrote(series, now, ok=False)
        assert agg.due(now + MIN_WRITE_INTERVAL - 0.1) == []
        now += MIN_WRITE_INTERVAL
        assert len(agg.due(now)) == (1 if attempt < MAX_TRIES else 0), attempt
    assert agg.next_due() is None  # given up: nothing on a timer any more
    agg.add(occurrence(), now=now)  # the next occurrence carries the count
    [series] = agg.due(now)
    assert series.count == 2
    agg.wrote(series, now, ok=True)
    assert series.tries == 0 and agg.next_due() is None
