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
    return {"metadata": {"labels": labels if labels is not None
                         else {"lease-sidecar/inject": "true"},
                         "annotations": annotations},
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
