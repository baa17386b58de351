"""One credentials rule for the sidecar (sidecar.kubeapi, its own aiohttp client) and the
operator/injector (sidecar.kube.load_credentials, the ``kubernetes`` client).

Real kubeconfig files read by the real ``kubernetes`` client in a fresh Python process
with the environment a pod (or a laptop) would give it: the client reads ``KUBECONFIG``
when it is imported, so the environment must be set before that. No apiserver is
contacted: building a client does not connect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PROBE = """
import json
from sidecar.base.errors import BackendError
from sidecar.injector.tls import api_client
from sidecar.kubeapi import KubeClient, KubeError

result = {}
try:
    client = KubeClient.connect()
    result["sidecar"] = [client.credentials.server, client.namespace, client.credentials.source]
except KubeError as exc:
    result.setdefault("error", []).append(str(exc))
try:
    injector = api_client()
    result["injector"] = injector.configuration.host
except BackendError as exc:
    result.setdefault("error", []).append(str(exc))
print(json.dumps(result))
"""

# The variables kubelet sets in every container (no ServiceAccount token is mounted here).
POD_ENV = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def write_kubeconfig(path: Path, server: str, namespace: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u",
                                               "namespace": namespace}}]}))
    return path


def probe(home: Path, env: dict[str, str]) -> dict[str, Any]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT",
                         "POD_NAMESPACE")}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**base, "HOME": str(home), **env},
                          capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_an_explicit_kubeconfig_wins_in_a_pod_for_the_sidecar_and_the_injector(
        tmp_path: Path) -> None:
    """The injector used to try the ServiceAccount first and so ignored KUBECONFIG."""
    path = write_kubeconfig(tmp_path / "explicit", "https://127.0.0.1:7443", "team-a")
    result = probe(tmp_path / "home", {**POD_ENV, "KUBECONFIG": str(path)})
    assert result == {"sidecar": ["https://127.0.0.1:7443", "team-a", f"kubeconfig {path}"],
                      "injector": "https://127.0.0.1:7443"}


def test_in_a_pod_without_kubeconfig_only_the_service_account_counts(tmp_path: Path) -> None:
    # A ~/.kube/config in the pod is not used: in-cluster comes before it.
    write_kubeconfig(tmp_path / "home" / ".kube" / "config", "https://127.0.0.1:7443", "x")
    result = probe(tmp_path / "home", POD_ENV)
    assert len(result["error"]) == 2  # the sidecar's and the injector's
    for error in result["error"]:
        assert error.startswith("kubernetes: no usable credentials (KUBECONFIG or in-cluster): ")
        assert "\n" not in error


def test_outside_a_pod_the_default_kubeconfig_is_used(tmp_path: Path) -> None:
    write_kubeconfig(tmp_path / ".kube" / "config", "https://127.0.0.1:8443", "ops")
    result = probe(tmp_path, {})
    assert result == {"sidecar": ["https://127.0.0.1:8443", "ops", "kubeconfig ~/.kube/config"],
                      "injector": "https://127.0.0.1:8443"}
