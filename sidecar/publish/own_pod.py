"""The pod this sidecar runs in, as the pod label and the events publishers address it
in the API (both need ``POD_NAME`` and ``POD_NAMESPACE``; both talk to the apiserver
through :mod:`sidecar.kubeapi`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from sidecar.base.errors import ConfigError
from sidecar.settings import Settings


@dataclass(frozen=True)
class OwnPod:
    name: str
    namespace: str

    @classmethod
    def of(cls, settings: Settings, needed_by: str) -> OwnPod:
        """``needed_by`` begins the error: "the pod label needs", "pod events need"."""
        if not (settings.pod_name and settings.pod_namespace):
            raise ConfigError(f"{needed_by} POD_NAME and POD_NAMESPACE")
        return cls(settings.pod_name, settings.pod_namespace)

    def pods_path(self, name: str | None = None) -> str:
        """The pods of our namespace, or one of them by ``name``."""
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        return f"{path}/{quote(name)}" if name else path

    def events_path(self, name: str | None = None) -> str:
        """The Events of our namespace, or one of them by ``name``."""
        path = f"/api/v1/namespaces/{self.namespace}/events"
        return f"{path}/{quote(name)}" if name else path

    def reference(self, meta: dict[str, Any]) -> dict[str, str]:
        """The ObjectReference of a pod (``kubectl describe`` matches on its uid)."""
        return {"apiVersion": "v1", "kind": "Pod",
                "namespace": meta.get("namespace") or self.namespace,
                "name": meta["name"], "uid": meta["uid"]}
