"""Prometheus metrics, read off the lease states when scraped.

A custom collector on a registry of our own: nothing to keep in sync with the elector,
and tests or a host application using the library never collide on metric names.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.lease import duplicate_identity
from sidecar.state import LeaseState


class LeaseCollector(Collector):
    def __init__(self, states: list[LeaseState]) -> None:
        self._states = states

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "lease_is_leader": "1 while this contender publishes a claim",
            "lease_holding": "1 while the backend grants us the lease",
            "lease_backend_up": "1 while the backend answers",
            "lease_fencing_token": "fencing token of the current term (0 when none)",
            "lease_state_version": "state changes so far",
        }
        families = {name: GaugeMetricFamily(name, text, labels=["lease"])
                    for name, text in gauges.items()}
        transitions = CounterMetricFamily("lease_transitions", "acquisitions and step-downs",
                                          labels=["lease", "event"])
        duplicates = CounterMetricFamily(
            "lease_duplicate_identity",
            "acquire attempts that found the lease held by another process with our identity",
            labels=["lease"])
        for state in self._states:
            facts = state.facts
            values = {
                "lease_is_leader": state.claim().leader,
                "lease_holding": facts.holding,
                "lease_backend_up": facts.backend_ok,
                "lease_fencing_token": facts.fencing_token or 0,
                "lease_state_version": facts.version,
            }
            for name, value in values.items():
                families[name].add_metric([state.lease], float(value))
            for event, count in state.event_counts.items():
                transitions.add_metric([state.lease, event], count)
            duplicates.add_metric([state.lease],
                                  duplicate_identity[(state.identity, state.lease)])
        yield from families.values()
        yield transitions
        yield duplicates


def registry_for(states: list[LeaseState]) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(LeaseCollector(states))
    return registry
