"""The sidecar's own Kubernetes client (sidecar.kubeapi) against the real kube-apiserver.

Every credential form it accepts is used for real: the admin kubeconfig (embedded client
certificate), the deploy/rbac.yaml ServiceAccount (token, and a 403 for what its Role does
not grant), ``insecure-skip-tls-verify``, a kubeconfig ``tokenFile``, and the in-cluster
layout (token file, CA file, namespace file) with the token file rewritten to a new
token as kubelet's rotation does.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import urlparse

import pytest

from sidecar import kubeapi
from sidecar.kubeapi import KubeClient, KubeError
from testkit.kube_support import SERVICE_ACCOUNT, create_pods, install_rbac
from testkit.testbed.kube import ControlPlane

pytestmark = [pytest.mark.kube]


def client_for(kubeconfig: Path, monkeypatch: pytest.MonkeyPatch,
               namespace: str | None = None) -> KubeClient:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    return KubeClient.connect(namespace)


def pod_path(ns: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{ns}/pods" + (f"/{name}" if name else "")


async def test_admin_client_certificate_reads_patches_and_lists(
        control_plane: ControlPlane, kube_namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    install_rbac(control_plane, kube_namespace)  # the pods' ServiceAccount
    create_pods(control_plane, kube_namespace, "p-0", "p-1")
    client = client_for(control_plane.kubeconfig, monkeypatch, kube_namespace)
    try:
        assert client.credentials.source.startswith("kubeconfig ")
        pod = await client.get(pod_path(kube_namespace, "p-0"))
        assert pod["metadata"]["name"] == "p-0"
        patched = await client.patch(pod_path(kube_namespace, "p-0"),
                                     {"metadata": {"labels": {"lease-role": "leader"}}})
        assert patched["metadata"]["labels"]["lease-role"] == "leader"
        found = await client.list(pod_path(kube_namespace), labelSelector="lease-role=leader")
        assert [p["metadata"]["name"] for p in found["items"]] == ["p-0"]
        assert await client.get_or_none(pod_path(kube_namespace, "nope")) is None
        with pytest.raises(KubeError) as missing:
            await client.get(pod_path(kube_namespace, "nope"))
        assert missing.value.status == 404
        assert str(missing.value) == (f"get pods {kube_namespace}/nope: HTTP 404: "
                                      'pods "nope" not found')
    finally:
        await client.close()


async def test_the_service_accounts_token_and_a_one_line_403(
        control_plane: ControlPlane, kube_namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    kubeconfig = install_rbac(control_plane, kube_namespace)
    create_pods(control_plane, kube_namespace, "p-0")
    client = client_for(kubeconfig, monkeypatch)
    try:
        assert client.namespace == kube_namespace  # from the kubeconfig's context
        await client.patch(pod_path(kube_namespace, "p-0"),
                           {"metadata": {"labels": {"lease-role": "standby"}}})
        with pytest.raises(KubeError) as refused:
            await client.request("DELETE", pod_path(kube_namespace, "p-0"))
        assert (refused.value.status, str(refused.value)) == (
            403, f"forbidden: delete pods {kube_namespace}/p-0")
        with pytest.raises(KubeError, match=r"^forbidden: list secrets "
                                            rf"{kube_namespace}$"):
            await client.list(f"/api/v1/namespaces/{kube_namespace}/secrets")
    finally:
        await client.close()


async def test_a_watch_streams_changes(
        control_plane: ControlPlane, kube_namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    install_rbac(control_plane, kube_namespace)
    create_pods(control_plane, kube_namespace, "w-0")
    client = client_for(control_plane.kubeconfig, monkeypatch, kube_namespace)
    try:
        listed = await client.list(pod_path(kube_namespace))
        version = listed["metadata"]["resourceVersion"]
        seen: list[tuple[str, str | None]] = []

        async def follow() -> None:
            async for kind, obj in client.watch(pod_path(kube_namespace), version,
                                                timeout_seconds=10):
                seen.append((kind, (obj["metadata"].get("labels") or {}).get("x")))
                if kind == "DELETED":
                    return

        watching = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        await client.patch(pod_path(kube_namespace, "w-0"), {"metadata": {"labels": {"x": "1"}}})
        control_plane.kubectl("-n", kube_namespace, "delete", "pod", "w-0", "--wait=false")
        await asyncio.wait_for(watching, 10)
        assert seen[0] == ("MODIFIED", "1") and seen[-1][0] == "DELETED"
        # (410 Gone could not be provoked here: this apiserver's watch cache serves even
        # versions etcd has compacted away; tests/unit/test_kubeapi.py maps the answer.)
    finally:
        await client.close()


def write_token_kubeconfig(path: Path, cp: ControlPlane, user: dict[str, str],
                           cluster: dict[str, object]) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": cp.server, **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return path


async def test_insecure_skip_tls_verify_and_a_token_file(
        control_plane: ControlPlane, kube_namespace: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    install_rbac(control_plane, kube_namespace)
    create_pods(control_plane, kube_namespace, "p-0")
    token = control_plane.service_account_token(kube_namespace, SERVICE_ACCOUNT)
    (tmp_path / "token").write_text(token)
    path = write_token_kubeconfig(tmp_path / "kc.json", control_plane,
                                  {"tokenFile": "token"}, {"insecure-skip-tls-verify": True})
    client = client_for(path, monkeypatch, kube_namespace)
    try:
        pod = await client.get(pod_path(kube_namespace, "p-0"))
        assert pod["metadata"]["name"] == "p-0"
    finally:
        await client.close()
    # Without the flag and without a CA the server's certificate is not trusted.
    path = write_token_kubeconfig(tmp_path / "kc2.json", control_plane, {"token": token}, {})
    client = client_for(path, monkeypatch, kube_namespace)
    try:
        with pytest.raises(KubeError, match=r"^get pods .*/p-0: .*certificate"):
            await client.get(pod_path(kube_namespace, "p-0"))
    finally:
        await client.close()


async def test_in_cluster_credentials_follow_a_rotated_token(
        control_plane: ControlPlane, kube_namespace: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    install_rbac(control_plane, kube_namespace)
    create_pods(control_plane, kube_namespace, "p-0")
    mounted = tmp_path / "serviceaccount"
    mounted.mkdir()
    (mounted / "ca.crt").write_bytes(control_plane.ca_cert.read_bytes())
    (mounted / "namespace").write_text(kube_namespace)
    (mounted / "token").write_text("not-a-token")
    server = urlparse(control_plane.server)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", server.hostname or "")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
    monkeypatch.setattr(kubeapi, "SERVICE_ACCOUNT_DIR", mounted)
    client = KubeClient.connect()
    try:
        assert (client.credentials.source, client.namespace) == ("in-cluster", kube_namespace)
        with pytest.raises(KubeError) as refused:
            await client.get(pod_path(kube_namespace, "p-0"))
        assert refused.value.status == 401
        assert str(refused.value).startswith(f"unauthorized: get pods {kube_namespace}/p-0")
        # kubelet writes a new token: the next request (a 401 first) re-reads the file.
        (mounted / "token").write_text(
            control_plane.service_account_token(kube_namespace, SERVICE_ACCOUNT))
        pod = await client.get(pod_path(kube_namespace, "p-0"))
        assert pod["metadata"]["name"] == "p-0"
    finally:
        await client.close()
