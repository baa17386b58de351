"""The chart's example app honours valid_until_ms, not just the file's existence.

The app's script is taken from ``helm template`` output and run with busybox ``sh`` (the
example's image is busybox; Debian's busybox here) next to a real sidecar process on
SQLite. SIGKILL leaves the sidecar's leader file on disk: the app must call itself
standby once that file's claim has expired.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from testkit.chart_support import VALUE_SETS, documents, find, template
from testkit.support import SidecarProcess, wait_until

pytestmark = pytest.mark.tools  # helm renders the chart


def example_script() -> str:
    docs = documents(template("ex", "example", VALUE_SETS["kubernetes-example"]).stdout)
    pod = find(docs, "Deployment", "-example")["spec"]["template"]["spec"]
    app, = pod["containers"]
    assert app["command"] == ["/bin/sh", "-c"]
    script = app["args"][0]
    # The only change: a faster loop than the example's 5 s, so the test is short.
    assert script.count("sleep 5") == 1
    return script.replace("sleep 5", "sleep 0.1")


@pytest.mark.slow
def test_example_app_stops_claiming_when_the_file_goes_stale(tmp_path: Path):
    busybox = shutil.which("busybox")
    assert busybox, "busybox not installed: scripts/test installs it"
    script = example_script()
    sidecar = SidecarProcess(tmp_path, "example", args=[
        "--dsn", str(tmp_path / "leases.sqlite3"), "--lease-duration", "3s",
        "--renew-interval", "300ms", "--renew-deadline", "2s"]).start()
    app = None
    lines: list[tuple[float, str]] = []
    try:
        sidecar.wait_http()
        leader_file = sidecar.state_dir / "leader"
        app = subprocess.Popen([busybox, "sh", "-c", script], stdout=subprocess.PIPE,
                               text=True, env={"LEASE_LEADER_FILE": str(leader_file),
                                               "PATH": "/usr/bin:/bin"})

        def read() -> None:
            assert app is not None and app.stdout is not None
            for line in app.stdout:
                lines.append((time.monotonic(), line.rstrip("\n")))

        threading.Thread(target=read, daemon=True).start()
        wait_until(lambda: any(line.startswith("leader: {") for _, line in lines), 15)
        assert '"fencing_token": 1' in next(line for _, line in lines
                                            if line.startswith("leader: "))

        sidecar.signal(signal.SIGKILL)
        assert sidecar.proc is not None
        sidecar.proc.wait(5)
        killed = time.monotonic()
        time.sleep(1.0)
        # Nobody removed the file: existence alone would still say "leader".
        assert leader_file.exists()
        after = [line for at, line in lines if at > killed + 0.5]
        assert after and all(line == "standby" for line in after), after[:5]
    finally:
        if app is not None:
            app.kill()
            app.wait()
        sidecar.stop()
