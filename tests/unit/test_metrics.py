"""The metrics: names by Prometheus conventions, values off a real elector's calls.

The elector runs against the in-memory lease of tests/unit/fakes.py on a fake clock, so
round trips have exact durations; the scrape goes through prometheus_client's own text
exposition and parser. A real sidecar's /metrics is checked by
tests/integration/test_monitoring.py.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sidecar import __version__
from sidecar.elector import Elector
from sidecar.lease import Grant
from sidecar.metrics import registry_for
from sidecar.publish.http.limits import Limits
from sidecar.publish.shards import ShardBoard
from sidecar.settings import Timing
from sidecar.state import LeaseState
from testkit.support import REPO
from tests.unit.fakes import FakeClock, FakeLease

TIMING = Timing(lease_duration=1.0, renew_interval=0.01, renew_deadline=0.5,
                safety_margin=0.1, claim_horizon=0.05)


def make(clock: FakeClock, lease: Any) -> tuple[Elector, LeaseState]:
    state = LeaseState(lease="jobs", identity="me", role="all",
                       claim_horizon=TIMING.claim_horizon, clock=clock)
    return Elector(lease, state, TIMING, "me"), state


def served(states: list[LeaseState]) -> CollectorRegistry:
    """What a sidecar's /metrics serves: the lease and process collectors, and the HTTP
    endpoint's bounds (as sidecar.publish.http.app builds it at the first scrape)."""
    return registry_for(states, Limits())


def scrape(states: list[LeaseState]) -> dict[str, float]:
    """Every sample as ``name{label="v",...}`` (labels sorted) -> value."""
    text = generate_latest(served(states)).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def families(states: list[LeaseState]) -> dict[str, str]:
    """Exposed family names (counters with their ``_total``) -> type."""
    text = generate_latest(served(states)).decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


async def test_round_trips_are_timed_by_operation_and_outcome():
    clock = FakeClock()
    lease = FakeLease(clock, round_trip=0.003, valid_for=10.0)
    elector, state = make(clock, lease)
    await elector._acquire_once()
    await elector._renew_once()
    lease.fail = True
    await elector._renew_once()  # an error, with time left: still holding
    lease.fail, lease.grant = False, False
    await elector._renew_once()  # refused: the lease is lost
    samples = scrape([state])
    acquire = 'lease_sidecar_acquire_duration_seconds_{}{{{}lease="jobs",outcome="{}"}}'
    renew = 'lease_sidecar_renew_duration_seconds_{}{{{}lease="jobs",outcome="{}"}}'
    # 3 ms lands in the 5 ms bucket, not in the 2.5 ms one.
    assert samples[acquire.format("bucket", 'le="0.0025",', "held")] == 0
    assert samples[acquire.format("bucket", 'le="0.005",', "held")] == 1
    assert samples[acquire.format("bucket", 'le="+Inf",', "held")] == 1
    assert samples[acquire.format("count", "", "held")] == 1
    assert abs(samples[acquire.format("sum", "", "held")] - 0.003) < 1e-9
    # Rarer outcomes appear with their first call (16 lines each); "held" always.
    assert acquire.format("count", "", "refused") not in samples
    for outcome in ("held", "error", "refused"):
        assert samples[renew.format("count", "", outcome)] == 1, outcome
    assert renew.format("count", "", "timeout") not in samples
    assert samples['lease_sidecar_transitions_total{event="acquired",lease="jobs"}'] == 1
    assert samples['lease_sidecar_transitions_total{event="lost",lease="jobs"}'] == 1
    assert samples['lease_sidecar_transitions_total{event="released",lease="jobs"}'] == 0


class TwinHolds(FakeLease):
    """Another live process with our identity holds the lease (as RowLease reports it)."""

    async def try_acquire(self) -> Grant:
        return Grant(held=False, holder="me", duplicate_identity=True,
                     reason="held by another process with our identity")


async def test_acquires_refused_for_our_own_identity_are_counted_per_state():
    clock = FakeClock()
    elector, state = make(clock, TwinHolds(clock))
    _, other = make(clock, FakeLease(clock))
    await elector._acquire_once()
    await elector._acquire_once()
    samples = scrape([state])
    assert samples['lease_sidecar_duplicate_identity_total{lease="jobs"}'] == 2
    assert other.duplicate_identity == 0  # no process-wide count leaks into another state


class HangingRenew(FakeLease):
    """Grants the acquire; every renew hangs until the elector gives up on it."""

    async def try_renew(self) -> Grant:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


async def test_a_renew_that_outlives_the_validity_counts_as_a_timeout():
    clock = FakeClock()
    # 0.2 s of validity left when the renew is sent: asyncio.timeout ends it (real time).
    elector, state = make(clock, HangingRenew(clock, valid_for=0.2))
    await elector._acquire_once()
    await asyncio.wait_for(elector._renew_once(), 5)
    samples = scrape([state])
    count = 'lease_sidecar_renew_duration_seconds_count{{lease="jobs",outcome="{}"}}'
    assert samples[count.format("timeout")] == 1
    assert count.format("error") not in samples


async def test_gauges_follow_the_state():
    clock = FakeClock()
    lease = FakeLease(clock, round_trip=0.002, valid_for=10.0, token=41)
    elector, state = make(clock, lease)
    before = scrape([state])
    for op in ("acquire", "renew"):
        held = f'lease_sidecar_{op}_duration_seconds_count{{lease="jobs",outcome="held"}}'
        assert before[held] == 0
    for gauge in ("leader", "holding", "backend_up", "fencing_token",
                  "claim_expiry_timestamp_seconds", "last_renew_timestamp_seconds"):
        assert before[f'lease_sidecar_{gauge}{{lease="jobs"}}'] == 0, gauge

    sent_wall = clock.wall()
    await elector._acquire_once()
    replied_wall = clock.wall()
    clock.advance(TIMING.claim_horizon)  # past the first claim's wait
    during = scrape([state])
    assert during['lease_sidecar_leader{lease="jobs"}'] == 1
    assert during['lease_sidecar_holding{lease="jobs"}'] == 1
    assert during['lease_sidecar_backend_up{lease="jobs"}'] == 1
    assert during['lease_sidecar_fencing_token{lease="jobs"}'] == 41
    # Validity counts from the send time; the timestamp is Unix seconds, not monotonic.
    assert during['lease_sidecar_claim_expiry_timestamp_seconds{lease="jobs"}'] == \
        sent_wall + 10.0
    assert during['lease_sidecar_last_renew_timestamp_seconds{lease="jobs"}'] == replied_wall
    assert during['lease_sidecar_state_changes_total{lease="jobs"}'] == state.facts.version

    # The scrape handed out a claim: the release waits it out (one horizon on this clock).
    clock.advance(TIMING.claim_horizon)
    await elector.shutdown()  # unpublish, release
    after = scrape([state])
    assert after['lease_sidecar_leader{lease="jobs"}'] == 0
    assert after['lease_sidecar_holding{lease="jobs"}'] == 0
    assert after['lease_sidecar_fencing_token{lease="jobs"}'] == 0
    assert after['lease_sidecar_claim_expiry_timestamp_seconds{lease="jobs"}'] == 0
    # The last successful renew stays: its age is what an alert watches.
    assert after['lease_sidecar_last_renew_timestamp_seconds{lease="jobs"}'] == replied_wall
    assert after['lease_sidecar_transitions_total{event="released",lease="jobs"}'] == 1


def test_names_follow_prometheus_conventions():
    states = [LeaseState(lease=n, identity="me", role="all", claim_horizon=0.25)
              for n in ("a", "b")]
    exposed = families(states)
    ours = {name: kind for name, kind in exposed.items() if name.startswith("lease_sidecar_")}
    assert set(exposed) - set(ours) == {n for n in exposed if n.startswith("process_")}
    assert any(n.startswith("process_resident_memory") for n in exposed)  # the process collector
    for name, kind in ours.items():
        assert (kind == "counter") == name.endswith("_total"), name
        if "duration" in name or "timestamp" in name:
            assert name.endswith("_seconds"), name
    assert ours["lease_sidecar_acquire_duration_seconds"] == "histogram"
    assert ours["lease_sidecar_renew_duration_seconds"] == "histogram"
    samples = scrape(states)
    assert samples[f'lease_sidecar_build_info{{version="{__version__}"}}'] == 1
    assert samples['lease_sidecar_leader{lease="b"}'] == 0  # one series per lease


def test_private_registries_do_not_collide():
    """Two sidecars in one process (tests, a host app): no duplicate-name errors, and
    the library's global registry stays untouched."""
    state = LeaseState(lease="x", identity="me", role="all", claim_horizon=0.25)
    first, second = registry_for([state]), registry_for([state])
    assert generate_latest(first) and generate_latest(second)
    global_names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(n.startswith("lease_sidecar_") for n in global_names)


def test_the_metrics_reference_lists_every_metric():
    """The metrics reference names exactly the exposed families, with their types (it is
    generated from the registry: this holds the generator to what /metrics serves)."""
    doc = (REPO / "docs" / "monitoring.md").read_text()
    section = doc.split("## Metrics reference", 1)[1].split("\n#", 1)[0]
    documented = dict(re.findall(r"^\| `(lease_sidecar_\w+)` \| (\w+) \|", section, re.M))
    state = LeaseState(lease="x", identity="me", role="all", claim_horizon=0.25)
    # With a shard set (LEASE_SHARDS), its collector serves a few families more.
    shard = LeaseState(lease="x-0", identity="me", role="all", claim_horizon=0.25)
    board = ShardBoard([shard], "me", lambda: {"members": 1, "assigned": ["x-0"], "ok": True})
    text = generate_latest(registry_for([state], Limits(), board)).decode()
    ours = {n: k for n, k in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
            if n.startswith("lease_sidecar_")}
    assert documented == ours
    assert "lease_sidecar_shards_assigned 1.0" in text
    assert "`process_*`" in section
