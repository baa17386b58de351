"""The pod label's claim rule: the state's own (``Facts.leads_at``), on a fake clock.

The label's PATCHes and demotions run against a real apiserver in
tests/integration/test_pod_labels.py; here only the decision "do we lead right now", which
the publisher asks before it demotes another pod, and which must never disagree with
``GET /leader``, and how it reads another pod's annotation. Building the publisher
connects to nothing (that happens in ``start``).
"""

import json

import pytest

from sidecar.publish.pod_label import ANNOTATION, PodLabelPublisher, note_of
from sidecar.settings import Settings
from sidecar.state import LeaseState
from tests.unit.fakes import FakeClock


def _label(clock: FakeClock) -> tuple[PodLabelPublisher, LeaseState]:
    state = LeaseState(lease="default", identity="web-0", role="all", claim_horizon=0.25,
                       clock=clock)
    settings = Settings(identity="web-0", pod_name="web-0", pod_namespace="ns")
    return PodLabelPublisher(settings, [state]), state


def test_the_label_demotes_others_exactly_while_get_leader_says_leader():
    clock = FakeClock()
    label, state = _label(clock)
    assert not label._leads()  # standby
    state.update(holding=True, claim_from=clock.now + 0.25, valid_until=clock.now + 10)
    seen = []
    # Before the first claim, at it, inside, at the end of validity; then unpublished.
    for step in (0.0, 0.25, 4.0, 5.75):
        clock.advance(step)
        issued = state.issued_until
        leads = label._leads()
        assert state.issued_until == issued  # asking hands out no claim
        assert leads == state.claim().leader
        seen.append(leads)
    assert seen == [False, True, True, False]
    state.update(valid_until=clock.now + 10)  # a renew
    assert label._leads()
    state.update(released=True)
    assert not label._leads() and not state.claim().leader


def test_both_pod_publishers_refuse_to_start_outside_a_pod():
    from sidecar.publish.events import EventPublisher

    state = LeaseState(lease="default", identity="web-0", role="all", claim_horizon=0.25,
                       clock=FakeClock())
    outside = Settings(identity="web-0", pod_namespace="ns")  # POD_NAME missing
    with pytest.raises(ValueError, match=r"^the pod label needs POD_NAME and POD_NAMESPACE$"):
        PodLabelPublisher(outside, [state])
    with pytest.raises(ValueError, match=r"^pod events need POD_NAME and POD_NAMESPACE$"):
        EventPublisher(outside, [state])


@pytest.mark.parametrize(("annotation", "note"), [
    ({"role": "leader", "object": "lease-sidecar.jobs"},
     {"role": "leader", "object": "lease-sidecar.jobs"}),
    (None, {}),  # no annotation (not a sidecar's pod, or not written yet)
    ("not json", {}),
    ([1, 2], {}),
])
def test_the_demotion_reads_another_pods_annotation_or_nothing(annotation, note):
    meta = {"name": "web-1"}
    if annotation is not None:
        text = annotation if isinstance(annotation, str) else json.dumps(annotation)
        meta["annotations"] = {ANNOTATION: text}
    assert note_of(meta) == note
