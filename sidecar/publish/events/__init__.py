"""Kubernetes Events on the pod, so ``kubectl describe pod`` and event exporters show
when this sidecar became leader, lost or released the lease, or demoted a stale label.

========================  =======  =======================================================
reason                    type     when
========================  =======  =======================================================
``LeaderElected``         Normal   the backend granted us the lease (a new term)
``LeaseLost``             Warning  a renew was refused: someone else holds the lease
``LeaseReleased``         Normal   we gave the lease back on SIGTERM or ``POST /release``
``LeaseReleased``         Warning  we gave it back because its validity ran out first
``StaleLabelDemoted``     Normal   while leading, we set another pod's ``lease-role``
                                   from ``leader`` to ``standby`` (on *that* pod, with our
                                   pod as ``related``)
========================  =======  =======================================================

The note names the lease, the fencing token of the term and the elector's reason.

Which API: core ``v1`` Events, as client-go's ``record.EventRecorder`` writes them (the
recorder its ``leaderelection`` package reports to) and as ``kubectl describe`` reads
them. ``events.k8s.io/v1`` is the same object under another view, but makes the note
immutable, so a repeated event could not show the latest fencing token.

Two modules: :mod:`.record` decides what to report and folds repeats into series (pure
bookkeeping, no I/O); :mod:`.publisher` follows the states and writes the series to
the apiserver from a task on the event loop.
"""

from sidecar.publish.events.publisher import QUEUE_SIZE, EventPublisher, create
from sidecar.publish.events.record import (
    MAX_SERIES,
    MAX_TRIES,
    MIN_WRITE_INTERVAL,
    VOLUNTARY,
    WINDOW,
    Aggregator,
    Occurrence,
    Series,
    from_transition,
)

__all__ = [
    "MAX_SERIES", "MAX_TRIES", "MIN_WRITE_INTERVAL", "QUEUE_SIZE", "VOLUNTARY", "WINDOW",
    "Aggregator", "EventPublisher", "Occurrence", "Series", "create", "from_transition",
]
