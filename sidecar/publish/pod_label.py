"""The ``lease-role`` pod label, kept by kopf, so ``kubectl get pods -L lease-role`` shows
who leads.

Our pod carries ``lease-role=leader|standby|api``, the group label
``lease-sidecar/group=<lease object>`` and the annotation ``lease-sidecar/lease`` (JSON:
lease, identity, role, fencing token). The label follows the *first* lease name.

Two paths write labels:

- ``changed()``: the elector awaits it on every transition (bounded by 2 s). It PATCHes our
  own pod and returns once the apiserver accepted the patch, which is what makes "unpublish,
  then release" hold for the label: the label says ``standby`` before the lease is given
  back, and says ``leader`` only after the lease was acquired.
- A kopf handler watches the pods of our lease group in our namespace and reconciles:
  our own pod back to what we publish if anything else changed it, and — while we lead —
  any *other* pod of the group that still says ``leader`` (a holder killed without cleanup)
  is demoted to ``standby``. It runs once for every group pod when kopf starts, on every
  change of a group pod, and over all group pods when our own pod turns ``leader``. So
  once the lease has moved, at most one pod of a group shows ``leader``.

Where kopf runs: inside the sidecar process, in a daemon thread with its own event loop,
standalone (no peering objects or CRDs), namespaced to ``POD_NAMESPACE``, with K8s event
posting and cluster scanning off so it needs nothing beyond the pod permissions of the
Role. A thread rather than a task on the sidecar's loop because kopf, when started on the
main thread, installs its own SIGINT/SIGTERM handlers, which would replace the sidecar's
"unpublish, release, exit 0" shutdown; in a thread it leaves signals alone, a stalled
kopf can never delay the election loop, and it is stopped by a flag. Not a separate
operator Deployment, because demotion must only be done by the pod that holds the lease
*now*, which is what the sidecar knows and an operator would have to re-derive.

The label is advisory (the lease and the claim rules are the truth): a dead apiserver must
not keep a lease that could pass on, so the elector gives up waiting for the patch after
2 s and releases anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from kubernetes.client.exceptions import ApiException

from sidecar.kube import KubeAccess, connect, kopf_connection, one_line, request
from sidecar.publish.own_pod import MERGE_PATCH, OwnPod
from sidecar.settings import Settings
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.publish.pod_label")

ROLE_LABEL = "lease-role"
GROUP_LABEL = "lease-sidecar/group"
ANNOTATION = "lease-sidecar/lease"
KOPF_STOP_TIMEOUT = 5.0
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def group_value(object_name: str) -> str:
    """A label value naming the lease group: the Lease object name, hashed if too long."""
    if _LABEL_VALUE.match(object_name):
        return object_name
    digest = hashlib.sha256(object_name.encode()).hexdigest()[:12]
    head = re.sub(r"[^A-Za-z0-9_.-]", "-", object_name)[:50].strip("-_.")
    return f"{head}-{digest}" if head else digest


@dataclass(frozen=True)
class Desired:
    """What our own pod should show."""

    role: str  # leader | standby | api
    annotation: str  # JSON

    def patch(self, group: str) -> dict[str, Any]:
        return {"metadata": {"labels": {ROLE_LABEL: self.role, GROUP_LABEL: group},
                             "annotations": {ANNOTATION: self.annotation}}}

    def shown_by(self, pod: dict[str, Any], group: str) -> bool:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        return (labels.get(ROLE_LABEL) == self.role and labels.get(GROUP_LABEL) == group
                and (meta.get("annotations") or {}).get(ANNOTATION) == self.annotation)


class PodLabelPublisher:
    def __init__(self, settings: Settings, states: list[LeaseState]) -> None:
        self._own = OwnPod.of(settings, "the pod label needs")
        self._settings = settings
        self._state = states[0]
        self._group = group_value(settings.store.key(settings.name))
        self._access: KubeAccess | None = None
        # One worker: our own-pod patches go out in the order the elector made them.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pod-label")
        # Serialises "read what we want, patch it" between the elector's path and kopf's.
        self._lock = threading.Lock()
        self._desired = self._compute()
        self._stop_flag = threading.Event()
        self._kopf: threading.Thread | None = None
        # Told each pod we demoted (the PATCH's answer), on kopf's threads; the events
        # publisher reports it (sidecar.publish.events).
        self.on_demoted: Callable[[dict[str, Any]], None] | None = None

    # -- Publisher -----------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._access = await loop.run_in_executor(self._pool, connect, self._settings)
            await loop.run_in_executor(self._pool, self._sync_own_pod)
        except Exception as exc:
            # Advisory: a missing pod or a down apiserver must not stop the sidecar; the
            # kopf handler puts the label right once it can.
            log.warning("pod label not set", extra={"pod": self._own.name, "error": one_line(exc)})
        if self._access is not None:
            self._kopf = threading.Thread(target=self._run_kopf, daemon=True,
                                          name="kopf-pod-label")
            self._kopf.start()

    async def changed(self, state: LeaseState) -> None:
        if state is not self._state or self._access is None:
            return
        self._desired = self._compute()
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._pool, self._sync_own_pod)
        except Exception as exc:
            raise RuntimeError(f"pod label: {one_line(exc)}") from None

    async def stop(self) -> None:
        self._stop_flag.set()
        if self._kopf is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, self._kopf.join, KOPF_STOP_TIMEOUT)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._access is not None:
            self._access.api.close()

    # -- what we publish -----------------------------------------------------------------
    def _compute(self) -> Desired:
        """Read from the state on the event loop (``claim()`` moves ``issued_until``,
        which only the loop writes).

        The label has no expiry, so ``issued_until`` does not cover it: a ``leader``
        label stays until the next PATCH. What takes it down before a release is the
        elector awaiting :meth:`changed` (bounded, see the module docstring).
        """
        state = self._state
        if self._settings.role == "api":
            role, token = "api", None
        else:
            claim = state.claim()
            role = "leader" if claim.leader else "standby"
            token = claim.facts.fencing_token if claim.leader else None
        annotation = json.dumps({"lease": state.lease, "identity": state.identity,
                                 "role": role, "fencing_token": token}, sort_keys=True)
        return Desired(role, annotation)

    def _sync_own_pod(self) -> None:
        """PATCH our pod to the current desired view (blocking; worker threads only)."""
        assert self._access is not None
        with self._lock:
            desired = self._desired
            request(self._access.api, "PATCH", self._own.pods_path(self._own.name),
                    desired.patch(self._group), content_type=MERGE_PATCH)

    def _leads(self) -> bool:
        """The claim rule without handing out a claim: safe on kopf's threads, since
        facts are replaced whole and :meth:`Facts.leads_at` writes nothing."""
        return self._state.facts.leads_at(self._state.clock.monotonic())

    # -- the kopf side (runs in the kopf thread) -----------------------------------------
    def _run_kopf(self) -> None:
        import kopf

        # kopf warns that it leaves signals alone in a thread: that is why it runs here.
        logging.getLogger("kopf._core.reactor.running").setLevel(logging.ERROR)
        registry = kopf.OperatorRegistry()
        settings = kopf.OperatorSettings()
        settings.posting.enabled = False  # would need events/create
        settings.scanning.disabled = True  # would need cluster-wide discovery watches
        settings.watching.label_selectors["pods"] = f"{GROUP_LABEL}={self._group}"
        settings.networking.request_timeout = 30.0
        kopf.on.login(registry=registry)(self._login)
        kopf.on.event("pods", registry=registry)(self._on_pod)
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(kopf.operator(
                registry=registry, settings=settings, standalone=True, clusterwide=False,
                namespaces=[self._own.namespace], stop_flag=self._stop_flag))
        except Exception as exc:
            log.warning("kopf stopped", extra={"error": one_line(exc)})
        finally:
            loop.close()

    def _login(self, **_: Any) -> Any:
        """kopf credentials from the same configuration the rest of the sidecar uses."""
        assert self._access is not None
        return kopf_connection(self._access.api.configuration, self._own.namespace)

    def _on_pod(self, name: str, body: Any, type: str | None, **_: Any) -> None:
        """Reconcile one group pod; kopf runs sync handlers in its executor threads."""
        if type == "DELETED":
            return
        try:
            if name == self._own.name:
                if not self._desired.shown_by(dict(body), self._group):
                    self._sync_own_pod()  # drift: someone else changed our labels
                elif self._desired.role == "leader":
                    self._demote_others()  # our term began: clear stale leaders at once
            elif (dict(body.get("metadata", {}).get("labels") or {}).get(ROLE_LABEL) == "leader"
                  and self._leads()):
                self._demote(name, body["metadata"].get("resourceVersion"))
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone, or changed since: a new event follows
                log.warning("pod label reconcile failed",
                            extra={"pod": name, "error": one_line(exc)})
        except Exception as exc:
            log.warning("pod label reconcile failed", extra={"pod": name,
                                                             "error": one_line(exc)})

    def _demote_others(self) -> None:
        assert self._access is not None
        selector = quote(f"{GROUP_LABEL}={self._group},{ROLE_LABEL}=leader")
        found = request(self._access.api, "GET",
                        f"{self._own.pods_path()}?labelSelector={selector}")
        for pod in found.get("items", []):
            meta = pod["metadata"]
            if meta["name"] != self._own.name and self._leads():
                with contextlib.suppress(ApiException):  # 404/409: a new event follows
                    self._demote(meta["name"], meta.get("resourceVersion"))

    def _demote(self, name: str, version: str | None) -> None:
        """Mark a pod that still says leader as standby; we hold the lease, it cannot."""
        assert self._access is not None
        patch: dict[str, Any] = {"metadata": {"labels": {ROLE_LABEL: "standby"}}}
        if version:  # only the version we judged: a newer write wins over our demotion
            patch["metadata"]["resourceVersion"] = version
        demoted = request(self._access.api, "PATCH", self._own.pods_path(name), patch,
                          content_type=MERGE_PATCH)
        log.info("demoted stale leader label", extra={
            "pod": name, "lease": self._state.lease, "identity": self._state.identity})
        if self.on_demoted is not None:
            self.on_demoted(demoted)


def create(settings: Settings, states: list[LeaseState]) -> PodLabelPublisher:
    return PodLabelPublisher(settings, states)
