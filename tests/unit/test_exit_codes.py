"""Every exit code has one home (sidecar.base.errors) and one table telling users about it."""

from __future__ import annotations

import re
from pathlib import Path

from sidecar.base import errors
from sidecar.cli import exec_guard

REPO = Path(__file__).resolve().parents[2]


def codes() -> dict[str, int]:
    return {name: value for name, value in vars(errors).items() if name.startswith("EXIT_")}


def test_each_code_means_one_thing() -> None:
    values = list(codes().values())
    assert len(values) == len(set(values)), codes()


def test_the_guard_repeats_the_shell_codes_it_cannot_import() -> None:
    # exec_guard.py runs as a stdlib-only script (python -I -S): it keeps its own copies.
    assert exec_guard.EXIT_CANNOT_EXECUTE == errors.EXIT_CANNOT_EXECUTE == 126
    assert exec_guard.EXIT_COMMAND_NOT_FOUND == errors.EXIT_COMMAND_NOT_FOUND == 127


def test_the_exit_code_table_lists_exactly_these_codes() -> None:
    tables = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = doc.read_text()
        start = text.find("| exit code | meaning |")
        if start >= 0:
            rows = re.findall(r"^\| (\d+) \|", text[start:].split("\n\n")[0], re.M)
            tables.append((doc.name, {int(code) for code in rows}))
    assert len(tables) == 1, f"want one exit code table in the docs, found {tables}"
    assert tables[0][1] == {0, *codes().values()}, tables[0]
