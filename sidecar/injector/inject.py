"""What injection does to a Pod, as a pure function over the Pod's JSON.

The sidecar itself is not described here: the Helm chart renders it (the same named
template its own example workload uses) into a JSON file the injector reads, so the
injected sidecar and the chart's sidecar cannot drift apart. This module only places
that spec into a Pod:

* the sidecar goes first in ``initContainers`` (a native sidecar, ``restartPolicy:
  Always``), so it starts before the app and any other init container, and stops after;
* the spec's volumes are added;
* every app container gets the lease directory mounted read-only and the spec's app
  env (``LEASE_LEADER_FILE`` / ``LEASE_LEADER_URL``) unless it sets those names itself.

A Pod the sidecar could not serve is refused, each case with its own message
(:func:`conflict`), rather than injected with a sidecar that fails closed silently:
no ServiceAccount token while the sidecar needs the API, an app mount at the state
directory, a volume named like one of the sidecar's, an app port equal to the sidecar's,
``hostNetwork``. The names checked come from the chart-rendered spec (the state
directory from ``appMount``, the volumes, the container's port), never from here.

Per-pod settings come from annotations (``lease-sidecar/name``, ``lease-sidecar/role``)
and are validated here with the sidecar's own rules (for the kubernetes backend, the
Lease object name rule of :mod:`sidecar.base.names`), so a typo rejects the Pod with a clear
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

from sidecar.base.names import object_name_problem, prefixed
from sidecar.config import ROLES, parse_names
from sidecar.publish.pod_label import GROUP_LABEL, group_value

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
DEFAULT_POD_LABEL = "auto"
# Where Kubernetes mounts a ServiceAccount token and where in-cluster clients read it
# (token and ca.crt): the convention of kubelet and every client library.
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


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

    @property
    def state_dir(self) -> str:
        """Where the lease directory is mounted (in the sidecar and every app container)."""
        return str(self.app_mount["mountPath"])

    @property
    def volume_names(self) -> set[str]:
        return {str(v["name"]) for v in self.volumes}

    @property
    def ports(self) -> set[int]:
        """The ports the sidecar listens on (its HTTP port)."""
        return {int(p["containerPort"]) for p in self.container.get("ports") or []
                if "containerPort" in p}

    def env(self, name: str) -> str | None:
        """The sidecar's literal env value ``name`` (the last one wins, as in a Pod)."""
        found = None
        for item in self.container.get("env") or []:
            if item.get("name") == name and "value" in item:
                found = str(item["value"])
        return found

    def sets(self, name: str) -> bool:
        """The sidecar's env has ``name``, as a value or from a field (POD_NAME)."""
        return any(item.get("name") == name for item in self.container.get("env") or [])

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
            for field in ("env", "volumeMounts", "ports"):
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


def key_prefix(spec: InjectionSpec) -> str:
    """The sidecar's key prefix: as in :func:`sidecar.config.load`, an empty variable
    counts as unset (only the ``--key-prefix`` flag can make it empty)."""
    return spec.env("LEASE_KEY_PREFIX") or DEFAULT_KEY_PREFIX


def check_names(value: str, spec: InjectionSpec) -> None:
    """``ValueError`` unless the sidecar would accept ``value`` as its LEASE_NAME and,
    with a name-limited Role, that Role grants every Lease it names."""
    names = parse_names(value)
    if spec.env("LEASE_BACKEND") != "kubernetes":
        return
    prefix = key_prefix(spec)
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


def group_label(spec: InjectionSpec, overrides: dict[str, str]) -> str | None:
    """The ``lease-sidecar/group`` label the sidecar will give its pod, so the pod has it
    from creation: a rolling update deletes an old pod as soon as a new one is Ready,
    which can be before the new sidecar's first label write, and a leader handing over
    to the youngest Ready pod finds the group's pods by this label. None where the
    sidecar keeps no pod label or its names are not literal values."""
    if (spec.env("LEASE_POD_LABEL") or DEFAULT_POD_LABEL) == "off":
        return None
    names = overrides.get("LEASE_NAME") or spec.env("LEASE_NAME")
    if not names:
        return None
    return group_value(prefixed(key_prefix(spec), parse_names(names)[0]))


def needs_api(spec: InjectionSpec, overrides: dict[str, str]) -> str | None:
    """What the injected sidecar needs the Kubernetes API for (a few words for messages);
    None if nothing: then it runs without a ServiceAccount token. The rules of
    sidecar.runtime (pod_label_wanted) and sidecar.config, read off the spec's env."""
    reasons = []
    role = overrides.get("LEASE_ROLE") or spec.env("LEASE_ROLE") or "all"
    if spec.env("LEASE_BACKEND") == "kubernetes" and role != "api":
        reasons.append("its Lease (kubernetes backend)")
    label = spec.env("LEASE_POD_LABEL") or DEFAULT_POD_LABEL
    if label == "on" or (label == "auto" and spec.sets("POD_NAME")
                         and spec.sets("POD_NAMESPACE")):
        reasons.append("the lease-role label and pod Events (lease.podLabel)")
    return " and ".join(reasons) or None


def _token_sources(volume: dict[str, Any]) -> list[dict[str, Any]]:
    """The sources of a projected volume ([] for any other volume)."""
    projected = volume.get("projected")
    sources = projected.get("sources") if isinstance(projected, dict) else None
    return [s for s in sources or [] if isinstance(s, dict)]


def _token_problem(volume: dict[str, Any]) -> str | None:
    """Why ``volume`` does not give an in-cluster client its ServiceAccount credentials
    (``token`` and ``ca.crt``, as ServiceAccount admission projects them); None if it does."""
    sources = _token_sources(volume)
    if not any((s.get("serviceAccountToken") or {}).get("path") == "token" for s in sources):
        return "no serviceAccountToken source with path token"
    for source in sources:
        config_map = source.get("configMap")
        items = config_map.get("items") if isinstance(config_map, dict) else None
        if isinstance(config_map, dict) and (not items or any(
                isinstance(i, dict) and i.get("path") == "ca.crt" for i in items)):
            return None
    return "no configMap source giving ca.crt"


def _own_token_volume(pod: dict[str, Any]) -> str | None:
    """The pod volume holding a ServiceAccount token and CA (the one ServiceAccount
    admission adds, or one the pod projects itself); None if there is none."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        if _token_problem(volume) is None:
            return str(volume.get("name"))
    return None


def _containers(pod: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    spec = pod.get("spec") or {}
    return [(key, c) for key in ("initContainers", "containers") for c in spec.get(key) or []]


def _under(path: str, directory: str) -> bool:
    """``path`` is ``directory`` or inside it (trailing slashes aside)."""
    path, directory = path.rstrip("/"), directory.rstrip("/")
    return path == directory or path.startswith(directory + "/")


def conflict(pod: dict[str, Any], spec: InjectionSpec, overrides: dict[str, str]) -> str | None:
    """Why the sidecar could not serve ``pod`` (one line for the admission answer); None
    if nothing stands in its way. Each case has its own message."""
    pod_spec = pod.get("spec") or {}
    if pod_spec.get("hostNetwork") is True:
        return ("hostNetwork: true: the sidecar would listen on the node's network, so its "
                "/status, /metrics and the loopback-only POST /release would be open to "
                "every process on the node, and two such pods on one node would need the "
                f"same port ({', '.join(map(str, sorted(spec.ports)))}); run the pod "
                "without hostNetwork, or declare the sidecar in its manifest yourself")
    volumes = spec.volume_names
    for volume in pod_spec.get("volumes") or []:
        if volume.get("name") in volumes:
            return (f"the pod already has a volume named {volume['name']!r}, the name of "
                    f"the sidecar's own volume ({', '.join(sorted(volumes))}): rename it")
    for key, container in _containers(pod):
        for mount in container.get("volumeMounts") or []:
            where = f"container {container.get('name')!r} ({key})"
            if mount.get("name") in volumes:
                return (f"{where} mounts a volume named {mount['name']!r}, the name of the "
                        f"sidecar's own volume: rename it")
            if key == "containers" and _under(str(mount.get("mountPath", "")), spec.state_dir):
                return (f"{where} already mounts {mount.get('name')!r} at "
                        f"{mount.get('mountPath')}, inside the sidecar's state directory "
                        f"{spec.state_dir} where the app reads the leader file: mount it "
                        f"elsewhere")
        for port in container.get("ports") or []:
            if port.get("containerPort") in spec.ports and port.get(
                    "protocol", "TCP") == "TCP":
                return (f"container {container.get('name')!r} ({key}) uses port "
                        f"{port['containerPort']}, the sidecar's HTTP port: one of them "
                        f"could not listen; move the app, or the sidecar with the chart "
                        f"value sidecar.port")
    needs = needs_api(spec, overrides)
    if needs is None or _own_token_volume(pod) is not None:
        return None
    fix = ("mount a projected volume with a serviceAccountToken source (path token) and "
           "the CA (ca.crt) in the pod")
    if pod_spec.get("automountServiceAccountToken") is False:
        return (f"automountServiceAccountToken: false: the sidecar needs the Kubernetes API "
                f"for {needs} and would get no ServiceAccount token, so it could never "
                f"work; remove that setting, or {fix}")
    projected = [v for v in pod_spec.get("volumes") or []
                 if any("serviceAccountToken" in s for s in _token_sources(v))]
    if projected:
        return (f"the pod's projected token volume {projected[0].get('name')!r} has "
                f"{_token_problem(projected[0])}: the sidecar needs the Kubernetes API for "
                f"{needs}")
    account = pod_spec.get("serviceAccountName") or "default"
    return (f"the pod gets no ServiceAccount token (its ServiceAccount {account!r} sets "
            f"automountServiceAccountToken: false): the sidecar needs the Kubernetes API "
            f"for {needs}; set automountServiceAccountToken: true on the pod, or {fix}")


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
    # conflict() has refused a container that mounts anything at the state directory or
    # a volume named like one of the sidecar's, so the mount goes in as it is.
    container.setdefault("volumeMounts", []).append(copy.deepcopy(spec.app_mount))
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
    problem = conflict(pod, spec, overrides)
    if problem:
        raise InjectionError(problem)
    pod_spec = pod.setdefault("spec", {})
    sidecar = _sidecar(spec, overrides)
    token_volume = _own_token_volume(pod)
    if token_volume is not None and pod_spec.get("automountServiceAccountToken") is False:
        # ServiceAccount admission mounts nothing into our container then: mount the
        # token the pod brought, where in-cluster clients look for it.
        sidecar.setdefault("volumeMounts", []).append(
            {"name": token_volume, "mountPath": SERVICE_ACCOUNT_DIR, "readOnly": True})
    pod_spec["initContainers"] = [sidecar, *(pod_spec.get("initContainers") or [])]
    pod_spec.setdefault("volumes", []).extend(copy.deepcopy(v) for v in spec.volumes)
    for container in pod_spec.get("containers") or []:
        _mount_app(container, spec)
    metadata = pod.setdefault("metadata", {})
    annotations = metadata.get("annotations") or {}
    metadata["annotations"] = {**annotations, INJECTED_ANNOTATION: spec.container_name}
    group = group_label(spec, overrides)
    if group is not None:
        metadata["labels"] = {**(metadata.get("labels") or {}), GROUP_LABEL: group}
    return True
