"""MkDocs hook: links from docs/ to repository files outside it.

The pages are read in two places: on the forge, where a relative link such as
``../bench/results/pods.json`` opens the file, and on the MkDocs site, which only holds
``docs/``. So a link that leaves ``docs/`` is kept as written in the Markdown and, for
the site only, rewritten here: a Markdown file (the CHANGELOG, the chart's README, a
results note) becomes its path in code, any other file (a results JSON, a picture) is
copied into the site under ``_repo/`` and linked there. A link whose target does not
exist is a warning, which ``mkdocs build --strict`` turns into a failed build, as it
does for links between pages.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.lease_sidecar")

# [text](target) and ![alt](target), the target relative and leaving docs/.
_LINK = re.compile(r"(!?)\[([^\]]*)\]\((\.\./[^)#\s]+)(#[^)\s]*)?\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_COPIED = "_repo"


def _outside(page_src: Path, target: str, docs: Path, repo: Path) -> Path | None:
    path = (page_src.parent / target).resolve()
    if path.is_relative_to(docs) or not path.is_relative_to(repo):
        return None
    return path


def _pages(docs: Path) -> list[Path]:
    return sorted(docs.rglob("*.md"))


def on_files(files: Files, config: Any) -> Files:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    wanted: set[Path] = set()
    for page in _pages(docs):
        text = _FENCE.sub("", page.read_text())
        for match in _LINK.finditer(text):
            path = _outside(page, match.group(3), docs, repo)
            if path and path.is_file() and path.suffix != ".md":
                wanted.add(path)
    for path in sorted(wanted):
        uri = f"{_COPIED}/{path.relative_to(repo).as_posix()}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    source = Path(page.file.abs_src_path)
    depth = len(Path(page.file.src_uri).parts) - 1

    def rewrite(match: re.Match[str]) -> str:
        bang, text, target, anchor = match.groups()
        path = _outside(source, target, docs, repo)
        if path is None:
            return match.group(0)
        if not path.exists():
            log.warning("Doc file '%s' links to '%s', which does not exist in the repository",
                        page.file.src_uri, target)
            return match.group(0)
        relative = path.relative_to(repo).as_posix()
        if path.is_dir() or path.suffix == ".md":
            if not text or bang or text.strip("`") in (relative, path.name):
                return f"`{relative}`"
            return f"{text} (`{relative}`)"
        return f"{bang}[{text}]({'../' * depth}{_COPIED}/{relative}{anchor or ''})"

    parts = re.split(r"(^```.*?^```)", markdown, flags=re.M | re.S)
    return "".join(part if part.startswith("```") else _LINK.sub(rewrite, part)
                   for part in parts)
