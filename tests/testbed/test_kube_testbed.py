"""The kube test bed itself: a real apiserver with real RBAC, plus a working helm.

Run: python -m pytest tests/testbed/test_kube_testbed.py -p tests.testbed.kube_fixtures
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from testkit.testbed import gobuild
from testkit.testbed.kube import ControlPlane

pytestmark = pytest.mark.kube


def _get_json(cp: ControlPlane, path: str) -> dict:
    req = urllib.request.Request(cp.server + path)
    with urllib.request.urlopen(req, timeout=10, context=cp.admin_ssl_context()) as resp:
        return json.load(resp)


def _pod_manifest(namespace: str, name: str) -> str:
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": [{"name": "app", "image": "example.invalid/app:1"}]},
        }
    )


def test_version_reports_built_release(control_plane: ControlPlane) -> None:
    version = _get_json(control_plane, "/version")
    assert version["gitVersion"] == control_plane.version
    assert version["gitVersion"] == gobuild.tool_version("kube-apiserver")
    major, minor = (int(version["major"]), int(version["minor"].rstrip("+")))
    assert (major, minor) >= (1, 34)
    assert version["gitTreeState"] == "clean"
    # The matching kubectl sees the same server version and reports its own as equal.
    out = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == control_plane.version
    assert out["clientVersion"]["gitVersion"] == control_plane.version


def test_pod_is_stored_and_stays_pending(control_plane: ControlPlane, kube_namespace: str) -> None:
    control_plane.kubectl("apply", "-f", "-", input=_pod_manifest(kube_namespace, "p1"))
    time.sleep(2)  # nothing schedules it, however long we wait
    pod = json.loads(
        control_plane.kubectl("-n", kube_namespace, "get", "pod", "p1", "-o", "json").stdout
    )
    assert pod["status"]["phase"] == "Pending"
    assert "nodeName" not in pod["spec"]
    # ServiceAccount admission ran: the pod got the namespace's default ServiceAccount.
    assert pod["spec"]["serviceAccountName"] == "default"


def _can_i(cp: ControlPlane, kubeconfig: Path, namespace: str) -> str:
    proc = cp.kubectl(
        "auth", "can-i", "get", "pods", "-n", namespace, kubeconfig=kubeconfig, check=False
    )
    return proc.stdout.strip()


def _raw_get_status(cp: ControlPlane, path: str, token: str) -> int:
    req = urllib.request.Request(cp.server + path, headers={"Authorization": f"Bearer {token}"})
    # No client cert: it would take precedence and the request would run as admin.
    try:
        with urllib.request.urlopen(req, timeout=10, context=cp.ssl_context()) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_rbac_denies_service_account_without_role(
    control_plane: ControlPlane, kube_namespace: str
) -> None:
    cp = control_plane
    kubeconfig = cp.service_account_kubeconfig(kube_namespace, "nobody")
    assert _can_i(cp, kubeconfig, kube_namespace) == "no"
    proc = cp.kubectl("-n", kube_namespace, "get", "pods", kubeconfig=kubeconfig, check=False)
    assert proc.returncode != 0
    assert "forbidden" in proc.stderr.lower()
    assert "system:serviceaccount:" + kube_namespace + ":nobody" in proc.stderr

    token = cp.service_account_token(kube_namespace, "nobody")
    pods_path = f"/api/v1/namespaces/{kube_namespace}/pods"
    assert _raw_get_status(cp, pods_path, token) == 403
    assert _raw_get_status(cp, pods_path, "not-a-token") == 401

    # Control: the same identity is allowed once a Role is bound, so the 403 was RBAC.
    cp.kubectl(
        "-n", kube_namespace, "create", "role", "pod-reader", "--verb=get,list", "--resource=pods"
    )
    cp.kubectl(
        "-n",
        kube_namespace,
        "create",
        "rolebinding",
        "nobody-reads",
        "--role=pod-reader",
        f"--serviceaccount={kube_namespace}:nobody",
    )
    assert _can_i(cp, kubeconfig, kube_namespace) == "yes"
    assert _raw_get_status(cp, pods_path, token) == 200
    other = cp.create_namespace()
    assert _can_i(cp, kubeconfig, other) == "no"  # a Role is namespaced


def _helm(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # Keep helm's cache/config/data out of $HOME.
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(tmp_path / var.lower())
    helm = gobuild.ensure_binary("helm")
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60, env=env)


def test_helm_runs_from_cache(
    control_plane: ControlPlane, kube_namespace: str, tmp_path: Path
) -> None:
    helm = gobuild.ensure_binary("helm")
    assert gobuild.cache_root() in helm.parents
    proc = _helm(["version", "--template", "{{.Version}}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == gobuild.tool_version("helm")
    # And it talks to the test bed's apiserver.
    proc = _helm(
        ["list", "-n", kube_namespace, "--kubeconfig", str(control_plane.kubeconfig), "-o", "json"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_a_hard_apiserver_restart_keeps_port_data_and_credentials() -> None:
    """What the chaos harness's backend-restart fault does: SIGKILL kube-apiserver, then
    start it from a worker thread that ends right after (a parent-death signal tied to that
    thread would take the new apiserver down with it)."""
    with ControlPlane() as cp:
        namespace = cp.create_namespace("restart")
        reader = cp.service_account_kubeconfig(namespace, "reader")
        port = cp.apiserver_port
        cp.kill_apiserver()
        down = cp.kubectl("get", "namespace", namespace, "--request-timeout=3s", check=False)
        assert down.returncode != 0
        worker = threading.Thread(target=cp.start_apiserver)
        worker.start()
        worker.join(150)
        assert not worker.is_alive()
        time.sleep(1)  # the thread is gone; the apiserver must outlive it
        assert cp.apiserver_port == port
        got = cp.kubectl("get", "namespace", namespace, "-o", "name").stdout.strip()
        assert got == f"namespace/{namespace}"  # etcd kept the data
        # A token issued before the restart still authenticates: Forbidden, not Unauthorized.
        denied = cp.kubectl("-n", namespace, "get", "pods", kubeconfig=reader, check=False)
        assert "Forbidden" in denied.stderr, denied.stderr
