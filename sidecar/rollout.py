"""Who can take the lease over, as the lease group's pods show it: the successor picked on
SIGTERM (``LEASE_SHUTDOWN_HANDOVER=youngest-ready``; the chart sets it where the pod label
is kept), and the check of ``POST /handover?to=``.

In a rolling update the leader's pod is replaced; a plain release lets any standby win,
often an old pod that is itself replaced seconds later, so leadership moves several
times per rollout. The youngest pod that can lead is the one a rollout keeps longest
(the newest revision's, once it is Ready). This module picks it from a LIST of the
pods carrying our group label (``lease-sidecar/group``, given at creation by the
injector and kept by the pod label publisher), listing again for a moment while a
younger pod's sidecar has not published yet; its pod name is its identity (the
sidecar's default). The elector then hands over to it
(:meth:`sidecar.elector.Elector.shutdown`).

A pod can lead (:func:`cannot_lead`) when its sidecar campaigns for our lease: it is
not being deleted, it is Ready, its sidecar says ``lease-role=standby`` (``api`` never
campaigns; no label: no sidecar of ours has published there yet) and its annotation
does not say it sits out (an application not ready under ``LEASE_APP_READY_URL``, which
the pod's own readiness need not show). A pick that cannot lead would make the other
standbys stand aside for nothing, so neither the successor nor a ``?to=`` is ever such
a pod. What the pod shows late (the annotation trails the sidecar by a PATCH) is bounded
by the hand-over hint's own lifetime (:meth:`sidecar.elector.Elector._name_successor`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import quote

from sidecar.appready import pod_problem
from sidecar.elector import successor_choice_bound
from sidecar.kubeapi import KubeClient, KubeError
from sidecar.publish.pod_label import GROUP_LABEL, ROLE_LABEL, group_value, note_of
from sidecar.settings import Settings

log = logging.getLogger("sidecar.rollout")

RELIST_EVERY = 0.2  # seconds between the LISTs of a shutdown waiting for a younger pod


def cannot_lead(pod: dict[str, Any], group: str,
                containers: tuple[str, ...] | None = None) -> str | None:
    """Why the sidecar of ``pod`` cannot take lease group ``group`` over; None if, as
    far as the pod shows, it can. ``containers``: the application containers that must
    be Ready too (``LEASE_APP_READY_CONTAINERS``, the same across a group)."""
    meta = pod.get("metadata") or {}
    name = meta.get("name") or "?"
    labels = meta.get("labels") or {}
    if meta.get("deletionTimestamp"):
        return f"pod {name} is terminating"
    if labels.get(GROUP_LABEL) != group:
        return f"pod {name} is not in lease group {group}"
    role = labels.get(ROLE_LABEL)
    if role == "api":
        return f"pod {name} runs its sidecar in role api, which never campaigns"
    if role != "standby":
        return f"pod {name} is not a standby of the group (lease-role {role or 'unset'})"
    conditions = (pod.get("status") or {}).get("conditions") or []
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
        return f"pod {name} is not Ready"
    if containers and (problem := pod_problem(pod, containers)) is not None:
        return f"pod {name}: {problem}"
    if (sits_out := note_of(meta).get("sits_out")) is not None:
        return f"pod {name}'s sidecar sits out ({sits_out})"
    return None


def _age(pod: dict[str, Any]) -> tuple[str, str]:
    """Sorts pods oldest first: RFC 3339 in UTC sorts as text; the name breaks ties
    (same second)."""
    meta = pod["metadata"]
    return meta.get("creationTimestamp") or "", meta["name"]


def youngest_ready(pods: list[dict[str, Any]], own: str, group: str,
                   containers: tuple[str, ...] | None = None) -> str | None:
    """The name of the youngest pod that is not ``own`` and can lead."""
    candidates = [p for p in pods if p["metadata"]["name"] != own
                  and cannot_lead(p, group, containers) is None]
    if not candidates:
        return None
    return str(max(candidates, key=_age)["metadata"]["name"])


def unpublished_younger(pods: list[dict[str, Any]], own: str, group: str,
                        than: str | None) -> str | None:
    """The youngest pod of ``group``, younger than the pod named ``than`` (any, if None)
    and not being deleted, whose sidecar has not published its role yet (no
    ``lease-role`` label). A rolling update deletes an old pod as soon as a new one is
    Ready, which can come before the new sidecar's first label write (about a second
    after it starts): such a pod is most likely the one the rollout keeps, worth a short
    wait rather than a hand-over to an old pod that is replaced seconds later."""
    ages = {p["metadata"]["name"]: _age(p) for p in pods}
    floor = ages.get(than) if than is not None else None
    starting = [p for p in pods
                if p["metadata"]["name"] != own
                and not p["metadata"].get("deletionTimestamp")
                and (p["metadata"].get("labels") or {}).get(GROUP_LABEL) == group
                and ROLE_LABEL not in (p["metadata"].get("labels") or {})
                and (floor is None or _age(p) > floor)]
    return str(max(starting, key=_age)["metadata"]["name"]) if starting else None


class GroupPods:
    """The lease group's pods; needs ``POD_NAME``/``POD_NAMESPACE``, the pod label (the
    group label), and the pod name as identity (:meth:`applies`)."""

    def __init__(self, settings: Settings) -> None:
        assert settings.pod_name and settings.pod_namespace
        self._own = settings.pod_name
        self._namespace = settings.pod_namespace
        self._group = group_value(settings.store.key(settings.name))
        self._containers = settings.app_ready_containers
        # Room for one more LIST within the elector's bound on the whole choice.
        self._patience = max(0.0, successor_choice_bound(settings.timing) - 0.5)

    @staticmethod
    def applies(settings: Settings, labelled: bool) -> bool:
        """Whether a sidecar with ``settings`` (``labelled``: it keeps the pod label)
        can tell its group's pods from their labels and name them by pod name."""
        return bool(labelled and settings.pod_name and settings.pod_namespace
                    and settings.identity == settings.pod_name)

    def _pods(self, name: str | None = None) -> str:
        path = f"/api/v1/namespaces/{quote(self._namespace)}/pods"
        return f"{path}/{quote(name, safe='')}" if name else path

    async def choose(self) -> str | None:
        """The successor at shutdown; None when there is none or the apiserver does not
        answer: then a plain release, first come wins. While a younger pod's sidecar has
        not published yet (:func:`unpublished_younger`) it lists again, every
        :data:`RELIST_EVERY`, for up to ``patience`` (within the elector's bound,
        :func:`sidecar.elector.successor_choice_bound`), then picks from what it saw."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._patience
        chosen: str | None = None
        waited_for: str | None = None
        client = KubeClient.connect(self._namespace)
        try:
            while True:
                listed = await client.list(self._pods(),
                                           labelSelector=f"{GROUP_LABEL}={self._group}")
                pods = listed.get("items") or []
                chosen = youngest_ready(pods, self._own, self._group, self._containers)
                starting = unpublished_younger(pods, self._own, self._group, chosen)
                if starting is None or loop.time() + RELIST_EVERY > deadline:
                    break
                if starting != waited_for:
                    log.info("shutdown: waiting for a younger pod whose sidecar has not "
                             "published yet", extra={"pod": starting, "else": chosen})
                    waited_for = starting
                await asyncio.sleep(RELIST_EVERY)
        except KubeError as exc:
            if waited_for is None:
                log.warning("cannot list the group's pods; releasing to whoever asks first",
                            extra={"error": str(exc)})
                return None
            # A list while waiting failed: the earlier answer's pick still stands.
            log.warning("cannot list the group's pods again; handing over to the pick of "
                        "the last answer", extra={"error": str(exc), "successor": chosen})
        finally:
            await client.close()
        log.info("shutdown: handing over to the youngest pod of the group that can lead",
                 extra={"successor": chosen, "group": self._group})
        return chosen

    async def refusal(self, to: str) -> tuple[str | None, str]:
        """``POST /handover?to=``: (why ``to`` cannot lead, or None; what was checked).
        An apiserver that does not answer refuses nothing: the hand-over goes on
        unchecked (its hint is bounded)."""
        client = KubeClient.connect(self._namespace)
        try:
            pod = await client.get_or_none(self._pods(to))
        except KubeError as exc:
            return None, f"not checked (cannot read pod {to}: {exc})"
        finally:
            await client.close()
        if pod is None:
            return (f"no pod {to} in namespace {self._namespace} (identities here are "
                    f"pod names)"), "checked"
        if GROUP_LABEL not in ((pod.get("metadata") or {}).get("labels") or {}):
            # Not a sidecar's pod: perhaps a client-go elector's, which can take the
            # lease over; its pod shows only whether it is going away.
            meta = pod.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                return f"pod {to} is terminating", "checked"
            return None, f"pod {to} carries no {GROUP_LABEL} label: only checked it stays"
        return cannot_lead(pod, self._group, self._containers), "checked"
