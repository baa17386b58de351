"""CustomResourceDefinitions of other projects, so the apiserver validates what the chart
renders for them (``kubectl apply --dry-run=server``) against their real schemas.

cert-manager's come from its Go module, fetched through the same Go module proxy the test
bed's tools are built from (``go mod download``, cached in the module cache). The files
in ``deploy/crds`` carry Helm template markers in their labels (cert-manager renders them
with its own chart): those labels and annotations are dropped, the schemas kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from testkit.testbed import gobuild
from testkit.testbed.kube import ControlPlane

CERT_MANAGER = ("github.com/cert-manager/cert-manager", "v1.17.2")
CERT_MANAGER_CRDS = ("crd-certificates.yaml", "crd-issuers.yaml", "crd-clusterissuers.yaml")


def cert_manager_crds() -> list[dict[str, Any]]:
    """The Certificate, Issuer and ClusterIssuer CRDs of the pinned cert-manager."""
    module, version = CERT_MANAGER
    workdir = gobuild.cache_root() / "crds"
    workdir.mkdir(parents=True, exist_ok=True)
    info = gobuild._module_info(gobuild.go_executable(), module, version, workdir,
                                workdir / "download.log")
    crds = []
    for name in CERT_MANAGER_CRDS:
        doc = yaml.safe_load((Path(info["Dir"]) / "deploy" / "crds" / name).read_text())
        doc["metadata"] = {"name": doc["metadata"]["name"]}
        crds.append(doc)
    return crds


def install_cert_manager_crds(cp: ControlPlane) -> None:
    """Create (or keep) cert-manager's CRDs in the control plane; no controller runs, so
    Certificates are stored and validated, never issued."""
    cp.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": cert_manager_crds()}))
    for name in CERT_MANAGER_CRDS:
        crd = name.removeprefix("crd-").removesuffix(".yaml")
        cp.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                   f"crd/{crd}.cert-manager.io")
