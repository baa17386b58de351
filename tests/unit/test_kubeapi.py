"""sidecar.kubeapi without an apiserver: the one-line request names and the kubeconfig
forms it refuses. Requests against the real apiserver: tests/integration/test_kubeapi.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.kubeapi import CredentialsError, Gone, describe, error_for, load_credentials


@pytest.mark.parametrize(("method", "path", "watch", "text"), [
    ("PATCH", "/api/v1/namespaces/t/pods/a", False, "patch pods t/a"),
    ("GET", "/api/v1/namespaces/t/pods?labelSelector=x", False, "list pods t"),
    ("GET", "/api/v1/namespaces/t/pods", True, "watch pods t"),
    ("POST", "/api/v1/namespaces/t/events", False, "create events t"),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/t/leases/l", False, "update leases t/l"),
    ("GET", "/api/v1/namespaces/t", False, "get namespaces t"),
])
def test_a_request_is_named_by_verb_and_resource(method: str, path: str, watch: bool,
                                                 text: str) -> None:
    assert describe(method, path, watch) == text


def test_errors_are_one_line() -> None:
    body = json.dumps({"message": "pods \"a\" is forbidden: User \"x\" cannot patch\n..."})
    assert str(error_for(403, body.encode(), "PATCH", "/api/v1/namespaces/t/pods/a")) == (
        "forbidden: patch pods t/a")
    conflict = error_for(409, b'{"message": "the object\\nhas been modified"}', "PUT",
                         "/apis/coordination.k8s.io/v1/namespaces/t/leases/l")
    assert (conflict.status, str(conflict)) == (
        409, "update leases t/l: HTTP 409: the object has been modified")
    assert str(error_for(502, b"<html>\n</html>", "GET", "/api/v1/namespaces/t/pods/a")) == (
        "get pods t/a: HTTP 502")
    # A watch's 410 (its version is too old), as an answer or as an ERROR event's Status.
    gone = error_for(410, b'{"message": "too old resource version: 1 (30)"}', "GET",
                     "/api/v1/namespaces/t/pods", watch=True)
    assert isinstance(gone, Gone) and str(gone) == (
        "watch pods t: HTTP 410: too old resource version: 1 (30)")


@pytest.mark.parametrize("plugin", ["exec", "auth-provider"])
def test_credential_plugins_are_refused_by_name(plugin: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "config"
    path.write_text(json.dumps({
        "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {plugin: {"command": "x"}}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(path))
    with pytest.raises(CredentialsError, match=rf"uses {plugin}, which lease-sidecar does not "):
        load_credentials()
