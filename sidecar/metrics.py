"""Prometheus metrics, read off the lease states when scraped.

A custom collector on a registry of our own: nothing to keep in sync with the elector,
and tests or a host application using the library never collide on metric names (the
process collector, too, is registered only here, not on the library's global registry).
Names follow Prometheus conventions: one ``lease_sidecar_`` prefix, counters end in
``_total``, durations in seconds, times as Unix timestamps in seconds. The HELP texts
here are the metrics reference: ``docs/monitoring.md`` is generated from what this
registry serves (``python -m scripts.gendocs``).

Imported at the first scrape, not at start (:mod:`sidecar.publish.http.app`): the
collectors count nothing themselves, so a registry built late reports the same, and
``prometheus_client`` stays off the path to the first ``/healthz``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sidecar import __version__
from sidecar.base.stats import OPERATIONS, OUTCOMES
from sidecar.elector import HANDOVER_REASONS
from sidecar.publish.http.limits import Limits
from sidecar.publish.shards import ShardBoard
from sidecar.shards.manager import MOVE_REASONS
from sidecar.state import LeaseState

PREFIX = "lease_sidecar_"

# Transitions a lease can go through; each starts at 0 so rate() and increase() see the
# first one (a counter that appears only with its first event hides that event). A
# histogram is 16 lines, so only the "held" round trips start at 0.
EVENTS = ("acquired", "lost", "released")

_GAUGES = {
    "leader": "1 while this contender hands out leader claims (GET /leader answers 200)",
    "holding": "1 while the backend grants this contender the lease (also during the wait "
               "before the first claim, and while stepping down)",
    "backend_up": "1 while the backend answers",
    "fencing_token": "fencing token of the current term (0 when not holding)",
    "claim_expiry_timestamp_seconds":
        "Unix time the proven validity ends: no claim of this term outlives it unless a "
        "renew succeeds (0 when not holding)",
    "last_renew_timestamp_seconds":
        "Unix time of the last acquire or renew that held the lease (0: never)",
    "last_work_heartbeat_timestamp_seconds":
        "Unix time of the application's last accepted POST /heartbeat (0: never)",
}


class LeaseCollector(Collector):
    def __init__(self, states: list[LeaseState]) -> None:
        self._states = states

    def collect(self) -> Iterator[Metric]:
        yield self._build_info()
        gauges = {name: GaugeMetricFamily(PREFIX + name, text, labels=["lease"])
                  for name, text in _GAUGES.items()}
        transitions = CounterMetricFamily(
            f"{PREFIX}transitions", "leadership transitions of this contender, by event: acquired, "
            "lost (a renew was refused), released (SIGTERM, POST /release, a hand-over, or the "
            "validity ran out before a renew succeeded)",
            labels=["lease", "event"])
        stalls = CounterMetricFamily(
            f"{PREFIX}work_stalls",
            "step-downs by the work watchdog: no POST /heartbeat for LEASE_WORK_STALL_AFTER "
            "while leading", labels=["lease"])
        changes = CounterMetricFamily(
            f"{PREFIX}state_changes",
            "updates of this lease's state by the elector, renews included", labels=["lease"])
        round_trips = {op: HistogramMetricFamily(
            f"{PREFIX}{op}_duration_seconds",
            f"round trip of one {op} call to the backend, by outcome "
            f"({', '.join(OUTCOMES[op])})",
            labels=["lease", "outcome"]) for op in OPERATIONS}
        duplicates = CounterMetricFamily(
            f"{PREFIX}duplicate_identity",
            "acquire attempts that found the lease held by another live process with this "
            "contender's identity (identities must be unique)", labels=["lease"])
        handovers = CounterMetricFamily(
            f"{PREFIX}handovers",
            "deliberate hand-overs by this contender as the leader, by reason (request: "
            "POST /handover; app-unready: LEASE_APP_UNREADY_AFTER; shutdown: "
            "LEASE_SHUTDOWN_HANDOVER)", labels=["lease", "reason"])
        unready = CounterMetricFamily(
            f"{PREFIX}app_unready_leading_seconds",
            "seconds this contender held the lease while its application was not ready "
            "(LEASE_APP_READY_URL not answering 2xx, or a container of "
            "LEASE_APP_READY_CONTAINERS not Ready)", labels=["lease"])
        for state in self._states:
            facts = state.facts
            lease = [state.lease]
            holding_until = state.to_wall(facts.valid_until) if facts.holding else None
            values = {
                "leader": state.claim().leader,
                "holding": facts.holding,
                "backend_up": facts.backend_ok,
                "fencing_token": (facts.fencing_token or 0) if facts.holding else 0,
                "claim_expiry_timestamp_seconds": holding_until or 0.0,
                "last_renew_timestamp_seconds": state.stats.last_success_wall,
                "last_work_heartbeat_timestamp_seconds": state.work.last_beat_wall,
            }
            for name, value in values.items():
                gauges[name].add_metric(lease, float(value))
            counts = {event: 0 for event in EVENTS}
            counts.update(state.event_counts)
            for event, count in counts.items():
                transitions.add_metric([state.lease, event], count)
            stalls.add_metric(lease, state.work.stalls)
            for reason in HANDOVER_REASONS:
                handovers.add_metric([state.lease, reason], state.handovers.get(reason, 0))
            unready.add_metric(lease, state.unready_leading_seconds)
            changes.add_metric(lease, facts.version)
            duplicates.add_metric(lease, state.duplicate_identity)
            for (op, outcome), histogram in state.stats.histograms.items():
                # 16 lines per histogram, most of a scrape's cost: the rarer outcomes
                # appear with their first call, "held" always.
                if outcome == "held" or histogram.total or histogram.count:
                    round_trips[op].add_metric([state.lease, outcome],
                                               histogram.cumulative(), histogram.total)
        yield from gauges.values()
        yield transitions
        yield stalls
        yield handovers
        yield unready
        yield changes
        yield duplicates
        yield from round_trips.values()

    @staticmethod
    def _build_info() -> Metric:
        info = GaugeMetricFamily(f"{PREFIX}build_info", "version of this sidecar (always 1)",
                                 labels=["version"])
        info.add_metric([__version__], 1.0)
        return info


class LimitsCollector(Collector):
    """The HTTP endpoint's bounds (:mod:`sidecar.publish.http.limits`)."""

    def __init__(self, limits: Limits) -> None:
        self._limits = limits

    def collect(self) -> Iterator[Metric]:
        limits = self._limits
        yield GaugeMetricFamily(f"{PREFIX}http_connections", "open HTTP connections",
                                value=limits.open_connections())
        yield GaugeMetricFamily(f"{PREFIX}http_waiters", "parked blocking queries",
                                value=limits.waiters)
        refused = CounterMetricFamily(f"{PREFIX}http_refused",
                                      "requests turned away by a bound", labels=["bound"])
        refused.add_metric(["connections"], limits.refused_connections)
        refused.add_metric(["waiters"], limits.waits_refused)
        yield refused


class ShardCollector(Collector):
    """The shard set (``LEASE_SHARDS``): counts over its leases, one line each, not the
    per-lease families above (256 shards would be thousands of lines)."""

    def __init__(self, board: ShardBoard) -> None:
        self._board = board

    def collect(self) -> Iterator[Metric]:
        board = self._board
        view = board.view()
        now = [state for state in board.states if state.facts.holding]
        gauges = {
            "shards_owned": ("shards the backend grants this member now (also those whose "
                             "first claim is due, or being handed over)", len(now)),
            "shards_led": ("shards this member claims now (what GET /shards lists)",
                           len(board.led())),
            "shards_assigned": ("shards the assignment over the live members gives this "
                                "member", len(view.get("assigned", []))),
            "shard_members": ("live members of the shard group, as this member's last "
                              "round trip saw them", view.get("members", 0)),
        }
        for name, (text, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, text, value=value)
        moves = CounterMetricFamily(
            f"{PREFIX}shard_moves",
            "shards that left this member, by reason: rebalance (handed to the member the "
            "assignment names), shutdown (handed over on SIGTERM), lost (a renew was "
            "refused or ran out)", labels=["reason"])
        counts = dict.fromkeys(MOVE_REASONS, 0)
        acquired = 0
        for state in board.states:
            counts["rebalance"] += state.handovers.get("rebalance", 0)
            counts["shutdown"] += state.handovers.get("shutdown", 0)
            counts["lost"] += state.event_counts.get("lost", 0)
            acquired += state.event_counts.get("acquired", 0)
        for reason, count in counts.items():
            moves.add_metric([reason], count)
        yield moves
        yield CounterMetricFamily(f"{PREFIX}shards_acquired",
                                  "shards this member acquired", value=acquired)
        yield CounterMetricFamily(
            f"{PREFIX}shard_group_round_trips",
            "round trips of the shard group: this member's record and every shard lease "
            "renewed together (one a renew interval, whatever the number of shards, on "
            "the database backends)", value=view.get("round_trips", 0))


def registry_for(states: list[LeaseState], limits: Limits | None = None,
                 shards: ShardBoard | None = None) -> CollectorRegistry:
    """What ``/metrics`` serves: the leases, the HTTP bounds (when given), the shard set
    (when there is one), the process."""
    registry = CollectorRegistry()
    registry.register(LeaseCollector(states))
    if limits is not None:
        registry.register(LimitsCollector(limits))
    if shards is not None:
        registry.register(ShardCollector(shards))
    # process_* (memory, CPU, open files): watched against the chart's memory limit.
    ProcessCollector(registry=registry)
    return registry
