"""The docs' benchmark tables are the ones their results files generate, and no page
types a table of measured figures by hand.

Through subprocesses: tests do not import ``bench`` (tests/unit/test_support_layers.py).
"""

import itertools
import json
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


def test_a_table_reads_the_same_whichever_checkout_renders_it(tmp_path):
    # A chaos results file records its --out path as the run's checkout spelled it; CI
    # renders the docs from a clone somewhere else.
    results = tmp_path / "results"
    results.mkdir()
    measured = json.loads((REPO / "bench" / "results" / "chaos-sqlite.json").read_text())
    measured["command"] = re.sub(r"--out \S+", "--out /elsewhere/clone/bench/results/x",
                                 measured["command"])
    (results / "chaos-sqlite.json").write_text(json.dumps(measured))
    block = next(b for b in BLOCK.finditer((REPO / "docs" / "benchmarks.md").read_text())
                 if b.group(1) == "chaos-sqlite")
    page = tmp_path / "page.md"
    page.write_text(block.group(0).replace("bench/results/chaos-sqlite`.",
                                           "bench/results/x`.", 1) + "\n")
    done = report("--check", "--results", str(results), str(page))
    assert done.returncode == 0, done.stderr
    assert "`python -m bench.chaos " in page.read_text()


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


def test_every_table_names_its_file_and_commit():
    for page in pages():
        for name, body in BLOCK.findall(page.read_text()):
            if name == "files":  # the overview: one row per file
                continue
            assert (("`bench/results/" in body and " commit `" in body)
                    or body.startswith("*Not measured yet")), (page, name)


def test_a_results_file_the_docs_cannot_stand_behind_is_refused(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    measured = json.loads((REPO / "bench" / "results" / "handover.json").read_text())
    (results / "handover.json").write_text(json.dumps(measured))
    (results / "core.json").write_text(json.dumps({"sigterm": {}}))  # written before commits
    (results / "exec.json").write_text(json.dumps({**measured, "commit": "abc+dirty"}))
    (results / "core-before.json").write_text(json.dumps(measured))  # no table shows it
    done = report("--check", "--results", str(results), str(tmp_path / "none.md"))
    assert done.returncode == 1
    assert "core.json: names no commit; re-run it: python -m bench run core" in done.stderr
    assert "exec.json: measured uncommitted code (abc+dirty)" in done.stderr
    assert "core-before.json: no table shows it" in done.stderr
    assert "handover.json" not in done.stderr


def test_the_pictures_are_drawn_from_the_results_files(tmp_path):
    # A results directory with a hand-over timeline (as bench_handover writes it) and the
    # rollout and chaos files of the repository; the pictures go to a scratch directory.
    results = tmp_path / "results"
    results.mkdir()
    for name in ("rollout.json", "chaos-sqlite.json"):
        (results / name).write_text((REPO / "bench" / "results" / name).read_text())
    trial = {"old_last_claim_until": 0.1, "old_stepped_down": 0.11, "new_acquired": 0.12,
             "new_first_claim": 0.22}
    metadata = {k: v for k, v in json.loads((results / "rollout.json").read_text()).items()
                if k in ("commit", "date", "cores", "loadavg_at_start", "loadavg_at_end",
                         "trials")}
    (results / "handover.json").write_text(json.dumps(
        {**metadata, "sqlite": {"timeline": [trial, {**trial, "new_first_claim": 3.0}]}}))
    page = tmp_path / "page.md"
    page.write_text("no blocks here\n")
    done = subprocess.run([sys.executable, "-m", "bench.report", "--results", str(results),
                           "--images", str(tmp_path / "images"), str(page)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    drawn = sorted(p.name for p in (tmp_path / "images").iterdir())
    assert drawn == ["bench-chaos-takeover.png", "bench-handover-timeline.png",
                     "bench-rollout.png"]
    for name in drawn:
        assert (tmp_path / "images" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The docs show the pictures the repository's own results files draw.
    for name in drawn:
        assert f"images/{name}" in (REPO / "docs" / "benchmarks.md").read_text()


def goal_row(page_text: str, goal: str) -> str:
    return next(line for line in page_text.splitlines() if line.startswith(f"| {goal}"))


def test_a_goals_mark_is_computed_from_the_results_file(tmp_path):
    # The same goal judged on the repository's start-up figures and on the same file with
    # every backend's start-up made fast: the mark follows the figure, not the text.
    goal = "process start → first `/healthz` 200 ≤ 300 ms p50, every backend"
    results = tmp_path / "results"
    results.mkdir()
    lean = json.loads((REPO / "bench" / "results" / "lean.json").read_text())
    for backend in lean["lone"].values():
        backend["start_to_healthz_ms"]["p50"] = 400
    (results / "lean.json").write_text(json.dumps(lean))
    page = tmp_path / "page.md"
    page.write_text("<!-- bench:goals -->\n<!-- /bench -->\n")
    done = report("--results", str(results), str(page))
    assert done.returncode == 0, done.stderr
    slow = goal_row(page.read_text(), goal)
    assert "400 ms p50" in slow and slow.endswith("| ✗ |"), slow
    for backend in lean["lone"].values():
        backend["start_to_healthz_ms"]["p50"] = 120
    (results / "lean.json").write_text(json.dumps(lean))
    done = report("--results", str(results), str(page))
    assert done.returncode == 0, done.stderr
    fast = goal_row(page.read_text(), goal)
    assert "120 ms p50" in fast and fast.endswith("| ✓ |"), fast
    # A goal whose results file is missing says so instead of a mark.
    assert goal_row(page.read_text(), "idle leader").endswith("| not measured | — |")


def test_the_hand_over_answer_has_a_row_per_backend():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    block = next(b for b in BLOCK.finditer(text) if b.group(1) == "handover-answer")
    for backend in ("sqlite", "postgres", "postgres-row", "kubernetes"):
        assert f"| `{backend}` |" in block.group(2)
