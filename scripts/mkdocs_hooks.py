"""MkDocs hook: links from docs/ to repository files outside it, and three repository
Markdown files shown on the site as pages of their own.

The pages are read in two places: on the forge, where a relative link such as
``../bench/results/pods.json`` opens the file, and on the MkDocs site, which only holds
``docs/``. So a link that leaves ``docs/`` is kept as written in the Markdown and, for
the site only, rewritten here:

- to one of :data:`REPO_PAGES` (the CHANGELOG, the development guide, the chart's README
  with its values table): a link to that page of the site, which this hook adds from the
  repository's file (its own links rewritten the same way, relative to where it lives);
- to README.md: the site's home page;
- to another Markdown file or a directory: its path in code;
- to any other file (a results JSON, a picture): a copy under ``_repo/`` on the site.

A link whose target does not exist is a warning, which ``mkdocs build --strict`` turns
into a failed build, as it does for links between pages.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.lease_sidecar")

# The site's page -> the repository file it shows.
REPO_PAGES = {"changelog.md": "CHANGELOG.md", "development.md": "DEVELOPMENT.md",
              "chart-values.md": "charts/lease-sidecar/README.md"}
_HOME = "README.md"  # the forge's front door; the site's is index.md
# [text](target) and ![alt](target), the target relative (no scheme, no leading / or #).
_LINK = re.compile(r"(!?)\[([^\]]*)\]\((?![a-z][a-z0-9+.-]*:|[/#])([^)#\s]+)(#[^)\s]*)?\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_COPIED = "_repo"


def _where(src_uri: str) -> str:
    """The repository path of a site page."""
    return REPO_PAGES.get(src_uri, f"docs/{src_uri}")


def _target(page_path: str, target: str, repo: Path) -> str | None:
    """A link's target as a repository path, or None when it leaves the repository."""
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(page_path), target))
    if joined.startswith("../") or joined == "..":
        return None
    return joined if (repo / joined).resolve().is_relative_to(repo) else None


def _sources(docs: Path, repo: Path) -> list[tuple[str, str]]:
    """(repository path, text) of every page the site shows."""
    pages = [(f"docs/{p.relative_to(docs).as_posix()}", p.read_text())
             for p in sorted(docs.rglob("*.md"))]
    return pages + [(path, (repo / path).read_text()) for path in REPO_PAGES.values()]


def on_files(files: Files, config: Any) -> Files:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    for uri, path in REPO_PAGES.items():
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, content=(repo / path).read_text()))
    wanted: set[str] = set()
    for page_path, text in _sources(docs, repo):
        for match in _LINK.finditer(_FENCE.sub("", text)):
            path = _target(page_path, match.group(3), repo)
            if (path and not path.startswith("docs/") and (repo / path).is_file()
                    and not path.endswith(".md")):
                wanted.add(path)
    for path in sorted(wanted):
        uri = f"{_COPIED}/{path}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(repo / path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    src_uri = page.file.src_uri
    page_path = _where(src_uri)
    up = "../" * (len(Path(src_uri).parts) - 1)
    pages = {path: uri for uri, path in REPO_PAGES.items()}

    def rewrite(match: re.Match[str]) -> str:
        bang, text, target, anchor = match.groups()
        path = _target(page_path, target, repo)
        if path is None:
            return match.group(0)
        if path.startswith("docs/"):
            if src_uri in REPO_PAGES:  # a repository page: the link is relative to its file
                return f"{bang}[{text}]({up}{path[len('docs/'):]}{anchor or ''})"
            return match.group(0)  # between pages of docs/: MkDocs checks it
        if not (repo / path).exists():
            log.warning("Doc file '%s' links to '%s', which does not exist in the repository",
                        src_uri, target)
            return match.group(0)
        if path in pages:
            return f"{bang}[{text}]({up}{pages[path]}{anchor or ''})"
        if path == _HOME:
            return f"{bang}[{text}]({up}index.md)"
        if (repo / path).is_dir() or path.endswith(".md"):
            if not text or bang or text.strip("`") in (path, Path(path).name):
                return f"`{path}`"
            return f"{text} (`{path}`)"
        return f"{bang}[{text}]({up}{_COPIED}/{path}{anchor or ''})"

    parts = re.split(r"(^```.*?^```)", markdown, flags=re.M | re.S)
    return "".join(part if part.startswith("```") else _LINK.sub(rewrite, part)
                   for part in parts)
