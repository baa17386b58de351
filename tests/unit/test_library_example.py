"""The library example of docs/cli.md, run as it is against a real SQLite file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_documented_library_example_leads_and_releases(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "cli.md").read_text()
    found = re.search(r"<!-- library-example -->\n```python\n(.*?)```", doc, re.S)
    assert found, "docs/cli.md lost its library example"
    script = tmp_path / "example.py"
    script.write_text(found.group(1))
    env = {**os.environ, "LEASE_DSN": str(tmp_path / "leases.db"),
           "LEASE_STATE_DIR": str(tmp_path / "state"), "LEASE_HTTP_ADDR": "127.0.0.1:0",
           "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^leading with fencing token \d+$", done.stdout, re.M), done.stdout
    # stop() unpublished: the leader file exists only while this contender leads.
    assert (tmp_path / "state").is_dir()
    assert not (tmp_path / "state" / "leader").exists()
