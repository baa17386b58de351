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
and are validated here with the sidecar's own rules (for the kubernetes backend, the
Lease object name rule of :mod:`sidecar.names`), so a typo rejects the Pod with a clear
message instead of producing a crash-looping sidecar.

The lease name is required: a Pod without ``lease-sidecar/name`` is refused. A default
would make every injected workload of a namespace contend for one lease, so only one
pod across all of them would ever lead, with no error anywhere. Deriving a name from the
workload was considered and rejected: a ReplicaSet owner's name changes with every
rollout (two leases during a rolling update), a CronJob's Jobs are named per run, a bare
Pod has only its own name (every pod would lead), and ``app.kubernetes.io/name`` is
shared by two releases of one chart. When the chart's Role grants only named Leases the
spec lists them (``leaseObjects``) and a name outside that list is refused too: its
sidecar could never write its Lease and would fail closed, silently.

Only ``CREATE`` is mutated: a sidecar cannot be added to a running Pod, and the
apiserver refuses most changes of a Pod's spec on ``UPDATE`` anyway.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.config import ROLES, parse_names
from sidecar.names import object_name_problem, prefixed

OPT_IN_LABEL = "lease-sidecar/inject"
INJECTED_ANNOTATION = "lease-sidecar/injected"
NAME_ANNOTATION = "lease-sidecar/name"
# Annotation → the sidecar env variable it overrides, and how to validate it.
OVERRIDES = {
    NAME_ANNOTATION: "LEASE_NAME",
    "lease-sidecar/role": "LEASE_ROLE",
}
# What the sidecar assumes when the chart-rendered spec does not say (sidecar.config).
DEFAULT_KEY_PREFIX = "lease-sidecar"


class InjectionError(ValueError):
    """The Pod opted in but asks for something invalid; the message goes to the user."""


@dataclass(frozen=True)
class InjectionSpec:
    """The chart-rendered sidecar: its container, volumes, and what app containers get."""

    container: dict[str, Any]
    volumes: list[dict[str, Any]]
    app_mount: dict[str, Any]
    app_env: list[dict[str, Any]]
    # The Lease objects the release's Role grants, when it grants only named ones (the
    # kubernetes backend with a name-limited Role); None: no such limit to check.
    lease_objects: tuple[str, ...] | None = None

    @property
    def container_name(self) -> str:
        return str(self.container["name"])

    def env(self, name: str) -> str | None:
        """The sidecar's literal env value ``name`` (the last one wins, as in a Pod)."""
        found = None
        for item in self.container.get("env") or []:
            if item.get("name") == name and "value" in item:
                found = str(item["value"])
        return found

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InjectionSpec:
        try:
            objects = data.get("leaseObjects")
            spec = cls(container=dict(data["container"]), volumes=list(data["volumes"]),
                       app_mount=dict(data["appMount"]), app_env=list(data.get("appEnv", [])),
                       lease_objects=None if objects is None else tuple(map(str, objects)))
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


def _list_of_maps(value: Any) -> bool:
    return value is None or (isinstance(value, list) and all(isinstance(v, dict) for v in value))


def _map_of_strings(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()))


def pod_problem(pod: Any) -> str | None:
    """What in ``pod`` has a shape no Pod can have, among the parts injection touches.

    The apiserver only sends well-formed Pods; anyone else reaching the webhook gets one
    clear line instead of a Python error.
    """
    if not isinstance(pod, dict):
        return "the object is not a map"
    metadata = pod.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        return "metadata is not a map"
    for key in ("labels", "annotations"):
        if not _map_of_strings((metadata or {}).get(key)):
            return f"metadata.{key} is not a map of strings"
    spec = pod.get("spec")
    if spec is not None and not isinstance(spec, dict):
        return "spec is not a map"
    for key in ("initContainers", "containers", "volumes"):
        if not _list_of_maps((spec or {}).get(key)):
            return f"spec.{key} is not a list of maps"
    for key in ("initContainers", "containers"):
        for i, container in enumerate((spec or {}).get(key) or []):
            for field in ("env", "volumeMounts"):
                if not _list_of_maps(container.get(field)):
                    return f"spec.{key}[{i}].{field} is not a list of maps"
    return None


def opted_in(pod: dict[str, Any]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(OPT_IN_LABEL) == "true"


def already_injected(pod: dict[str, Any], spec: InjectionSpec) -> bool:
    """A sidecar of ours is there already, or another injector (a second release whose
    webhook also matched this pod) has injected one: never inject twice."""
    if INJECTED_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {}):
        return True
    pod_spec = pod.get("spec") or {}
    names = {c.get("name") for c in pod_spec.get("initContainers") or []}
    names |= {c.get("name") for c in pod_spec.get("containers") or []}
    return spec.container_name in names


def check_names(value: str, spec: InjectionSpec) -> None:
    """``ValueError`` unless the sidecar would accept ``value`` as its LEASE_NAME and,
    with a name-limited Role, that Role grants every Lease it names."""
    names = parse_names(value)
    if spec.env("LEASE_BACKEND") != "kubernetes":
        return
    env_prefix = spec.env("LEASE_KEY_PREFIX")
    prefix = DEFAULT_KEY_PREFIX if env_prefix is None else env_prefix
    for name in names:
        problem = object_name_problem(prefix, name)
        if problem:
            raise ValueError(problem)
    if spec.lease_objects is None:
        return
    for name in names:
        lease = prefixed(prefix, name)
        if lease not in spec.lease_objects:
            raise ValueError(
                f"the release's Role does not grant the Lease {lease!r} (it grants "
                f"{', '.join(spec.lease_objects) or 'none'}): add {name!r} to the chart "
                f"value rbac.leaseNames, or set rbac.anyLease=true")


def _overrides(pod: dict[str, Any], spec: InjectionSpec) -> dict[str, str]:
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    if not str(annotations.get(NAME_ANNOTATION, "")).strip():
        raise InjectionError(
            f"the pod has no {NAME_ANNOTATION} annotation: name the lease its workload "
            f"contends for (the same name on every pod of one workload, another name for "
            f"every other workload), for example {NAME_ANNOTATION}: my-app")
    env: dict[str, str] = {}
    for annotation, variable in OVERRIDES.items():
        if annotation not in annotations:
            continue
        value = str(annotations[annotation]).strip()
        try:
            if variable == "LEASE_ROLE" and value not in ROLES:
                raise ValueError(f"{value!r} is not one of {', '.join(ROLES)}")
            if variable == "LEASE_NAME":
                check_names(value, spec)
        except ValueError as exc:
            raise InjectionError(f"annotation {annotation}: {exc}") from None
        env[variable] = value
    return env


def _sidecar(spec: InjectionSpec, overrides: dict[str, str]) -> dict[str, Any]:
    """The spec's container with ``overrides`` in place of those variables (same order,
    so a variable that refers to another with $(NAME) still comes after it)."""
    container = copy.deepcopy(spec.container)
    env: list[dict[str, Any]] = []
    for item in container.get("env", []):
        name = item.get("name")
        if name in overrides:
            if name not in {e.get("name") for e in env}:
                env.append({"name": name, "value": overrides[name]})
        else:
            env.append(item)
    present = {e.get("name") for e in env}
    env += [{"name": name, "value": value} for name, value in overrides.items()
            if name not in present]
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
    problem = pod_problem(pod)
    if problem:
        raise InjectionError(f"malformed pod: {problem}")
    if not opted_in(pod) or already_injected(pod, spec):
        return False
    overrides = _overrides(pod, spec)  # validate before touching anything
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
