"""Every ``# type: ignore`` names its error code and says why (mypy checks sidecar/ in
scripts/test and reports unused ones there; elsewhere the reason is what a reader has)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IGNORE = re.compile(r"#\s*type:\s*ignore")
WITH_REASON = re.compile(r"#\s*type:\s*ignore\[[a-z-]+(?:, *[a-z-]+)*\]  # \S")


def test_each_type_ignore_has_a_code_and_a_reason() -> None:
    bare = []
    for top in ("sidecar", "tests", "testkit", "bench"):
        for path in sorted((REPO / top).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if IGNORE.search(line) and not WITH_REASON.search(line) and path != Path(
                        __file__).resolve():
                    bare.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not bare, "\n".join(bare)
