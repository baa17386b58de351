"""On SIGTERM in a pod, hand the lease to the youngest Ready pod of the group
(``LEASE_SHUTDOWN_HANDOVER=youngest-ready``; the chart sets it where the pod label is
kept).

In a rolling update the leader's pod is replaced; a plain release lets any standby win,
often an old pod that is itself replaced seconds later, so leadership moves several
times per rollout. The youngest Ready pod is the one a rollout keeps longest (the newest
revision's, once it is Ready). This module picks it from one LIST of the pods carrying
our group label (``lease-sidecar/group``, kept by the pod label publisher): not our
own, not being deleted, condition ``Ready`` true; the youngest by creation time. Its
pod name is its identity (the sidecar's default). The elector then hands over to it
(:meth:`sidecar.elector.Elector.shutdown`): the other standbys stand aside for at most
one lease duration, so a pick that cannot take over costs at most that.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

from sidecar.kubeapi import KubeClient, KubeError
from sidecar.publish.pod_label import GROUP_LABEL, group_value
from sidecar.settings import Settings

log = logging.getLogger("sidecar.rollout")


def youngest_ready(pods: list[dict[str, Any]], own: str) -> str | None:
    """The name of the youngest Ready pod that is not ``own`` and not being deleted."""
    def ready(pod: dict[str, Any]) -> bool:
        conditions = (pod.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in conditions)

    candidates = [p for p in pods
                  if p["metadata"]["name"] != own and not p["metadata"].get("deletionTimestamp")
                  and ready(p)]
    if not candidates:
        return None
    # RFC 3339 in UTC sorts as text; the name breaks ties (same second).
    youngest = max(candidates, key=lambda p: (p["metadata"].get("creationTimestamp") or "",
                                              p["metadata"]["name"]))
    return str(youngest["metadata"]["name"])


class ShutdownSuccessor:
    """Chooses the successor at shutdown; None when there is none or the apiserver does
    not answer (the caller bounds the wait): then a plain release, first come wins."""

    def __init__(self, settings: Settings) -> None:
        assert settings.pod_name and settings.pod_namespace
        self._own = settings.pod_name
        self._namespace = settings.pod_namespace
        self._group = group_value(settings.store.key(settings.name))

    async def choose(self) -> str | None:
        client = KubeClient.connect(self._namespace)
        try:
            listed = await client.list(f"/api/v1/namespaces/{quote(self._namespace)}/pods",
                                       labelSelector=f"{GROUP_LABEL}={self._group}")
        except KubeError as exc:
            log.warning("cannot list the group's pods; releasing to whoever asks first",
                        extra={"error": str(exc)})
            return None
        finally:
            await client.close()
        chosen = youngest_ready(listed.get("items") or [], self._own)
        log.info("shutdown: handing over to the youngest Ready pod of the group",
                 extra={"successor": chosen, "group": self._group})
        return chosen
