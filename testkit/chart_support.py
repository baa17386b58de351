"""Run the test bed's helm (built from the Go module proxy) against charts/lease-sidecar."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import yaml

from testkit.support import REPO
from testkit.testbed import gobuild

CHART = REPO / "charts" / "lease-sidecar"

# Value sets every test renders: the defaults, each backend, the injector, the api role.
VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "kubernetes-example": ["example.enabled=true"],
    "postgres": ["lease.backend=postgres", "lease.dsnSecret.name=lease-dsn",
                 "example.enabled=true"],
    "postgres-row": ["lease.backend=postgres-row", "lease.dsnSecret.name=lease-dsn"],
    "sqlserver": ["lease.backend=sqlserver",
                  "lease.dsn=Driver=FreeTDS;Server=mssql;Database=app;Trusted_Connection=yes",
                  "lease.podLabel=off", "example.enabled=true"],
    "injector": ["injector.enabled=true"],
    "injector-ignore": ["injector.enabled=true", "injector.failurePolicy=Ignore",
                        "injector.replicas=1"],
    "api-role": ["lease.role=api", "sidecar.readinessProbePath=/readyz",
                 "example.enabled=true", "rbac.extraServiceAccounts={web,jobs}"],
    "network-policy": ["networkPolicy.enabled=true",
                       "networkPolicy.probeSources={10.0.0.0/16,fd00::/64}",
                       "example.enabled=true"],
    "lease-names": [r"lease.name=sweeps\,reports", "rbac.leaseNames={batch}",
                    "injector.enabled=true"],
    "any-lease": ["rbac.anyLease=true", "rbac.createLeases=false"],
    "leader-service": ["example.enabled=true", "leaderService.enabled=true"],
    "injector-scheduling": [
        "injector.enabled=true", "injector.podAntiAffinity=hard",
        "injector.nodeSelector.kubernetes\\.io/os=linux",
        "injector.tolerations[0].key=dedicated", "injector.tolerations[0].operator=Exists",
        "injector.topologySpreadConstraints[0].maxSkew=1",
        "injector.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone",
        "injector.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway",
        "injector.priorityClassName=system-cluster-critical",
        "injector.namespaceSelector.matchLabels.env=prod"],
    "no-pod-patch-policy": ["rbac.podPatchPolicy=false", "example.enabled=true"],
    "schema-job": ["lease.backend=postgres-row", "lease.dsnSecret.name=lease-dsn",
                   "schemaJob.enabled=true", "schemaJob.dsnSecret.name=lease-admin-dsn",
                   "sidecar.extraEnv[0].name=LEASE_TABLE", "sidecar.extraEnv[0].value=locks",
                   "sidecar.extraEnv[1].name=LEASE_SAFETY_MARGIN",
                   "sidecar.extraEnv[1].value=2s"],
}


def helm(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The cached helm, with its config/cache/data dirs kept out of $HOME."""
    home = gobuild.cache_root() / "helm-home"
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        env[var] = str(home / var.lower())
    binary = gobuild.ensure_binary("helm")
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def set_args(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def kube_version() -> str:
    """The test bed's Kubernetes version, so ``kubeVersion`` checks see a real cluster.

    helm built from source without release ldflags assumes Kubernetes v1.20 for
    ``helm template``, which the chart's ``kubeVersion: >=1.29`` rightly refuses.
    """
    return gobuild.tool_version("kube-apiserver")


def template(release: str, namespace: str, values: list[str],
             check: bool = True) -> subprocess.CompletedProcess[str]:
    return helm("template", release, str(CHART), "--namespace", namespace,
                "--kube-version", kube_version(), *set_args(values), check=check)


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(docs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    matches = [d for d in docs
               if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, f"expected one {kind} *{name_suffix}, got {len(matches)}"
    return matches[0]


def env_map(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def rules_set(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """A Role's rules as (apiGroup, resource, verb) triples, so layout does not matter."""
    return {(group, resource, verb)
            for rule in role.get("rules") or []
            for group in rule.get("apiGroups", [])
            for resource in rule.get("resources", [])
            for verb in rule.get("verbs", [])}


def named_rules(role: dict[str, Any]) -> set[tuple[str, str, str, tuple[str, ...]]]:
    """As ``rules_set``, with each rule's resourceNames (sorted; () for any name)."""
    return {(group, resource, verb, tuple(sorted(rule.get("resourceNames", ()))))
            for rule in role.get("rules") or []
            for group in rule.get("apiGroups", [])
            for resource in rule.get("resources", [])
            for verb in rule.get("verbs", [])}

