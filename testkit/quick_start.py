"""The Kubernetes quick start of docs/getting-started.md, read from the page: its shell
blocks, each marked ``<!-- quick-start: NAME -->`` (``image``, ``cluster-admin``,
``namespace``), as the commands a shell would run. The page is the one source: the
end-to-end test runs these commands (tests/e2e/test_quick_start.py) and the README shows
the same blocks (tests/unit/test_quick_start_page.py)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from testkit.support import REPO

PAGE = REPO / "docs" / "getting-started.md"
BLOCK = re.compile(r"<!-- quick-start: ([a-z-]+) -->\n```sh\n(.*?)```", re.S)
NAMESPACE = "my-ns"  # the page's namespace; the test gives each run a fresh one


def blocks(text: str | None = None) -> dict[str, str]:
    """Each marked block's text, by name."""
    return {name: body for name, body in BLOCK.findall(PAGE.read_text() if text is None
                                                       else text)}


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


@dataclass(frozen=True)
class Build:
    target: str  # the Dockerfile target
    name: str  # the image name it is tagged with, as the chart is told


def image_step(block: str) -> tuple[list[Build], list[str]]:
    """The image block: what ``docker build`` makes (target and name) and the names the
    ``kind load`` line loads into the cluster."""
    builds, loaded = [], []
    for command in commands(block):
        words = shlex.split(command)
        if words[:2] == ["docker", "build"]:
            builds.append(Build(words[words.index("--target") + 1],
                                words[words.index("-t") + 1]))
        elif words[:3] == ["kind", "load", "docker-image"]:
            loaded += words[3:]
    return builds, loaded
