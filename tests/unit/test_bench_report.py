"""The docs' benchmark tables are the ones their results files generate, and no page
types a table of measured figures by hand.

Through subprocesses: tests do not import ``bench`` (tests/unit/test_support_layers.py).
"""

import itertools
import re
import subprocess
import sys

from testkit.support import REPO

BLOCK = re.compile(r"<!-- bench:([a-z0-9-]+) -->\n(.*?)<!-- /bench -->", re.S)


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.report", "--no-pictures", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def pages() -> list:
    return [p for p in [REPO / "README.md", REPO / "DEVELOPMENT.md",
                        *sorted((REPO / "docs").rglob("*.md"))] if p.exists()]


def test_every_table_in_the_docs_is_what_its_results_file_generates():
    done = report("--check")
    assert done.returncode == 0, done.stderr
    blocks = [name for page in pages() for name in BLOCK.findall(page.read_text())]
    assert len(blocks) >= 20, blocks


def test_a_table_edited_by_hand_is_caught(tmp_path):
    page = tmp_path / "benchmarks.md"
    text = (REPO / "docs" / "benchmarks.md").read_text()
    block = next(b for b in BLOCK.finditer(text) if re.search(r"\d+ ms", b.group(2)))
    body = block.group(2)
    figure = re.search(r"\d+ ms", body)
    assert figure is not None, body
    edited = body.replace(figure.group(0), "99999 ms", 1)
    page.write_text(text.replace(body, edited, 1))
    done = report("--check", str(page))
    assert done.returncode == 1
    assert f"{page}: {block.group(1)}" in done.stderr


def test_an_unknown_block_is_named(tmp_path):
    page = tmp_path / "x.md"
    page.write_text("<!-- bench:nonesuch -->\n<!-- /bench -->\n")
    done = report("--check", str(page))
    assert done.returncode != 0
    assert "unknown bench block 'nonesuch'" in done.stderr


def test_no_page_types_a_table_of_percentiles_outside_a_generated_block():
    typed = []
    for page in pages():
        lines = BLOCK.sub("", page.read_text()).splitlines()
        # A table whose header names a percentile is a table of measured figures.
        typed += [f"{page.relative_to(REPO)}: {head[:80]}"
                  for head, rule in itertools.pairwise(lines)
                  if head.startswith("|") and rule.startswith("|-")
                  and re.search(r"\bp(50|99)\b", head)]
    assert not typed, "figures belong in a <!-- bench:NAME --> block:\n" + "\n".join(typed)


def test_every_table_names_its_file_and_commit_or_says_it_is_stale():
    for page in pages():
        for name, body in BLOCK.findall(page.read_text()):
            if name == "files":  # the overview: one row per file
                continue
            assert (("`bench/results/" in body and (" commit `" in body or "**stale**" in body))
                    or body.startswith("*Not measured yet")), (page, name)
