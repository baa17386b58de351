"""The support layers: ``testkit`` (shared test and benchmark support) sits under both
``tests`` and ``bench``, which never import each other.

Every ``import`` and ``from`` statement of the three trees is read with ``ast`` (also the
ones inside functions, which a lazy import hides from a module-level scan).
"""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

from testkit.support import REPO

# tree -> the top-level packages it may not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "testkit": ("tests", "bench"),
    "bench": ("tests",),
    "tests": ("bench",),
}


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``; relative imports are
    resolved against ``package`` (the dotted package the file is in)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return found


def violations(tree: str, rel_path: str, source: str) -> list[str]:
    """``path:line imports module`` for each import ``tree`` may not make."""
    package = ".".join(Path(rel_path).with_suffix("").parts[:-1])
    banned = FORBIDDEN[tree]
    return [f"{rel_path}:{line} imports {module}"
            for line, module in imported_modules(source, package)
            if module.split(".")[0] in banned]


def test_no_import_goes_against_the_layers() -> None:
    found = []
    checked = 0
    for tree in FORBIDDEN:
        for path in sorted((REPO / tree).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            found += violations(tree, rel, path.read_text())
            checked += 1
    assert checked > 50, f"only {checked} files found under {list(FORBIDDEN)}"
    assert not found, "imports against the support layers:\n" + "\n".join(found)


def test_the_check_sees_each_forbidden_direction() -> None:
    """The walk above would pass on a tree it cannot read; these sources must fail."""
    bad = {
        ("bench", "bench/bench_core.py"): "from tests.support import SidecarProcess\n",
        ("tests", "tests/chaos/test_x.py"): "def f():\n    import bench.chaos.harness\n",
        ("testkit", "testkit/chaos/harness.py"): "from tests.testbed import kube_fixtures\n",
        ("testkit", "testkit/testbed/kube.py"): "from ...bench import failover\n",
    }
    for (tree, rel), source in bad.items():
        assert violations(tree, rel, source), f"{rel}: {source!r} was not caught"
    fine = "from testkit.support import SidecarProcess\nfrom sidecar import cli\n"
    for tree in FORBIDDEN:
        assert not violations(tree, f"{tree}/x.py", fine)


def test_testkit_is_not_shipped_in_the_wheel() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(fnmatch.fnmatch(name, pattern)
                   for pattern in include for name in ("testkit", "testkit.testbed"))
    assert any(fnmatch.fnmatch("sidecar", pattern) for pattern in include)
