"""What injection does to a Pod, as a pure function over the Pod's JSON.

The sidecar itself is not described here: the Helm chart renders it (the same named
template its own example workload uses) into a JSON file the injector reads, so the
injected sidecar and the chart's sidecar cannot drift apart. This module only places
that spec into a Pod:

* the sidecar goes first in ``initContainers`` (a native sidecar, ``restartPolicy:
  Always``), so it starts before the app and any other init container, and stops after;
* the spec's volumes are added unless the Pod already has a volume of that name;
* every app container gets the lease directory mounted read-only and the spec's app
  env (``LEASE_LEADER_FILE`` / ``LEASE_LEADER_URL``) unless it sets those names itself.

Per-pod settings come from annotations (``lease-sidecar/name``, ``lease-sidecar/role``)
and are validated here with the sidecar's own parsers, so a typo rejects the Pod with a
clear message instead of producing a crash-looping sidecar.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.config import ROLES, parse_names

OPT_IN_LABEL = "lease-sidecar/inject"
INJECTED_ANNOTATION = "lease-sidecar/injected"
# Annotation → the sidecar env variable it overrides, and how to validate it.
OVERRIDES = {
    "lease-sidecar/name": "LEASE_NAME",
    "lease-sidecar/role": "LEASE_ROLE",
}


class InjectionError(ValueError):
    """The Pod opted in but asks for something invalid; the message goes to the user."""


@dataclass(frozen=True)
class InjectionSpec:
    """The chart-rendered sidecar: its container, volumes, and what app containers get."""

    container: dict[str, Any]
    volumes: list[dict[str, Any]]
    app_mount: dict[str, Any]
    app_env: list[dict[str, Any]]

    @property
    def container_name(self) -> str:
        return str(self.container["name"])

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InjectionSpec:
        try:
            spec = cls(container=dict(data["container"]), volumes=list(data["volumes"]),
                       app_mount=dict(data["appMount"]), app_env=list(data.get("appEnv", [])))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"injection spec lacks or mistypes {exc}") from None
        if spec.container.get("restartPolicy") != "Always" or "name" not in spec.container:
            raise ValueError("injection spec: the container must be a named native sidecar "
                             "(restartPolicy: Always)")
        return spec

    @classmethod
    def load(cls, path: str | Path) -> InjectionSpec:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except OSError as exc:
            raise ValueError(f"cannot read injection spec {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"injection spec {path} is not JSON: {exc}") from None


def opted_in(pod: dict[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(OPT_IN_LABEL) == "true"


def already_injected(pod: dict[str, Any], spec: InjectionSpec) -> bool:
    pod_spec = pod.get("spec") or {}
    names = {c.get("name") for c in pod_spec.get("initContainers") or []}
    names |= {c.get("name") for c in pod_spec.get("containers") or []}
    return spec.container_name in names


def _overrides(pod: dict[str, Any]) -> dict[str, str]:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    env: dict[str, str] = {}
    for annotation, variable in OVERRIDES.items():
        if annotation not in annotations:
            continue
        value = str(annotations[annotation]).strip()
        try:
            if variable == "LEASE_ROLE" and value not in ROLES:
                raise ValueError(f"{value!r} is not one of {', '.join(ROLES)}")
            if variable == "LEASE_NAME":
                parse_names(value)
        except ValueError as exc:
            raise InjectionError(f"annotation {annotation}: {exc}") from None
        env[variable] = value
    return env


def _sidecar(spec: InjectionSpec, overrides: dict[str, str]) -> dict[str, Any]:
    container = copy.deepcopy(spec.container)
    env = [e for e in container.get("env", []) if e.get("name") not in overrides]
    env += [{"name": name, "value": value} for name, value in overrides.items()]
    container["env"] = env
    return container


def _mount_app(container: dict[str, Any], spec: InjectionSpec) -> None:
    mounts = container.setdefault("volumeMounts", [])
    taken = any(m.get("mountPath") == spec.app_mount["mountPath"]
                or m.get("name") == spec.app_mount["name"] for m in mounts)
    if not taken:
        mounts.append(copy.deepcopy(spec.app_mount))
    env = container.setdefault("env", [])
    present = {e.get("name") for e in env}
    env.extend(copy.deepcopy(e) for e in spec.app_env if e["name"] not in present)


def inject(pod: dict[str, Any], spec: InjectionSpec) -> bool:
    """Add the sidecar to ``pod`` in place; False (and no change) when not wanted.

    Idempotent: a Pod that already has a container of the sidecar's name is left alone,
    whether we injected it before or the user declared the sidecar by hand.
    """
    if not opted_in(pod) or already_injected(pod, spec):
        return False
    overrides = _overrides(pod)  # validate before touching anything
    pod_spec = pod.setdefault("spec", {})
    pod_spec["initContainers"] = [_sidecar(spec, overrides),
                                  *(pod_spec.get("initContainers") or [])]
    volumes = pod_spec.setdefault("volumes", [])
    present = {v.get("name") for v in volumes}
    volumes.extend(copy.deepcopy(v) for v in spec.volumes if v["name"] not in present)
    for container in pod_spec.get("containers") or []:
        _mount_app(container, spec)
    metadata = pod.setdefault("metadata", {})
    annotations = metadata.get("annotations") or {}
    metadata["annotations"] = {**annotations, INJECTED_ANNOTATION: spec.container_name}
    return True
