"""Credentials for the ``kubernetes`` client and kopf, in the operator and the injector
only. The sidecar process (the backend, the pod label, the pod Events) uses its own small
client, :mod:`sidecar.kubeapi`, which follows the same rule.

One rule for where credentials come from (:func:`load_credentials`), so every part talks
to the same cluster as the same ServiceAccount: an explicit ``KUBECONFIG`` wins; else,
inside a pod, the mounted ServiceAccount token (in-cluster config); else
``~/.kube/config``.

Imported only by Kubernetes code paths: it imports the ``kubernetes`` client.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from sidecar.base.errors import BackendError

if TYPE_CHECKING:
    import kopf

SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def load_credentials(configuration: client.Configuration) -> tuple[str | None, str]:
    """Fill ``configuration`` by the one rule above; ``BackendError`` if there is none.

    Returns the namespace the credentials name (None if they name none) and where they
    came from, for logs. ``KUBECONFIG`` is tested before the pod's ServiceAccount because
    setting it is a deliberate choice, which kubectl honours inside a pod too; a pod whose
    manifest sets none, as the chart's sidecar and injector do, gets its ServiceAccount.
    """
    try:
        if os.environ.get("KUBECONFIG") or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_kube_config(client_configuration=configuration)
            _, active = config.list_kube_config_contexts()
            namespace = (active or {}).get("context", {}).get("namespace")
            return namespace, f"kubeconfig {os.environ.get('KUBECONFIG', '~/.kube/config')}"
        config.load_incluster_config(client_configuration=configuration)
        namespace = None
        if SA_NAMESPACE_FILE.exists():
            namespace = SA_NAMESPACE_FILE.read_text().strip() or None
        return namespace, "in-cluster"
    except (ConfigException, OSError, ValueError) as exc:
        raise BackendError(f"kubernetes: no usable credentials (KUBECONFIG or in-cluster): "
                           f"{one_line(exc)}") from None


def one_line(exc: BaseException) -> str:
    """A short, single-line description of a client error (never a response body dump)."""
    if isinstance(exc, ApiException):
        text = f"HTTP {exc.status} {exc.reason or ''}".strip()
        with contextlib.suppress(ValueError, TypeError, KeyError):
            text += f": {json.loads(exc.body or '')['message']}"
    else:
        text = str(exc)
    text = " ".join(text.split())
    return (text[:200] + "…") if len(text) > 200 else (text or type(exc).__name__)


def kopf_connection(configuration: client.Configuration,
                    default_namespace: str | None) -> kopf.ConnectionInfo:
    """kopf's login from a client configuration made by :func:`load_credentials`, so kopf
    talks to the cluster as the rest of the process does (kopf's own ``login_via_client``
    would try the pod's ServiceAccount before ``KUBECONFIG``). kopf is imported here, not
    at the top: only the injector and the operator use it."""
    import kopf

    header = (configuration.get_api_key_with_prefix("BearerToken")
              or configuration.get_api_key_with_prefix("authorization"))
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=configuration.host, ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl, scheme=scheme or ("Bearer" if token else None),
        token=token or None, certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file, default_namespace=default_namespace)
