"""The pure Pod mutation behind the injector (the webhook itself: tests/integration)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from sidecar.injector.inject import InjectionError, InjectionSpec, inject

SPEC = InjectionSpec.from_json({
    "container": {"name": "lease-sidecar", "image": "lease-sidecar:1", "restartPolicy": "Always",
                  "env": [{"name": "LEASE_NAME", "value": "default"},
                          {"name": "LEASE_ROLE", "value": "all"}]},
    "volumes": [{"name": "lease-state", "emptyDir": {}}],
    "appMount": {"name": "lease-state", "mountPath": "/run/lease", "readOnly": True},
    "appEnv": [{"name": "LEASE_LEADER_FILE", "value": "/run/lease/leader"}],
})


def _pod(labels: dict[str, str] | None = None, **annotations: str) -> dict[str, Any]:
    """An opted-in pod naming the lease "web" unless the annotations say otherwise."""
    return {"metadata": {"labels": labels if labels is not None
                         else {"lease-sidecar/inject": "true"},
                         "annotations": {"lease-sidecar/name": "web", **annotations}},
            "spec": {"initContainers": [{"name": "migrate"}],
                     "containers": [{"name": "app", "env": [
                         {"name": "LEASE_LEADER_FILE", "value": "/custom"}]},
                                    {"name": "logs"}]}}


def test_injects_first_native_sidecar_volume_mounts_and_env() -> None:
    pod = _pod()
    assert inject(pod, SPEC) is True
    spec = pod["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["lease-sidecar", "migrate"]
    assert spec["volumes"] == SPEC.volumes
    for app in spec["containers"]:
        assert SPEC.app_mount in app["volumeMounts"]
    # An app's own setting wins over the injected hint.
    assert spec["containers"][0]["env"] == [{"name": "LEASE_LEADER_FILE", "value": "/custom"}]
    assert spec["containers"][1]["env"] == SPEC.app_env
    assert pod["metadata"]["annotations"]["lease-sidecar/injected"] == "lease-sidecar"
    env = {e["name"]: e["value"] for e in spec["initContainers"][0]["env"]}
    assert env["LEASE_NAME"] == "web"


@pytest.mark.parametrize("annotations", [{}, {"lease-sidecar/name": ""},
                                         {"lease-sidecar/name": "  "},
                                         {"lease-sidecar/role": "worker"}])
def test_a_pod_without_a_lease_name_is_refused(annotations: dict[str, str]) -> None:
    """Before: injected with the chart's LEASE_NAME=default, so two workloads of one
    namespace silently shared one lease and only one pod across both ever led."""
    pod = _pod()
    pod["metadata"]["annotations"] = annotations
    before = copy.deepcopy(pod)
    with pytest.raises(InjectionError, match=r"^the pod has no lease-sidecar/name annotation: "
                                             r"name the lease its workload contends for"):
        inject(pod, SPEC)
    assert pod == before


def test_a_pod_injected_by_another_release_is_not_injected_again() -> None:
    """Two releases whose webhooks both match one pod: the second leaves it alone, even
    when its sidecar has another container name."""
    pod = _pod()
    inject(pod, SPEC)
    other = InjectionSpec(container={**SPEC.container, "name": "other-sidecar"},
                          volumes=SPEC.volumes, app_mount=SPEC.app_mount, app_env=SPEC.app_env)
    once = copy.deepcopy(pod)
    assert inject(pod, other) is False
    assert pod == once


def test_second_pass_changes_nothing() -> None:
    pod = _pod()
    inject(pod, SPEC)
    once = copy.deepcopy(pod)
    assert inject(pod, SPEC) is False
    assert pod == once


@pytest.mark.parametrize("labels", [{}, {"lease-sidecar/inject": "false"}, {"app": "x"}])
def test_pods_that_did_not_opt_in_are_left_alone(labels: dict[str, str]) -> None:
    pod = _pod(labels)
    before = copy.deepcopy(pod)
    assert inject(pod, SPEC) is False
    assert pod == before


def test_annotations_override_name_and_role() -> None:
    pod = _pod(**{"lease-sidecar/name": "sweeps,reports", "lease-sidecar/role": "worker"})
    inject(pod, SPEC)
    env = {e["name"]: e["value"] for e in pod["spec"]["initContainers"][0]["env"]}
    assert env == {"LEASE_NAME": "sweeps,reports", "LEASE_ROLE": "worker"}
    assert SPEC.container["env"][0]["value"] == "default"  # the shared spec is not mutated


@pytest.mark.parametrize(("annotation", "value", "message"), [
    ("lease-sidecar/role", "boss", "'boss' is not one of all, worker, api"),
    ("lease-sidecar/name", "a b", "is not a valid lease name"),
])
def test_bad_annotation_is_refused_before_any_change(annotation: str, value: str,
                                                     message: str) -> None:
    pod = _pod(**{annotation: value})
    before = copy.deepcopy(pod)
    with pytest.raises(InjectionError, match=message):
        inject(pod, SPEC)
    assert pod == before


def test_existing_volume_of_that_name_is_kept() -> None:
    pod = _pod()
    pod["spec"]["volumes"] = [{"name": "lease-state", "emptyDir": {"medium": "Memory"}}]
    inject(pod, SPEC)
    assert pod["spec"]["volumes"] == [{"name": "lease-state", "emptyDir": {"medium": "Memory"}}]


def test_spec_must_be_a_native_sidecar(tmp_path: Path) -> None:
    data = {"container": {"name": "x"}, "volumes": [], "appMount": {}}
    with pytest.raises(ValueError, match="restartPolicy: Always"):
        InjectionSpec.from_json(data)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"volumes": []}))
    with pytest.raises(ValueError, match="lacks or mistypes 'container'"):
        InjectionSpec.load(path)
    with pytest.raises(ValueError, match="cannot read injection spec"):
        InjectionSpec.load(tmp_path / "missing.json")


def _spec(backend: str, key_prefix: str | None = "lease-sidecar",
          lease_objects: tuple[str, ...] | None = None) -> InjectionSpec:
    env = [{"name": "LEASE_BACKEND", "value": backend}, {"name": "LEASE_NAME", "value": "x"}]
    if key_prefix is not None:
        env.append({"name": "LEASE_KEY_PREFIX", "value": key_prefix})
    return InjectionSpec(container={**SPEC.container, "env": env}, volumes=SPEC.volumes,
                         app_mount=SPEC.app_mount, app_env=SPEC.app_env,
                         lease_objects=lease_objects)


def test_a_lease_the_releases_role_does_not_grant_is_refused() -> None:
    """Before: injected, and the sidecar then failed closed on a 403 for its Lease."""
    spec = _spec("kubernetes", lease_objects=("lease-sidecar.default", "lease-sidecar.web"))
    assert inject(_pod(**{"lease-sidecar/name": "web"}), spec) is True
    pod = _pod(**{"lease-sidecar/name": "web,reports"})
    before = copy.deepcopy(pod)
    with pytest.raises(InjectionError, match=(
            r"^annotation lease-sidecar/name: the release's Role does not grant the Lease "
            r"'lease-sidecar\.reports' \(it grants lease-sidecar\.default, "
            r"lease-sidecar\.web\): add 'reports' to the chart value rbac\.leaseNames")):
        inject(pod, spec)
    assert pod == before
    # No list (rbac.anyLease, no chart RBAC, another backend): any valid name.
    assert inject(_pod(**{"lease-sidecar/name": "reports"}), _spec("kubernetes")) is True
    assert inject(_pod(**{"lease-sidecar/name": "reports"}),
                  _spec("postgres", lease_objects=("lease-sidecar.web",))) is True


def test_spec_json_carries_the_granted_leases() -> None:
    data = {"container": SPEC.container, "volumes": [], "appMount": SPEC.app_mount}
    assert InjectionSpec.from_json(data).lease_objects is None
    data["leaseObjects"] = ["lease-sidecar.a"]
    assert InjectionSpec.from_json(data).lease_objects == ("lease-sidecar.a",)


@pytest.mark.parametrize("name", ["Upper_Case", "jobs,Nightly", "under_score"])
def test_kubernetes_backend_refuses_names_its_lease_object_cannot_have(name: str) -> None:
    """Before: accepted, and the injected sidecar then crash-looped on its settings."""
    pod = _pod(**{"lease-sidecar/name": name})
    before = copy.deepcopy(pod)
    with pytest.raises(InjectionError, match=r"annotation lease-sidecar/name: .* is not a "
                                             r"valid Kubernetes object name"):
        inject(pod, _spec("kubernetes"))
    assert pod == before


def test_object_name_rule_counts_the_key_prefix() -> None:
    long = "n" * 200  # the longest lease name; with the prefix and dot at most 253
    inject(_pod(**{"lease-sidecar/name": long}), _spec("kubernetes", key_prefix="p" * 52))
    with pytest.raises(InjectionError, match="not a valid Kubernetes object name"):
        inject(_pod(**{"lease-sidecar/name": long}), _spec("kubernetes", key_prefix="p" * 53))
    # No LEASE_KEY_PREFIX in the spec: the sidecar's default prefix applies.
    with pytest.raises(InjectionError, match=r"'lease-sidecar\.Upper'"):
        inject(_pod(**{"lease-sidecar/name": "Upper"}), _spec("kubernetes", key_prefix=None))


def test_database_backends_keep_their_wider_names() -> None:
    pod = _pod(**{"lease-sidecar/name": "Upper_Case"})
    assert inject(pod, _spec("postgres")) is True


@pytest.mark.parametrize(("pod", "message"), [
    ([], "the object is not a map"),
    ({"metadata": "x"}, "metadata is not a map"),
    ({"metadata": {"labels": ["lease-sidecar/inject"]}}, "metadata.labels is not a map"),
    ({"metadata": {"labels": {"lease-sidecar/inject": True}}}, "metadata.labels is not a map"),
    ({"metadata": {"annotations": {"a": 1}}}, "metadata.annotations is not a map"),
    ({"spec": []}, "spec is not a map"),
    ({"spec": {"containers": "app"}}, "spec.containers is not a list of maps"),
    ({"spec": {"containers": ["app"]}}, "spec.containers is not a list of maps"),
    ({"spec": {"initContainers": {}}}, "spec.initContainers is not a list of maps"),
    ({"spec": {"volumes": "v"}}, "spec.volumes is not a list of maps"),
    ({"spec": {"containers": [{"name": "a", "env": "X=1"}]}},
     r"spec.containers\[0\].env is not a list of maps"),
    ({"spec": {"containers": [{"name": "a", "volumeMounts": [1]}]}},
     r"spec.containers\[0\].volumeMounts is not a list of maps"),
])
def test_malformed_pod_is_one_clear_line(pod: object, message: str) -> None:
    """Before: TypeError/AttributeError text, which kopf sent back as a 500."""
    with pytest.raises(InjectionError, match=f"malformed pod: {message}"):
        inject(pod, SPEC)  # type: ignore[arg-type]


def test_an_override_keeps_the_variables_place() -> None:
    """Before: the overridden LEASE_NAME moved to the end of the sidecar's env."""
    pod = _pod(**{"lease-sidecar/name": "web"})
    inject(pod, _spec("kubernetes"))
    env = pod["spec"]["initContainers"][0]["env"]
    assert env == [{"name": "LEASE_BACKEND", "value": "kubernetes"},
                   {"name": "LEASE_NAME", "value": "web"},
                   {"name": "LEASE_KEY_PREFIX", "value": "lease-sidecar"}]
