"""Who can take the lease over, as the lease group's pods show it: the successor picked on
SIGTERM (``LEASE_SHUTDOWN_HANDOVER=youngest-ready``; the chart sets it where the pod label
is kept), and the check of ``POST /handover?to=``.

In a rolling update the leader's pod is replaced; a plain release lets any standby win,
often an old pod that is itself replaced seconds later, so leadership moves several
times per rollout. The youngest pod that can lead is the one a rollout keeps longest
(the newest revision's, once it is Ready). This module picks it from one LIST of the
pods carrying our group label (``lease-sidecar/group``, kept by the pod label
publisher); its pod name is its identity (the sidecar's default). The elector then
hands over to it (:meth:`sidecar.elector.Elector.shutdown`).

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

import logging
from typing import Any
from urllib.parse import quote

from sidecar.appready import pod_problem
from sidecar.kubeapi import KubeClient, KubeError
from sidecar.publish.pod_label import GROUP_LABEL, ROLE_LABEL, group_value, note_of
from sidecar.settings import Settings

log = logging.getLogger("sidecar.rollout")


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


def youngest_ready(pods: list[dict[str, Any]], own: str, group: str,
                   containers: tuple[str, ...] | None = None) -> str | None:
    """The name of the youngest pod that is not ``own`` and can lead."""
    candidates = [p for p in pods if p["metadata"]["name"] != own
                  and cannot_lead(p, group, containers) is None]
    if not candidates:
        return None
    # RFC 3339 in UTC sorts as text; the name breaks ties (same second).
    youngest = max(candidates, key=lambda p: (p["metadata"].get("creationTimestamp") or "",
                                              p["metadata"]["name"]))
    return str(youngest["metadata"]["name"])


class GroupPods:
    """The lease group's pods; needs ``POD_NAME``/``POD_NAMESPACE``, the pod label (the
    group label), and the pod name as identity (:meth:`applies`)."""

    def __init__(self, settings: Settings) -> None:
        assert settings.pod_name and settings.pod_namespace
        self._own = settings.pod_name
        self._namespace = settings.pod_namespace
        self._group = group_value(settings.store.key(settings.name))
        self._containers = settings.app_ready_containers

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
        answer (the caller bounds the wait): then a plain release, first come wins."""
        client = KubeClient.connect(self._namespace)
        try:
            listed = await client.list(self._pods(),
                                       labelSelector=f"{GROUP_LABEL}={self._group}")
        except KubeError as exc:
            log.warning("cannot list the group's pods; releasing to whoever asks first",
                        extra={"error": str(exc)})
            return None
        finally:
            await client.close()
        chosen = youngest_ready(listed.get("items") or [], self._own, self._group,
                                self._containers)
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
