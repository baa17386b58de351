"""Each picture of docs/diagrams/*.dot is drawn from its source as it is now (the SVG
carries its source's hash), and a page shows it."""

import shutil
import subprocess
import sys

import pytest

from scripts import diagrams
from testkit.support import REPO


def sources():
    return sorted(diagrams.SOURCES.glob("*.dot"))


def test_every_picture_is_drawn_from_its_source_as_it_is_now():
    assert sources(), "no diagram sources"
    for source in sources():
        picture = diagrams.picture(source)
        assert picture.exists(), f"{picture} missing: python -m scripts.diagrams"
        assert diagrams.mark(source) in picture.read_text(), (
            f"{picture.name} is older than {source.name}: python -m scripts.diagrams")


def test_a_changed_source_is_caught(tmp_path):
    source = tmp_path / "architecture.dot"
    source.write_text(sources()[0].read_text() + "// changed\n")
    assert diagrams.mark(source) not in diagrams.picture(sources()[0]).read_text()


def test_every_picture_is_shown_on_a_page():
    pages = "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    for source in sources():
        assert f"images/{source.stem}.svg" in pages


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_drawing_writes_the_mark(tmp_path, monkeypatch):
    monkeypatch.setattr(diagrams, "IMAGES", tmp_path)
    out = diagrams.draw(sources()[0])
    text = out.read_text()
    assert text.startswith("<?xml") and diagrams.mark(sources()[0]) in text
    assert "<svg" in text
    done = subprocess.run([sys.executable, "-c", "import xml.dom.minidom, sys; "
                           f"xml.dom.minidom.parse({str(out)!r})"], capture_output=True)
    assert done.returncode == 0, done.stderr
