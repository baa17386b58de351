"""The one-node cluster itself: a real node, real pods, and the paths pods depend on.

Run alone: python -m pytest tests/testbed/test_cluster.py -m pods
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading

import pytest

from testkit.testbed import gobuild
from testkit.testbed.cluster import Cluster

pytestmark = [pytest.mark.pods, pytest.mark.slow]


def _pod(name: str, image: str, script: str, **spec: object) -> str:
    return json.dumps({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "main",
                "image": image,
                "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", script],
            }],
            **spec,
        },
    })


def _wait_phase(
    cluster: Cluster, ns: str, name: str, phases: set[str], timeout: float = 60
) -> dict:
    def done() -> dict | None:
        pod = cluster.kubectl_json("-n", ns, "get", "pod", name)
        return pod if pod["status"].get("phase") in phases else None

    return cluster.wait_for(done, timeout, f"pod {ns}/{name} in {sorted(phases)}")


def test_node_is_ready_with_the_built_release(pod_cluster: Cluster) -> None:
    node = pod_cluster.kubectl_json("get", "node", pod_cluster.node_name)
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == gobuild.tool_version("kubelet")
    assert info["containerRuntimeVersion"].startswith("containerd://1.")
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == pod_cluster.node_ip
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready[0]["status"] == "True"
    # The controller manager and the scheduler run: a namespace gets its default
    # ServiceAccount and root CA by itself.
    ns = pod_cluster.create_namespace("smoke")
    pod_cluster.wait_for(
        lambda: pod_cluster.kubectl("-n", ns, "get", "cm", "kube-root-ca.crt",
                                    check=False).returncode == 0,
        30, "kube-root-ca.crt",
    )


def test_pod_runs_on_the_bridge_and_reaches_apiserver_and_host(pod_cluster: Cluster) -> None:
    cluster = pod_cluster
    ns = cluster.create_namespace("smoke")
    # A listener on the node IP stands in for a database on the host.
    with socket.socket() as server:
        server.bind((cluster.node_ip, 0))
        server.listen()
        port = server.getsockname()[1]
        got: list[bytes] = []

        def accept() -> None:
            server.settimeout(60)
            conn, _ = server.accept()
            with conn:
                got.append(conn.recv(100))

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        script = (
            "set -e; "
            # Through the `kubernetes` Service IP and the DNAT to 127.0.0.1. Plain HTTP
            # to its TLS port: Go's server answers that itself, which proves the path
            # (busybox's TLS client has no cipher suite in common with it).
            "printf 'GET /version HTTP/1.0\\r\\n\\r\\n' | "
            "nc -w 5 $KUBERNETES_SERVICE_HOST $KUBERNETES_SERVICE_PORT; echo; "
            f"echo hello-from-pod | nc -w 5 {cluster.node_ip} {port}"
        )
        cluster.kubectl("-n", ns, "apply", "-f", "-",
                        input=_pod("probe", cluster.busybox(), script))
        pod = _wait_phase(cluster, ns, "probe", {"Succeeded", "Failed"})
        thread.join(timeout=10)
    logs = cluster.kubectl("-n", ns, "logs", "probe").stdout
    assert pod["status"]["phase"] == "Succeeded", logs
    assert "Client sent an HTTP request to an HTTPS server" in logs
    assert got == [b"hello-from-pod\n"]
    pod_ip = ipaddress.ip_address(pod["status"]["podIP"])
    assert pod_ip in ipaddress.ip_network(cluster.pod_cidr)
    assert pod["spec"]["nodeName"] == cluster.node_name


def test_exec_and_kubelet_stats(pod_cluster: Cluster) -> None:
    cluster = pod_cluster
    ns = cluster.create_namespace("smoke")
    script = "trap 'exit 0' TERM; while true; do sleep 0.2; done"
    cluster.kubectl("-n", ns, "apply", "-f", "-", input=_pod("idle", cluster.busybox(), script))
    _wait_phase(cluster, ns, "idle", {"Running"})
    # apiserver -> kubelet (its client certificate) -> containerd's stream server.
    out = cluster.kubectl("-n", ns, "exec", "idle", "--", "cat", "/proc/1/cmdline").stdout
    assert "while true" in out
    summary = cluster.wait_for(
        lambda: next((p for p in cluster.kubelet_get("/stats/summary")["pods"]
                      if p["podRef"]["name"] == "idle" and p.get("containers")), None),
        60, "kubelet stats for the pod",
    )
    main = summary["containers"][0]
    assert main["name"] == "main"
    assert main["memory"]["workingSetBytes"] > 0
    # A trapped SIGTERM ends the pod at once, not after the grace period.
    cluster.kubectl("-n", ns, "delete", "pod", "idle", "--wait=true", timeout=30)
