"""Imports inside ``sidecar/`` only point down: the layers of docs/design.md, enforced.

Every ``import``/``from`` statement of every module is read with ``ast`` — including the
lazy ones inside functions and those under ``TYPE_CHECKING``, since both are real
dependencies — and each target ``sidecar.*`` module must sit in the same layer or below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sidecar"

# Lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Facts and helpers with no knowledge of leases.
    ("sidecar", "sidecar.base"),
    # What a sidecar is told, as data.
    ("sidecar.settings",),
    # The Kubernetes API client, and what a contender may claim.
    ("sidecar.kube", "sidecar.kubeapi", "sidecar.kubewatch", "sidecar.state"),
    # The lease contract, the registry and every backend.
    ("sidecar.lease",),
    # The election loop and everything that reads the state.
    ("sidecar.elector", "sidecar.publish", "sidecar.watchdog", "sidecar.appready",
     "sidecar.rollout", "sidecar.shards",
     "sidecar.metrics"),
    # Loading settings (asks the backends' entries), wiring one sidecar.
    ("sidecar.config", "sidecar.statedir", "sidecar.runtime"),
    # Entry points.
    ("sidecar.cli", "sidecar.__main__", "sidecar.injector",
     "sidecar.operator"),
)

# Within the lease layer: the contract never imports a backend (the registry loads them
# by name, so running on SQLite never imports asyncpg, pyodbc or kubernetes), and no
# backend imports another backend.
BACKENDS = ("sidecar.lease.sqlite", "sidecar.lease.postgres_advisory",
            "sidecar.lease.postgres_row", "sidecar.lease.sqlserver", "sidecar.lease.kubernetes")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every ``sidecar`` module named by an import statement in ``source``."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            # ``from sidecar.lease import sqlite`` names a submodule, not an attribute.
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if (PACKAGE.parent / f"{base}.{alias.name}".replace(".", "/")).exists()
                         or (PACKAGE.parent / (f"{base}.{alias.name}".replace(".", "/") + ".py")
                             ).exists())
    return {name for name in found if name == "sidecar" or name.startswith("sidecar.")}


def family(module: str) -> str | None:
    return next((b for b in BACKENDS if module == b or module.startswith(b + ".")), None)


def violations(module: str, imports: set[str]) -> list[str]:
    problems = []
    own = layer_of(module)
    for target in sorted(imports):
        if layer_of(target) > own:
            problems.append(f"{module} (layer {own}) imports {target} "
                            f"(layer {layer_of(target)})")
        mine, theirs = family(module), family(target)
        if theirs is not None and mine != theirs:
            problems.append(f"{module} imports the backend {target}: backends are loaded "
                            "by name through sidecar.lease.backend_entry")
    return problems


def all_modules() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        graph[name] = imported_modules(path.read_text(), name, path.name == "__init__.py")
    return graph


def test_no_module_imports_a_higher_layer() -> None:
    problems = [p for name, imports in all_modules().items() for p in violations(name, imports)]
    assert problems == []


def test_no_import_cycle_between_modules() -> None:
    graph = all_modules()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = [*path[path.index(node):], node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done or node not in graph:
            return
        for target in graph[node]:
            if target != node and not node.startswith(target + "."):
                visit(target, [*path, node])
        done.add(node)

    for name in graph:
        visit(name, [])


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("sidecar.lease.sqlite", "from sidecar.config import Settings",
     "sidecar.lease.sqlite (layer 3) imports sidecar.config (layer 5)"),
    ("sidecar.kube", "def f():\n    from sidecar.lease import BackendEntry\n",
     "sidecar.kube (layer 2) imports sidecar.lease (layer 3)"),
    ("sidecar.settings", "if TYPE_CHECKING:\n    import sidecar.state\n",
     "sidecar.settings (layer 1) imports sidecar.state (layer 2)"),
    ("sidecar.lease", "from sidecar.lease import sqlite",
     "sidecar.lease imports the backend sidecar.lease.sqlite"),
])
def test_the_checker_catches_a_forbidden_import(module: str, source: str, expected: str) -> None:
    """The walk itself: an upward import, lazy or type-only, is reported."""
    is_package = module == "sidecar.lease"
    found = violations(module, imported_modules(source, module, is_package))
    assert any(problem.startswith(expected) for problem in found), found


def test_every_module_has_a_layer() -> None:
    for name in all_modules():
        layer_of(name)
