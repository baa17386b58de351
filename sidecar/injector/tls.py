"""Keep the injector's TLS in the cluster: the Secret holds it, the webhook trusts it.

At start (and every few hours after), each injector replica:

1. reads the TLS Secret the chart created (possibly empty);
2. if the CA or serving certificate is missing, unreadable, expiring within 30 days or
   does not name the Service, makes new ones (:mod:`sidecar.injector.certs`) and writes
   them back with the Secret's ``resourceVersion`` — when two replicas race, one write
   wins (409 for the other), and the loser re-reads and uses the winner's certificate;
3. sets ``caBundle`` of every webhook in the MutatingWebhookConfiguration to the CA,
   when it differs (a JSON patch, so other fields keep their chart values);
4. writes the serving key and certificate into a private directory for the HTTPS
   server, which kopf reloads when the file changes.
"""

from __future__ import annotations

import base64
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from sidecar.injector.certs import Bundle, renew
from sidecar.kube import load_credentials

log = logging.getLogger("sidecar.injector")

KEYS = {"ca_cert": "ca.crt", "ca_key": "ca.key", "cert": "tls.crt", "key": "tls.key"}
MAX_RACES = 5


def api_client() -> client.ApiClient:
    """A client with the sidecar's credentials (:func:`sidecar.kube.load_credentials`);
    unlike the sidecar's, it keeps urllib3's retries: nothing here runs on a deadline."""
    configuration = client.Configuration()
    load_credentials(configuration)
    return client.ApiClient(configuration)


def _decode(data: Mapping[str, str | bytes] | None) -> Bundle:
    data = data or {}
    return Bundle(**{field: base64.b64decode(data.get(key) or "")
                     for field, key in KEYS.items()})


def _encode(bundle: Bundle) -> dict[str, str]:
    return {key: base64.b64encode(getattr(bundle, field)).decode()
            for field, key in KEYS.items()}


def ensure_secret(api: client.ApiClient, namespace: str, name: str,
                  hosts: Sequence[str]) -> Bundle:
    """The valid bundle stored in Secret ``namespace/name``, renewing it if needed."""
    core = client.CoreV1Api(api)
    for _ in range(MAX_RACES):
        secret = core.read_namespaced_secret(name, namespace)
        current = _decode(secret.data)
        wanted = renew(current, hosts)
        if wanted == current:
            return current
        assert secret.metadata is not None  # every object the apiserver returns has one
        body = {"metadata": {"resourceVersion": secret.metadata.resource_version},
                "data": _encode(wanted)}
        try:
            core.patch_namespaced_secret(name, namespace, body)
        except ApiException as exc:
            if exc.status == 409:  # another replica renewed first: use theirs
                continue
            raise
        log.info("stored a new serving certificate", extra={"secret": f"{namespace}/{name}"})
        return wanted
    raise RuntimeError(f"Secret {namespace}/{name} kept changing; giving up after "
                       f"{MAX_RACES} attempts")


def ensure_ca_bundle(api: client.ApiClient, config_name: str, ca_cert: bytes) -> bool:
    """Point every webhook of the configuration at ``ca_cert``; True if anything changed."""
    admission = client.AdmissionregistrationV1Api(api)
    current = admission.read_mutating_webhook_configuration(config_name)
    wanted = base64.b64encode(ca_cert).decode()
    ops = []
    for index, webhook in enumerate(current.webhooks or []):
        have = webhook.client_config.ca_bundle
        if have != wanted:
            # "test" first: if the chart replaced the webhook list meanwhile, fail
            # instead of patching the wrong entry.
            ops.append({"op": "test", "path": f"/webhooks/{index}/name",
                        "value": webhook.name})
            ops.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle",
                        "value": wanted})
    if ops:
        admission.patch_mutating_webhook_configuration(config_name, ops)
        log.info("set the webhook caBundle", extra={"config": config_name})
    return bool(ops)


def write_pem(bundle: Bundle, directory: Path) -> Path:
    """Write key and certificate into one file, atomically; return its path.

    One file, one rename: kopf reloads it while serving, and two files renamed one after
    the other could be read as a mismatched pair in between.
    """
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / "tls.pem"
    content = bundle.key + bundle.cert
    if path.exists() and path.read_bytes() == content:
        return path
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tls.pem.")
    with os.fdopen(fd, "wb") as fh:
        fh.write(content)
    os.replace(tmp, path)
    return path
