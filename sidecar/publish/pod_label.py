"""The ``lease-role`` pod label, so ``kubectl get pods -L lease-role`` shows who leads.

Our pod carries ``lease-role=leader|standby|api``, the group label
``lease-sidecar/group=<lease object>`` and the annotation ``lease-sidecar/lease`` (JSON:
lease, identity, role, fencing token, the lease object and the backend; while leading
the claim's ``valid_until`` at the time of the write, what the operator compares across a
group on the database backends; while the sidecar sits out, ``sits_out`` with the
reason, so hand-overs pass the pod by). The label follows the *first* lease name.

What the sidecar writes, with plain PATCHes (:mod:`sidecar.kubeapi`, no kopf):

- ``changed()``: the elector awaits it on every transition (bounded by 2 s). It PATCHes our
  own pod and returns once the apiserver accepted the patch, which is what makes "unpublish,
  then release" hold for the label: the label says ``standby`` before the lease is given
  back, and says ``leader`` only after the lease was acquired.
- When our term begins, one LIST of the namespace's pods labelled ``leader`` and a PATCH
  to ``standby`` for each other pod of our group (a holder killed without cleanup, a
  label set by hand; found by its group label or, if that was edited, by its
  annotation's lease object), each guarded by the resourceVersion we judged and done only
  while we still lead. So without any operator, every leadership change leaves at most
  one ``leader`` pod in the group.
- Labels converge: a failed write (apiserver down, ``patch`` on pods revoked) is retried
  with backoff (at most :data:`RETRY_MAX` apart) until it succeeds, demotion included, so
  the labels are right within seconds of the apiserver and the permissions coming back.

What only the operator does (``lease-sidecar operator``, docs/operator.md): putting back,
within a second, any label someone edited by hand and any group label (the sidecar never
reads its own pod back: an edit stays until its next transition, or, for a ``leader``
label, the group's next leadership change), and demoting a stale ``leader`` between
leadership changes (a holder killed with nobody to take over).

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.kubeapi import KubeClient, KubeError
from sidecar.publish import claim_body
from sidecar.publish.own_pod import OwnPod
from sidecar.settings import Settings
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.publish.pod_label")

ROLE_LABEL = "lease-role"
GROUP_LABEL = "lease-sidecar/group"
ANNOTATION = "lease-sidecar/lease"
RETRY_FIRST = 0.2  # seconds before the first retry of a failed label write
RETRY_MAX = 2.0  # seconds: the longest wait between retries (labels right within 5 s)
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def group_value(object_name: str) -> str:
    """A label value naming the lease group: the Lease object name, hashed if too long."""
    if _LABEL_VALUE.match(object_name):
        return object_name
    digest = hashlib.sha256(object_name.encode()).hexdigest()[:12]
    head = re.sub(r"[^A-Za-z0-9_.-]", "-", object_name)[:50].strip("-_.")
    return f"{head}-{digest}" if head else digest


def note_of(meta: dict[str, Any]) -> dict[str, Any]:
    """A pod's ``lease-sidecar/lease`` annotation, parsed; {} if missing or malformed."""
    try:
        note = json.loads(meta["annotations"][ANNOTATION])
    except (KeyError, TypeError, ValueError):
        return {}
    return note if isinstance(note, dict) else {}




@dataclass(frozen=True)
class Desired:
    """What our own pod should show."""

    role: str  # leader | standby | api
    annotation: str  # JSON

    def patch(self, group: str) -> dict[str, Any]:
        return {"metadata": {"labels": {ROLE_LABEL: self.role, GROUP_LABEL: group},
                             "annotations": {ANNOTATION: self.annotation}}}


class PodLabelPublisher:
    def __init__(self, settings: Settings, states: list[LeaseState]) -> None:
        self._own = OwnPod.of(settings, "the pod label needs")
        self._settings = settings
        self._state = states[0]
        self._object = settings.store.key(settings.name)
        self._group = group_value(self._object)
        self._client: KubeClient | None = None
        self._desired = self._compute()
        self._applied: Desired | None = None  # the last view the apiserver accepted
        self._swept: Desired | None = None  # the leader view whose demotions are done
        self._write = asyncio.Lock()  # our own-pod patches go out in the elector's order
        self._wake = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None
        self._failing = False
        # Told each pod we demoted (the PATCH's answer); the events publisher reports it.
        self.on_demoted: Callable[[dict[str, Any]], None] | None = None

    # -- Publisher -----------------------------------------------------------------------
    async def start(self) -> None:
        try:
            self._client = KubeClient.connect(self._own.namespace)
        except KubeError as exc:
            # Advisory: missing credentials must not stop the sidecar (the lease backend,
            # if it is kubernetes, reports the same cause on /readyz).
            log.warning("pod label off", extra={"pod": self._own.name, "error": str(exc)})
            return
        self._keeper = asyncio.create_task(self._keep(), name="pod-label")
        self._wake.set()

    async def changed(self, state: LeaseState) -> None:
        if state is not self._state or self._client is None:
            return
        self._desired = self._compute()
        try:
            await self._sync_own_pod()
        except KubeError as exc:
            raise RuntimeError(f"pod label: {exc}") from None
        finally:
            self._wake.set()  # the keeper retries a failure and sweeps a new term

    async def stop(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        if self._client is not None:
            await self._client.close()

    # -- what we publish -----------------------------------------------------------------
    def _compute(self) -> Desired:
        """Read from the state on the event loop (``claim()`` moves ``issued_until``).

        The label has no expiry, so ``issued_until`` does not cover it: a ``leader``
        label stays until the next PATCH. What takes it down before a release is the
        elector awaiting :meth:`changed` (bounded, see the module docstring).
        """
        state = self._state
        # ``object`` and ``backend`` let the operator find the group's truth (the Lease
        # object, or the tokens across the group) even when the group label was edited.
        fields: dict[str, Any] = {"lease": state.lease, "identity": state.identity,
                                  "object": self._object, "backend": self._settings.store.backend}
        if self._settings.role == "api":
            fields.update(role="api", fencing_token=None)
        else:
            claim = state.claim()
            body = claim_body(state, claim)
            fields.update(role="leader" if claim.leader else "standby",
                          fencing_token=body["fencing_token"])
            if claim.leader:
                fields["valid_until"] = body["valid_until"]
            if state.facts.sitting_out is not None:
                fields["sits_out"] = state.facts.sitting_out
        return Desired(fields["role"], json.dumps(fields, sort_keys=True))

    async def _sync_own_pod(self) -> None:
        assert self._client is not None
        async with self._write:
            desired = self._desired
            if desired == self._applied:
                return
            await self._client.patch(self._own.pods_path(self._own.name),
                                     desired.patch(self._group))
            self._applied = desired

    def _leads(self) -> bool:
        """The claim rule without handing out a claim (:meth:`Facts.leads_at` writes
        nothing)."""
        return self._state.facts.leads_at(self._state.clock.monotonic())

    # -- convergence ---------------------------------------------------------------------
    async def _keep(self) -> None:
        """Until stopped: bring our pod to the desired view and, at the start of a term,
        demote the group's other ``leader`` pods; retry failures with backoff."""
        delay = RETRY_FIRST
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._sync_own_pod()
                desired = self._desired
                if desired.role == "leader" and self._swept != desired and self._leads():
                    await self._demote_others()
                    self._swept = desired
            except KubeError as exc:
                if not self._failing:
                    log.warning("pod label write failed; retrying until it works",
                                extra={"pod": self._own.name, "error": str(exc)})
                self._failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                self._wake.set()
                continue
            if self._failing:
                log.info("pod label written again", extra={"pod": self._own.name})
            self._failing, delay = False, RETRY_FIRST

    async def _demote_others(self) -> None:
        """One LIST of the namespace's ``leader`` pods, a guarded PATCH to ``standby`` for
        each other one of our group: by its group label, or by its annotation's lease
        object when its group label was edited. Nothing else: the pod-patch policy
        (deploy/pod-patch-policy.yaml) lets a sidecar change another pod only from
        ``leader`` to ``standby``."""
        assert self._client is not None
        found = await self._client.list(self._own.pods_path(),
                                        labelSelector=f"{ROLE_LABEL}=leader")
        for pod in found.get("items", []):
            meta = pod["metadata"]
            ours = ((meta.get("labels") or {}).get(GROUP_LABEL) == self._group
                    or note_of(meta).get("object") == self._object)
            if not ours or meta["name"] == self._own.name or not self._leads():
                continue
            patch = {"metadata": {"labels": {ROLE_LABEL: "standby"},
                                  # only the version we judged: a newer write wins
                                  "resourceVersion": meta.get("resourceVersion")}}
            try:
                demoted = await self._client.patch(
                    self._own.pods_path(meta["name"]), patch)
            except KubeError as exc:
                if exc.status == 404:
                    continue  # gone: nothing to demote
                raise  # 409 (changed since we listed) included: list again
            log.info("demoted stale leader label", extra={
                "pod": meta["name"], "lease": self._state.lease,
                "identity": self._state.identity})
            if self.on_demoted is not None:
                self.on_demoted(demoted)


def create(settings: Settings, states: list[LeaseState]) -> PodLabelPublisher:
    return PodLabelPublisher(settings, states)
