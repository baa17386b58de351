"""Draw the docs' diagrams from their Graphviz sources: ``python -m scripts.diagrams``.

Each ``docs/diagrams/NAME.dot`` becomes ``docs/images/NAME.svg`` (``dot -Tsvg``; Debian's
``graphviz`` package). The SVG carries the SHA-256 of its source in a comment, so a test
(tests/unit/test_diagrams.py) finds a picture older than its source without Graphviz; the
site and the forge show the committed SVG, so building the docs needs no Graphviz either.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = REPO / "docs" / "diagrams"
IMAGES = REPO / "docs" / "images"
MARK = "<!-- drawn from docs/diagrams/{name} sha256:{digest} -->"


def digest(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()


def mark(source: Path) -> str:
    return MARK.format(name=source.name, digest=digest(source))


def picture(source: Path) -> Path:
    return IMAGES / f"{source.stem}.svg"


def draw(source: Path) -> Path:
    svg = subprocess.run(["dot", "-Tsvg", str(source)], capture_output=True, text=True,
                         check=True).stdout
    # The mark after the XML declaration, which must stay first.
    head, _, rest = svg.partition("\n")
    out = picture(source)
    out.write_text(f"{head}\n{mark(source)}\n{rest}" if head.startswith("<?xml")
                   else f"{mark(source)}\n{svg}")
    return out


def main() -> int:
    if shutil.which("dot") is None:
        print("scripts.diagrams: needs Graphviz's dot (apt-get install graphviz)",
              file=sys.stderr)
        return 2
    for source in sorted(SOURCES.glob("*.dot")):
        print(f"drew {draw(source).relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
