"""A real sidecar on the kubernetes backend started without credentials: it can never
lead, and its probes say so (issue 19: before, ``/healthz`` — the chart's probe path —
answered 200, so the pod was Ready and nobody noticed that it never led).

No apiserver is needed: the point is that there is nothing to reach one with. The
credentials rule is sidecar.kube's (KUBECONFIG, else the in-cluster token, else
~/.kube/config); each test gives the process an empty HOME so ~/.kube/config is none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.runtime import CREDENTIALS_RECHECK
from testkit.support import SidecarProcess, free_port, get_json, wait_until

TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def _sidecar(tmp_path: Path, env: dict[str, str]) -> SidecarProcess:
    home = tmp_path / "home"
    home.mkdir()
    # Only what this test sets: no KUBECONFIG or in-cluster variables from the runner.
    base = {"HOME": str(home), "KUBECONFIG": "", "KUBERNETES_SERVICE_HOST": "",
            "KUBERNETES_SERVICE_PORT": ""}
    proc = SidecarProcess(tmp_path, "tokenless", env={**base, **env},
                          args=["--backend", "kubernetes", "--name", "web",
                                "--pod-label", "off", "--lease-duration", "2s"])
    proc.start()
    proc.wait_http()
    return proc


def _messages(proc: SidecarProcess) -> list[str]:
    lines = [json.loads(line) for line in proc.logs().splitlines() if line.startswith("{")]
    return [line["msg"] for line in lines]


def _probes(proc: SidecarProcess) -> dict[str, tuple[int, object]]:
    return {path: get_json(proc.url + path)[:2] for path in ("/livez", "/healthz", "/readyz")}


@pytest.mark.parametrize("where", ["in-cluster", "kubeconfig"])
def test_without_credentials_healthz_and_readyz_say_it_can_never_lead(
        tmp_path: Path, where: str) -> None:
    if where == "in-cluster":
        if TOKEN.exists():
            pytest.skip(f"{TOKEN} exists here: this machine is a pod with a token")
        # In a pod whose spec says automountServiceAccountToken: false.
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1"}
        cause = f"no ServiceAccount token at {TOKEN}"
    else:
        env = {"KUBECONFIG": str(tmp_path / "missing-kubeconfig")}
        cause = f"no kubeconfig at {tmp_path / 'missing-kubeconfig'}"
    proc = _sidecar(tmp_path, env)
    try:
        probes = _probes(proc)
        assert probes["/livez"] == (200, {"ok": True})  # a restart would bring no token
        for path in ("/healthz", "/readyz"):
            status, body = probes[path]
            assert status == 503, path
            assert isinstance(body, dict) and body["ok"] is False
            assert body["reason"].startswith("cannot lead: kubernetes: no usable credentials")
            assert cause in body["reason"]
            if where == "in-cluster":
                assert "automountServiceAccountToken false?" in body["reason"]
        assert proc.leader() == 503
        # A few rounds of retries later: still one line saying why, not one per retry.
        wait_until(lambda: "backend unreachable" in proc.logs(), timeout=10)
        assert get_json(proc.url + "/healthz")[0] == 503
        assert [m for m in _messages(proc) if "credentials" in m] == [
            "no kubernetes credentials: this sidecar can never lead until it has some; "
            "/healthz and /readyz answer 503"]
    finally:
        assert proc.stop() == 0


def test_credentials_that_appear_later_make_it_healthy_again(tmp_path: Path) -> None:
    """A kubeconfig that shows up (an optional Secret filled in later) is found within
    CREDENTIALS_RECHECK; the sidecar then waits for the apiserver like any other."""
    kubeconfig = tmp_path / "kubeconfig"
    proc = _sidecar(tmp_path, {"KUBECONFIG": str(kubeconfig)})
    try:
        assert get_json(proc.url + "/healthz")[0] == 503
        port = free_port()  # nothing listens there: credentials, but no apiserver
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}",
                                                   "insecure-skip-tls-verify": True}}],
            "users": [{"name": "u", "user": {"token": "t"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
        wait_until(lambda: get_json(proc.url + "/healthz")[0] == 200,
                   timeout=CREDENTIALS_RECHECK + 5, interval=0.2)
        status, body = get_json(proc.url + "/readyz")[:2]
        assert (status, body) == (503, {"ok": False})  # reachable it is not: not ready
        assert proc.leader() == 503
        assert [m for m in _messages(proc) if "credentials" in m] == [
            "no kubernetes credentials: this sidecar can never lead until it has some; "
            "/healthz and /readyz answer 503",
            "kubernetes credentials found"]
    finally:
        assert proc.stop() == 0
