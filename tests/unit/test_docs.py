"""The repository's documents stand on their own: links resolve, nothing points outside."""

import re
import subprocess

from testkit.support import REPO


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if not line.startswith("bench/results/")]


def test_nothing_refers_to_documents_outside_the_repository():
    # Built from parts, so this file does not match itself.
    outside = re.compile("|".join([r"DESIGN" + r"\.md", r"\.\./" + "shared"]))
    hits = []
    for name in tracked_files():
        path = REPO / name
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1)
                 if outside.search(line)]
    assert not hits, hits


def test_relative_links_in_the_docs_resolve():
    documents = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert REPO / "docs" / "design.md" in documents
    for document in documents:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            assert (document.parent / target).exists(), f"{document.name}: {target}"
    assert "docs/design.md" in (REPO / "README.md").read_text()
