"""The repository's documents stand on their own: links resolve, nothing points outside,
the README stays a front door that reaches every page of the docs site."""

import re
import subprocess

import yaml

from testkit.support import REPO


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if not line.startswith("bench/results/")]


def documents():
    return [REPO / "README.md", REPO / "DEVELOPMENT.md", REPO / "CHANGELOG.md",
            REPO / "charts" / "lease-sidecar" / "README.md",
            *sorted((REPO / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """A heading's anchor as the forge (and mkdocs.yml's slugify) makes it."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading.strip()).lower()
    text = re.sub(r"\]\([^)]*\)|[\[\]]", "", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def links(document) -> list[tuple[str, str]]:
    text = re.sub(r"^```.*?^```", "", document.read_text(), flags=re.M | re.S)
    return re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text)


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


def test_relative_links_and_their_anchors_resolve():
    assert REPO / "docs" / "design.md" in documents()
    broken = []
    for document in documents():
        for target, anchor in links(document):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path = (document.parent / target) if target else document
            if not path.exists():
                broken.append(f"{document.relative_to(REPO)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{document.relative_to(REPO)}: {target}#{anchor}")
    assert not broken, broken


def test_the_readme_is_a_short_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    # The two set-up commands stay at the top: the sidecar on the embedded default, and
    # the test suite that CI runs.
    top = readme[:readme.index("## How the application sees it")]
    assert "pip install . && lease-sidecar run" in top
    assert "```sh\nscripts/test\n```" in top
    assert "scripts/test" in (REPO / ".ci" / "run").read_text()
    assert "docs/design.md" in readme


def test_every_docs_page_is_on_the_readme_map_and_in_the_site_nav():
    readme = (REPO / "README.md").read_text()
    linked = {target for target, _ in links(REPO / "README.md")}
    pages = {p.relative_to(REPO).as_posix() for p in (REPO / "docs").rglob("*.md")}
    assert pages - linked == set(), "pages the README's map does not reach"
    config = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)

    def walk(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from walk(value)

    # The site's hook adds the CHANGELOG, the development guide and the chart's README
    # as pages (scripts/mkdocs_hooks.py REPO_PAGES); everything else is a file in docs/.
    from scripts.mkdocs_hooks import REPO_PAGES

    nav = {f"docs/{page}" for page in walk(config["nav"]) if page not in REPO_PAGES}
    assert nav == pages
    assert set(REPO_PAGES) <= set(walk(config["nav"]))
    assert "docs/benchmarks.md" in readme


def test_source_paths_named_in_the_docs_exist():
    """Modules move; a page naming `sidecar/x.py` must follow (code spans count too)."""
    missing = []
    for document in documents():
        for path in re.findall(r"\b((?:sidecar|testkit|bench|scripts|tests)/[\w/.-]*\.(?:py|sh))\b",
                               document.read_text()):
            if not (REPO / path).exists():
                missing.append(f"{document.relative_to(REPO)}: {path}")
    assert not missing, missing
