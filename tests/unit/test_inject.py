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


# The token volume ServiceAccount admission adds before any webhook sees the pod.
TOKEN_VOLUME = {"name": "kube-api-access-x7k2p", "projected": {"sources": [
    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
    {"downwardAPI": {"items": [{"path": "namespace",
                                "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}


def _pod(labels: dict[str, str] | None = None, **annotations: str) -> dict[str, Any]:
    """An opted-in pod naming the lease "web" unless the annotations say otherwise."""
    return {"metadata": {"labels": labels if labels is not None
                         else {"lease-sidecar/inject": "true"},
                         "annotations": {"lease-sidecar/name": "web", **annotations}},
            "spec": {"initContainers": [{"name": "migrate"}],
                     "containers": [{"name": "app", "env": [
                         {"name": "LEASE_LEADER_FILE", "value": "/custom"}]},
                                    {"name": "logs"}],
                     "volumes": [copy.deepcopy(TOKEN_VOLUME)]}}


def test_injects_first_native_sidecar_volume_mounts_and_env() -> None:
    pod = _pod()
    assert inject(pod, SPEC) is True
    spec = pod["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["lease-sidecar", "migrate"]
    assert spec["volumes"] == [TOKEN_VOLUME, *SPEC.volumes]
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
        inject(pod, SPEC)  # type: ignore[arg-type]  # malformed on purpose


def test_an_override_keeps_the_variables_place() -> None:
    """Before: the overridden LEASE_NAME moved to the end of the sidecar's env."""
    pod = _pod(**{"lease-sidecar/name": "web"})
    inject(pod, _spec("kubernetes"))
    env = pod["spec"]["initContainers"][0]["env"]
    assert env == [{"name": "LEASE_BACKEND", "value": "kubernetes"},
                   {"name": "LEASE_NAME", "value": "web"},
                   {"name": "LEASE_KEY_PREFIX", "value": "lease-sidecar"}]


# -- pods the sidecar could not serve: each refused with its own message -----------------

KUBE = InjectionSpec.from_json({
    "container": {"name": "lease-sidecar", "image": "lease-sidecar:1", "restartPolicy": "Always",
                  "ports": [{"name": "lease-http", "containerPort": 8099, "protocol": "TCP"}],
                  "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {
                              "fieldPath": "metadata.name"}}},
                          {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {
                              "fieldPath": "metadata.namespace"}}},
                          {"name": "LEASE_BACKEND", "value": "kubernetes"},
                          {"name": "LEASE_NAME", "value": "default"},
                          {"name": "LEASE_POD_LABEL", "value": "auto"}]},
    "volumes": [{"name": "lease-state", "emptyDir": {}}, {"name": "lease-sidecar-tmp",
                                                           "emptyDir": {}}],
    "appMount": {"name": "lease-state", "mountPath": "/run/lease", "readOnly": True},
})


def _refused(pod: dict[str, Any], spec: InjectionSpec = KUBE) -> str:
    """The refusal message; the pod is left exactly as it was."""
    before = copy.deepcopy(pod)
    with pytest.raises(InjectionError) as caught:
        inject(pod, spec)
    assert pod == before
    return str(caught.value)


def test_automount_false_is_refused_when_the_sidecar_needs_the_api() -> None:
    """Before: injected; the sidecar answered /leader 503 forever, /healthz 200."""
    pod = _pod()
    pod["spec"]["automountServiceAccountToken"] = False
    del pod["spec"]["volumes"]  # ServiceAccount admission added none
    message = _refused(pod)
    assert message.startswith(
        "automountServiceAccountToken: false: the sidecar needs the Kubernetes API for its "
        "Lease (kubernetes backend) and the lease-role label and pod Events "
        "(lease.podLabel) and would get no ServiceAccount token")
    assert "mount a projected volume with a serviceAccountToken source" in message


def test_a_serviceaccount_without_automount_is_refused_by_its_missing_token() -> None:
    """The pod does not say, its ServiceAccount does: admission then added no token
    volume, which is what the injector sees."""
    pod = _pod()
    pod["spec"]["serviceAccountName"] = "builder"
    del pod["spec"]["volumes"]
    assert _refused(pod).startswith(
        "the pod gets no ServiceAccount token (its ServiceAccount 'builder' sets "
        "automountServiceAccountToken: false): the sidecar needs the Kubernetes API for its "
        "Lease (kubernetes backend)")


def test_automount_false_with_a_projected_token_of_its_own_is_injected() -> None:
    """The pod brings its token: the sidecar gets it where in-cluster clients look."""
    pod = _pod()
    pod["spec"]["automountServiceAccountToken"] = False
    pod["spec"]["volumes"] = [{**TOKEN_VOLUME, "name": "my-token"}]
    assert inject(pod, KUBE) is True
    sidecar = pod["spec"]["initContainers"][0]
    assert {"name": "my-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True} in sidecar["volumeMounts"]
    # With automount on, ServiceAccount admission mounts it (it runs again after us).
    pod = _pod()
    assert inject(pod, KUBE) is True
    assert "volumeMounts" not in pod["spec"]["initContainers"][0]


def test_a_projected_token_without_the_ca_is_refused() -> None:
    pod = _pod()
    pod["spec"]["automountServiceAccountToken"] = False
    pod["spec"]["volumes"] = [{"name": "my-token", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token"}}]}}]
    assert _refused(pod).startswith("automountServiceAccountToken: false: ")
    pod["spec"]["automountServiceAccountToken"] = True
    assert _refused(pod).startswith("the pod's projected token volume 'my-token' has no "
                                    "configMap source giving ca.crt")


@pytest.mark.parametrize(("env", "needed"), [
    ({"LEASE_BACKEND": "postgres", "LEASE_POD_LABEL": "off"}, False),
    ({"LEASE_BACKEND": "postgres", "LEASE_POD_LABEL": "on"}, True),
    ({"LEASE_BACKEND": "postgres", "LEASE_POD_LABEL": "auto"}, True),  # POD_NAME is set
    ({"LEASE_BACKEND": "kubernetes", "LEASE_POD_LABEL": "off"}, True),
    ({"LEASE_BACKEND": "kubernetes", "LEASE_POD_LABEL": "off", "LEASE_ROLE": "api"}, False),
])
def test_a_token_is_required_only_when_the_sidecar_needs_the_api(env: dict[str, str],
                                                                 needed: bool) -> None:
    given = [{"name": k, "value": v} for k, v in env.items()]
    spec = InjectionSpec(container={**KUBE.container, "env": [
        *KUBE.container["env"][:2], *given]}, volumes=KUBE.volumes, app_mount=KUBE.app_mount,
        app_env=[])
    pod = _pod()
    pod["spec"]["automountServiceAccountToken"] = False
    del pod["spec"]["volumes"]
    if needed:
        assert _refused(pod, spec).startswith("automountServiceAccountToken: false")
    else:
        assert inject(pod, spec) is True


def test_the_role_annotation_counts_for_the_api() -> None:
    spec = InjectionSpec(container={**KUBE.container, "env": [
        {"name": "LEASE_BACKEND", "value": "kubernetes"}]}, volumes=KUBE.volumes,
        app_mount=KUBE.app_mount, app_env=[])
    pod = _pod(**{"lease-sidecar/role": "api"})
    pod["spec"]["automountServiceAccountToken"] = False
    assert inject(pod, spec) is True


@pytest.mark.parametrize("path", ["/run/lease", "/run/lease/", "/run/lease/leader"])
def test_an_app_mount_in_the_state_directory_is_refused(path: str) -> None:
    """Before: the app kept its own mount and never saw the leader file."""
    pod = _pod()
    pod["spec"]["containers"][1]["volumeMounts"] = [{"name": "mine", "mountPath": path}]
    assert _refused(pod) == (
        f"container 'logs' (containers) already mounts 'mine' at {path}, inside the "
        f"sidecar's state directory /run/lease where the app reads the leader file: mount "
        f"it elsewhere")


def test_mounts_beside_the_state_directory_are_fine() -> None:
    pod = _pod()
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "a", "mountPath": "/run"},
                                                    {"name": "b", "mountPath": "/run/leases"}]
    assert inject(pod, KUBE) is True
    # An init container that ends before the app may use the path (it gets no mount).
    pod = _pod()
    pod["spec"]["initContainers"][0]["volumeMounts"] = [{"name": "c", "mountPath": "/run/lease"}]
    assert inject(pod, KUBE) is True


@pytest.mark.parametrize("name", ["lease-state", "lease-sidecar-tmp"])
def test_a_volume_named_like_the_sidecars_is_refused(name: str) -> None:
    """Before: the pod's volume was reused whatever its type; with a shared hostPath two
    pods on a node read one leader file."""
    pod = _pod()
    pod["spec"]["volumes"].append({"name": name, "hostPath": {"path": "/srv/lease"}})
    assert _refused(pod) == (
        f"the pod already has a volume named {name!r}, the name of the sidecar's own volume "
        f"(lease-sidecar-tmp, lease-state): rename it")


def test_a_mount_of_a_sidecar_volume_name_is_refused() -> None:
    pod = _pod()
    pod["spec"]["initContainers"][0]["volumeMounts"] = [{"name": "lease-state",
                                                         "mountPath": "/data"}]
    assert _refused(pod) == ("container 'migrate' (initContainers) mounts a volume named "
                             "'lease-state', the name of the sidecar's own volume: rename it")


@pytest.mark.parametrize("key", ["containers", "initContainers"])
def test_an_app_port_equal_to_the_sidecars_is_refused(key: str) -> None:
    """Before: injected; one of the two binds then failed at run time."""
    pod = _pod()
    pod["spec"][key][0]["ports"] = [{"containerPort": 8099}]
    name = pod["spec"][key][0]["name"]
    assert _refused(pod) == (
        f"container {name!r} ({key}) uses port 8099, the sidecar's HTTP port: one of them "
        f"could not listen; move the app, or the sidecar with the chart value sidecar.port")
    pod["spec"][key][0]["ports"] = [{"containerPort": 8099, "protocol": "UDP"},
                                    {"containerPort": 8080}]
    assert inject(pod, KUBE) is True


def test_host_network_is_refused() -> None:
    """Before: injected, with /status, /metrics and POST /release open to the node."""
    pod = _pod()
    pod["spec"]["hostNetwork"] = True
    assert _refused(pod).startswith(
        "hostNetwork: true: the sidecar would listen on the node's network, so its "
        "/status, /metrics and the loopback-only POST /release would be open to every "
        "process on the node, and two such pods on one node would need the same port (8099)")
    pod["spec"]["hostNetwork"] = False
    assert inject(pod, KUBE) is True


def test_the_names_checked_come_from_the_chart_spec() -> None:
    """Another state directory, volume name and port in the chart: those are checked."""
    spec = InjectionSpec(
        container={**KUBE.container, "ports": [{"containerPort": 9000}]},
        volumes=[{"name": "ls", "emptyDir": {}}], app_env=[],
        app_mount={"name": "ls", "mountPath": "/var/lease", "readOnly": True})
    pod = _pod()
    pod["spec"]["containers"][0]["ports"] = [{"containerPort": 8099}]
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "x", "mountPath": "/run/lease"}]
    pod["spec"]["volumes"].append({"name": "lease-state", "emptyDir": {}})
    assert inject(copy.deepcopy(pod), spec) is True
    pod["spec"]["containers"][1]["ports"] = [{"containerPort": 9000}]
    assert "uses port 9000" in _refused(pod, spec)


def _spec_with(**env: str) -> InjectionSpec:
    data = {"container": copy.deepcopy(SPEC.container), "volumes": SPEC.volumes,
            "appMount": SPEC.app_mount, "appEnv": SPEC.app_env}
    data["container"]["env"] += [{"name": k, "value": v} for k, v in env.items()]
    return InjectionSpec.from_json(data)


@pytest.mark.parametrize("env", [{}, {"LEASE_KEY_PREFIX": "team-a"}, {"LEASE_KEY_PREFIX": ""},
                                 {"LEASE_POD_LABEL": "on"}])
def test_the_pod_carries_its_group_label_from_creation(env: dict[str, str]) -> None:
    """The label the sidecar's pod label publisher would write (the first lease name's
    key), so a leader handing over to the youngest Ready pod finds a new pod that is
    Ready before its sidecar's first label write."""
    from sidecar.config import load
    from sidecar.publish.pod_label import GROUP_LABEL, group_value

    pod = _pod(labels={"lease-sidecar/inject": "true", "app": "web"},
               **{"lease-sidecar/name": "sweeps,reports"})
    inject(pod, _spec_with(**env))
    settings = load({"names": "sweeps,reports", "dsn": "/tmp/l.db"}, env=env)
    assert pod["metadata"]["labels"] == {
        "lease-sidecar/inject": "true", "app": "web",
        GROUP_LABEL: group_value(settings.store.key(settings.name))}


def test_no_group_label_where_the_sidecar_keeps_no_pod_label() -> None:
    pod = _pod()
    inject(pod, _spec_with(LEASE_POD_LABEL="off"))
    assert pod["metadata"]["labels"] == {"lease-sidecar/inject": "true"}
