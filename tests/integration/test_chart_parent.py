"""The chart's named templates used from a real parent chart (tests/charts/parent), which
depends on charts/lease-sidecar through a ``file://`` dependency: ``helm dependency
build`` and ``helm template`` with the test bed's real helm, and the result accepted by
the real kube-apiserver.

Before: ``include "lease-sidecar.container" .`` in a parent failed with a nil pointer
(``.Values.sidecar.containerName``), and a context the parent built with its own
``.Chart`` tagged the sidecar image with the parent's appVersion.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.chart_support import (
    CHART,
    documents,
    env_map,
    find,
    helm,
    kube_version,
    template,
)
from testkit.support import REPO
from testkit.testbed.kube import ControlPlane

pytestmark = pytest.mark.kube

PARENT = REPO / "tests" / "charts" / "parent"
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def _parent(tmp_path: Path, alias: str | None = None, twice: bool = False) -> Path:
    """A copy of the parent chart whose dependency points at this checkout's chart by an
    absolute file:// path (the copy lives elsewhere), built with `helm dependency build`."""
    chart = tmp_path / "parent"
    shutil.copytree(PARENT, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    dependency = meta["dependencies"][0]
    assert dependency["repository"] == "file://../../../charts/lease-sidecar"
    assert (PARENT / dependency["repository"].removeprefix("file://")).resolve() == CHART
    dependency["repository"] = f"file://{CHART}"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    if alias:
        dependency["alias"] = alias
        values[alias] = values.pop("lease-sidecar")
    if twice:
        meta["dependencies"].append({**dependency, "alias": "second-sidecar"})
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    (chart / "values.yaml").write_text(yaml.safe_dump(values))
    helm("dependency", "build", str(chart))
    return chart


def _render(chart: Path, check: bool = True) -> Any:
    return helm("template", "app", str(chart), "--namespace", "apps",
                "--kube-version", kube_version(), check=check)


def _own_sidecar() -> dict[str, Any]:
    """What lease-sidecar renders for its own example with the parent's values."""
    docs = documents(template("app", "apps", ["example.enabled=true",
                                              "lease.name=parent-jobs"]).stdout)
    return find(docs, "Deployment", "-example")["spec"]["template"]["spec"]


@pytest.mark.parametrize("alias", [None, "jobs-sidecar"], ids=["plain", "alias"])
def test_named_templates_from_a_parent_chart(tmp_path: Path, alias: str | None) -> None:
    docs = documents(_render(_parent(tmp_path, alias)).stdout)
    own = _own_sidecar()
    workloads = ["app-worker"] if alias else ["app-worker", "app-built"]
    name = alias or "lease-sidecar"
    for workload in workloads:
        pod = find(docs, "Deployment", workload)["spec"]["template"]["spec"]
        sidecar = pod["initContainers"][0]
        # The image keeps lease-sidecar's own tag, not the parent's appVersion 9.9.9.
        assert sidecar["image"] == f"lease-sidecar:{APP_VERSION}", workload
        assert pod["containers"][0]["image"] == "example.invalid/worker:9.9.9"
        assert env_map(sidecar)["LEASE_NAME"] == "parent-jobs"
        if not alias:
            # Exactly the container, volumes and app wiring the chart renders itself.
            assert sidecar == own["initContainers"][0], workload
            assert pod["volumes"] == own["volumes"]
            assert pod["serviceAccountName"] == own["serviceAccountName"]
        assert pod["serviceAccountName"] == f"app-{name}"
        app = pod["containers"][0]
        assert env_map(app)["LEASE_LEADER_FILE"] == "/run/lease/leader"
        assert {"name": "lease-state", "mountPath": "/run/lease", "readOnly": True} in (
            app["volumeMounts"])
    # The dependency's own objects come along: the Role and binding for that account,
    # and the Lease it grants.
    role = find(docs, "Role", f"app-{name}")
    assert any("lease-sidecar.parent-jobs" in rule.get("resourceNames", [])
               for rule in role["rules"])
    binding = find(docs, "RoleBinding", f"app-{name}")
    assert binding["subjects"][0]["name"] == f"app-{name}"


def test_parent_chart_output_is_accepted_by_the_apiserver(
        tmp_path: Path, control_plane: ControlPlane, kube_namespace: str) -> None:
    rendered = helm("template", "app", str(_parent(tmp_path)), "--namespace", kube_namespace,
                    "--kube-version", kube_version()).stdout
    proc = control_plane.kubectl("apply", "--dry-run=server", "-n", kube_namespace, "-f", "-",
                                 input=rendered, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "deployment.apps/app-worker" in proc.stdout
    assert "deployment.apps/app-built" in proc.stdout


def test_two_dependencies_on_the_chart_must_say_which(tmp_path: Path) -> None:
    proc = _render(_parent(tmp_path, twice=True), check=False)
    assert proc.returncode != 0
    assert ("lease-sidecar.serviceAccountName: this chart depends on lease-sidecar more than "
            'once (lease-sidecar, second-sidecar): pass one, e.g. include '
            '"lease-sidecar.serviceAccountName" (index .Subcharts "lease-sidecar")'
            ) in proc.stderr


def test_a_context_without_lease_sidecar_values_is_one_clear_line(tmp_path: Path) -> None:
    """No dependency, no values: a message saying what to pass, not a nil pointer."""
    chart = tmp_path / "lonely"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(json.dumps({"apiVersion": "v2", "name": "lonely",
                                                  "version": "1.0.0"}))
    # The helpers without the dependency: as a chart vendoring only the templates would.
    shutil.copy(CHART / "templates" / "_helpers.tpl", chart / "templates" / "_helpers.tpl")
    (chart / "templates" / "pod.yaml").write_text(
        'value: {{ include "lease-sidecar.container" . | quote }}\n')
    proc = helm("template", "x", str(chart), check=False)
    assert proc.returncode != 0
    assert ("lease-sidecar.container: no lease-sidecar values here: call it with the context "
            "of a chart that depends on lease-sidecar (.)") in proc.stderr
    assert "nil pointer" not in proc.stderr


def test_the_fallback_version_is_the_charts_app_version() -> None:
    """A parent-built context has no .Chart of ours: the tag then comes from
    lease-sidecar.appVersion, which must follow Chart.yaml."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert ('{{- define "lease-sidecar.appVersion" -}}' + APP_VERSION + "{{- end }}") in helpers
