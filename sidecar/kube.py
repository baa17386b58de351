"""Access to the Kubernetes API, shared by the ``kubernetes`` backend and the pod label.

One rule for where credentials come from, so both halves of the sidecar talk to the same
cluster as the same ServiceAccount: an explicit ``KUBECONFIG`` wins; else, inside a pod,
the mounted ServiceAccount token (in-cluster config); else ``~/.kube/config``.

The namespace is ``POD_NAMESPACE``, else the kubeconfig context's (or the mounted
ServiceAccount's) namespace, else ``default``.

Imported only by Kubernetes code paths: it imports the ``kubernetes`` client.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from sidecar.errors import BackendError
from sidecar.settings import Settings

SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# (connect, read) seconds for one request: a hung apiserver must fail a call, not park
# a worker thread forever. Watches set their own, longer read timeout.
REQUEST_TIMEOUT = (3.0, 5.0)


@dataclass(frozen=True)
class KubeAccess:
    api: client.ApiClient
    namespace: str
    source: str  # "kubeconfig <path>" or "in-cluster", for logs


def connect(settings: Settings) -> KubeAccess:
    """Build an API client from the environment; ``BackendError`` if there is none."""
    configuration = client.Configuration()
    namespace: str | None = None
    try:
        if os.environ.get("KUBECONFIG") or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_kube_config(client_configuration=configuration)
            _, active = config.list_kube_config_contexts()
            namespace = (active or {}).get("context", {}).get("namespace")
            source = f"kubeconfig {os.environ.get('KUBECONFIG', '~/.kube/config')}"
        else:
            config.load_incluster_config(client_configuration=configuration)
            if SA_NAMESPACE_FILE.exists():
                namespace = SA_NAMESPACE_FILE.read_text().strip() or None
            source = "in-cluster"
    except (ConfigException, OSError, ValueError) as exc:
        raise BackendError(f"kubernetes: no usable credentials (KUBECONFIG or in-cluster): "
                           f"{one_line(exc)}") from None
    # The elector retries on its own schedule; urllib3's silent retries would only
    # stretch one call past the deadlines the elector computes.
    configuration.retries = False
    api = client.ApiClient(configuration)
    api.user_agent = "lease-sidecar"
    return KubeAccess(api=api,
                      namespace=settings.pod_namespace or namespace or "default",
                      source=source)


def one_line(exc: BaseException) -> str:
    """A short, single-line description of a client error (never a response body dump)."""
    if isinstance(exc, ApiException):
        text = f"HTTP {exc.status} {exc.reason or ''}".strip()
        with contextlib.suppress(ValueError, TypeError, KeyError):
            text += f": {json.loads(exc.body)['message']}"
    else:
        text = str(exc)
    text = " ".join(text.split())
    return (text[:200] + "…") if len(text) > 200 else (text or type(exc).__name__)


def request(api: client.ApiClient, method: str, path: str, body: Any = None,
            content_type: str = "application/json",
            timeout: tuple[float, float] = REQUEST_TIMEOUT) -> dict[str, Any]:
    """One API call with plain JSON in and out; raises ``ApiException`` on non-2xx.

    The generated client validates bodies into pydantic models and re-serialises
    datetimes with ``isoformat()``, which drops a zero fraction that the apiserver's
    MicroTime format requires; sending and reading plain JSON keeps every field exactly
    as the apiserver wrote it (and skips model building on the hot path).
    """
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = content_type
    serialized = api.param_serialize(method=method, resource_path=path, header_params=headers,
                                     body=body, auth_settings=["BearerToken"])
    response = api.call_api(*serialized, _request_timeout=timeout)
    response.read()
    if not 200 <= response.status <= 299:
        raise ApiException.from_response(http_resp=response,
                                         body=response.data.decode(errors="replace"),
                                         data=None)
    return json.loads(response.data)
