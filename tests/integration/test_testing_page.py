"""docs/testing.md's fixtures, run as the page writes them: its Python blocks become a
test module that uses them (a real sidecar that leads, a second that stands by, a
release that moves the lease), run by pytest in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from testkit.support import REPO

PAGE = REPO / "docs" / "testing.md"
USES = '''

def test_leader_and_standby(leader, standby):
    status, body = ask(f"{leader}/leader")
    assert status == 200 and body["leader"] and body["fencing_token"] >= 1
    status, body = ask(f"{standby}/leader")
    assert status == 503 and not body["leader"]
    request = urllib.request.Request(f"{leader}/release", method="POST")
    urllib.request.urlopen(request, timeout=5).close()
    for _ in range(200):
        if ask(f"{standby}/leader")[0] == 200:
            break
        time.sleep(0.05)
    assert ask(f"{standby}/leader")[0] == 200
    assert ask(f"{leader}/leader")[0] == 503
'''


def test_the_pages_fixtures_run(tmp_path: Path) -> None:
    code = "\n\n".join(re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S))
    assert "def leader(" in code and "def standby(" in code
    module = tmp_path / "test_page.py"
    module.write_text(code + USES)
    bin_dir = Path(sys.executable).parent  # lease-sidecar, installed beside this Python
    env = dict(os.environ, PATH=os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(module)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
