"""The label reconciler: one pod watch per served namespace (kopf), labels put right.

Every pod event updates an in-memory view of the sidecar pods (those with the
``lease-sidecar/lease`` annotation), grouped by the annotation's lease object, and
reconciles that pod's group at once (:func:`sidecar.operator.labels.desired_labels`). The
watch has no label selector on purpose: a pod whose group label is edited or removed
still arrives as a change (with a selector it would arrive as a deletion), so it is put
back in its group.

Convergence, whatever happened: a group whose reconcile failed (apiserver down, a 409
because the pod changed since it was judged, permissions missing) stays dirty and is tried
again every :data:`RETRY_EVERY` seconds; every group is reconciled again every
:data:`RESYNC_EVERY` seconds even without events (an event lost). A ``kubernetes`` group
whose holder's pod says ``leader`` is judged again when the Lease it read runs out, so a
holder killed with nobody to take over loses its label within :data:`RETRY_EVERY` of its
Lease expiring (one Lease GET per lease duration while the holder renews).
Every label write carries the resourceVersion it was judged on, so a sidecar's own newer
write always wins over the operator's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from sidecar.kubeapi import KubeClient, KubeError
from sidecar.operator.labels import LeaseTruth, PodView, desired_labels, needs_lease

log = logging.getLogger("sidecar.operator")

RETRY_EVERY = 0.5  # seconds between tries of a group whose reconcile failed
RESYNC_EVERY = 10.0  # seconds between reconciles of every group, events or not

Group = tuple[str, str]  # (namespace, group label value)


class Reconciler:
    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self.pods: dict[tuple[str, str], PodView] = {}  # (namespace, name) -> view
        self._dirty: set[Group] = set()
        self._locks: dict[Group, asyncio.Lock] = {}
        self._failing: set[Group] = set()
        self._expiry: dict[Group, float] = {}  # wall time the Lease judged runs out

    # -- inputs ------------------------------------------------------------------------
    async def on_pod(self, pod: dict[str, Any], deleted: bool) -> None:
        """One pod event from the watch: update the view, reconcile what it touches."""
        meta = pod.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        before = self.pods.pop(key, None)
        view = None if deleted else PodView.of(pod)
        if view is not None:
            self.pods[key] = view
        touched = {(v.namespace, v.group) for v in (before, view) if v is not None}
        for group in touched:
            await self.reconcile(group)

    async def resync(self) -> None:
        """Until cancelled: retry dirty groups often, every group now and then."""
        last_full = time.monotonic()
        while True:
            await asyncio.sleep(RETRY_EVERY)
            if time.monotonic() - last_full >= RESYNC_EVERY:
                last_full = time.monotonic()
                self._dirty |= {(v.namespace, v.group) for v in self.pods.values()}
            now = time.time()
            self._dirty |= {group for group, at in self._expiry.items() if at <= now}
            for group in list(self._dirty):
                await self.reconcile(group)

    # -- the work ----------------------------------------------------------------------
    async def reconcile(self, group: Group) -> None:
        lock = self._locks.setdefault(group, asyncio.Lock())
        async with lock:
            self._dirty.discard(group)
            self._expiry.pop(group, None)
            try:
                await self._reconcile(group)
            except KubeError as exc:
                self._dirty.add(group)
                if group not in self._failing:
                    self._failing.add(group)
                    log.warning("label reconcile failed; retrying until it works", extra={
                        "namespace": group[0], "group": group[1], "error": str(exc)})
                return
            if group in self._failing:
                self._failing.discard(group)
                log.info("label reconcile works again",
                         extra={"namespace": group[0], "group": group[1]})
            if not any((v.namespace, v.group) == group for v in self.pods.values()):
                self._locks.pop(group, None)
                self._expiry.pop(group, None)

    async def _reconcile(self, group: Group) -> None:
        namespace, _ = group
        members = [v for v in self.pods.values() if (v.namespace, v.group) == group]
        if not members:
            return
        truth = None
        if any(v.note.get("backend") == "kubernetes" for v in members):
            truth = LeaseTruth(None, None)
            if needs_lease(members):
                truth = LeaseTruth.of(await self.client.get_or_none(
                    f"/apis/coordination.k8s.io/v1/namespaces/{quote(namespace)}/leases/"
                    f"{quote(members[0].note['object'])}"))
        now = time.time()
        if truth is not None and truth.expires is not None and any(
                v.says_leader and truth.holds(str(v.note.get("identity")), now)
                for v in members):
            self._expiry[group] = truth.expires  # its leader label is stale from then
        for name, labels in desired_labels(members, truth, now).items():
            view = self.pods[(namespace, name)]
            patch = {"metadata": {"labels": labels, "resourceVersion": view.version}}
            try:
                await self.client.patch(
                    f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}", patch)
            except KubeError as exc:
                if exc.status == 404:
                    continue  # gone; its deletion event follows
                if exc.status == 409:
                    self._dirty.add(group)  # changed since judged; its event follows
                    continue
                raise
            log.info("label put right", extra={"namespace": namespace, "pod": name,
                                               "labels": labels})


def register(registry: Any, reconciler: Reconciler) -> None:
    """The kopf handlers: every pod event of the served namespaces, and the resync task."""
    import kopf

    tasks: set[asyncio.Task[None]] = set()

    @kopf.on.event("pods", registry=registry)
    async def pod_event(event: Mapping[str, Any], type: str | None, **_: Any) -> None:
        await reconciler.on_pod(event["object"], deleted=type == "DELETED")

    @kopf.on.startup(registry=registry)
    async def start_resync(**_: Any) -> None:
        # A task, not an awaited loop: startup handlers must finish for kopf to run.
        tasks.add(asyncio.get_running_loop().create_task(reconciler.resync()))

    @kopf.on.cleanup(registry=registry)
    async def stop_resync(**_: Any) -> None:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await reconciler.client.close()
