"""The one Kubernetes object-name rule (sidecar.base.names), as the apiserver applies it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sidecar.base.names import MAX_OBJECT_NAME, is_object_name, object_name_problem, prefixed


@pytest.mark.parametrize("name", [
    "a", "lease-sidecar.default", "lease-sidecar.nightly-2", "0", "a.b.c", "x" * 253,
    "a-b.c-d", "1.2.3",
])
def test_valid_object_names(name: str) -> None:
    assert is_object_name(name)


@pytest.mark.parametrize("name", [
    "", "Upper_Case", "lease-sidecar.Upper", "under_score", "-a", "a-", ".a", "a.", "a..b",
    "a.-b", "a b", "a\n", "lease-sidecar.jobs\n", "x" * 254, "ä", "a/b", "a:b",
])
def test_invalid_object_names(name: str) -> None:
    assert not is_object_name(name)


def test_prefix_and_problem_line() -> None:
    assert prefixed("lease-sidecar", "jobs") == "lease-sidecar.jobs"
    assert prefixed("", "jobs") == "jobs"
    assert object_name_problem("lease-sidecar", "jobs") is None
    problem = object_name_problem("lease-sidecar", "Upper_Case")
    assert problem is not None and "\n" not in problem
    assert problem.startswith("'lease-sidecar.Upper_Case' (key prefix + name) is not a valid "
                              "Kubernetes object name")
    # The length counts prefix and name together.
    assert object_name_problem("p", "x" * (MAX_OBJECT_NAME - 2)) is None
    assert object_name_problem("p", "x" * (MAX_OBJECT_NAME - 1)) is not None


def test_names_is_a_bottom_layer_module() -> None:
    """It must import nothing from sidecar, so config, backends and injector can share it."""
    source = (Path(__file__).resolve().parents[2] / "sidecar" / "base" / "names.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert not {m for m in imported if m.split(".")[0] == "sidecar"}, imported


def test_kubernetes_backend_uses_the_same_rule() -> None:
    from sidecar.config import ConfigError, load
    from sidecar.lease.kubernetes import check_name

    settings = load({"backend": "kubernetes"}, env={})
    check_name(settings.store, "jobs")
    assert settings.store.key("jobs") == "lease-sidecar.jobs"
    for bad in ("Upper_Case", "a\n"):
        with pytest.raises(ConfigError, match="is not a valid Kubernetes object name"):
            check_name(settings.store, bad)
