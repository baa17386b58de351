"""LEASE_CONTROL_TOKEN_FILE with real sidecar processes: the opt-in token that ``POST
/release``, ``/handover`` and ``/heartbeat`` must carry, for where loopback is not only
this pod (``kubectl port-forward``, a mesh's inbound proxy, ``hostNetwork``). Loopback
itself is all these tests can use; the token is what they check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from testkit.support import REPO, SidecarProcess, post_json, serving, wait_until


def test_control_posts_need_the_token_and_the_cli_sends_it(tmp_path: Path) -> None:
    token_file = tmp_path / "control-token"
    proc = SidecarProcess(tmp_path, "a", args=[
        "--dsn", str(tmp_path / "l.db"), "--control-token-file", str(token_file)])
    with serving([proc]):
        wait_until(lambda: proc.leader() == 200, timeout=10)
        token = token_file.read_text().strip()  # made at start, random
        assert len(token) >= 32
        for path in ("/release", "/handover", "/heartbeat"):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                status, body, _ = post_json(proc.url + path, headers=headers)
                assert (status, body) == (403, {"error": f"{path[1:]} needs Authorization: "
                                                         "Bearer with the token in "
                                                         "LEASE_CONTROL_TOKEN_FILE"})
        assert proc.leader() == 200
        good = {"Authorization": f"Bearer {token}"}
        assert post_json(proc.url + "/heartbeat", headers=good)[0] == 200
        # The CLI reads the same setting and sends the token.
        done = subprocess.run(
            [sys.executable, "-m", "sidecar", "handover", "--http-addr",
             f"127.0.0.1:{proc.port}", "--control-token-file", str(token_file)],
            cwd=REPO, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("handing over lease default")
        wait_until(lambda: proc.leader() == 503, timeout=5)


def test_an_existing_token_file_is_used_and_an_empty_one_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "given"
    token_file.write_text("from-a-secret\n")
    proc = SidecarProcess(tmp_path, "a", args=[
        "--dsn", str(tmp_path / "l.db"), "--control-token-file", str(token_file)])
    with serving([proc]):
        wait_until(lambda: proc.leader() == 200, timeout=10)
        assert post_json(proc.url + "/release",
                         headers={"Authorization": "Bearer from-a-secret"})[0] == 202
    assert token_file.read_text() == "from-a-secret\n"  # never rewritten
    token_file.write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--dsn", str(tmp_path / "l.db"),
         "--state-dir", str(tmp_path / "s"), "--http-addr", "127.0.0.1:0",
         "--control-token-file", str(token_file)],
        cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(
        f"LEASE_CONTROL_TOKEN_FILE / --control-token-file: {token_file}: the file is empty")
