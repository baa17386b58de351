"""What ``lease-sidecar run`` may import before it serves ``/healthz``, on every backend.

Start-up time is mostly imports (aiohttp alone is most of it), so the modules that only a
later moment needs stay out of the way: ``prometheus_client`` and :mod:`sidecar.metrics`
load at the first scrape of ``/metrics``, the other commands' modules (``exec``'s process
supervision, ``status``, ``handover``) only with their command, the SQL dialects only on
the row backends, the database drivers only on their backends. Nothing looks up package
versions (``importlib.metadata``, ``pkg_resources``) either. The start-up figure itself
is ``bench/bench_lean.py``'s; this pins what it rests on, so it cannot slip back quietly.

Each backend runs for real through the command line in a fresh process, label and Events
on, pointed at addresses where nothing listens (tests/unit/nowhere.py): the modules
are read the moment ``Sidecar.start`` returns (listening, electors started), then the
probe asks ``/healthz`` over the socket to prove the sidecar was serving.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.nowhere import DSNS, pod_env

PROBE = """
import asyncio, json, os, signal, sys
from sidecar import runtime
from sidecar.cli import main

started = runtime.Sidecar.start

async def start(self):
    await started(self)
    loaded = sorted(sys.modules)  # before anything below imports more
    reader, writer = await asyncio.open_connection("127.0.0.1", self.http.bound_port)
    writer.write(b"GET /healthz HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nConnection: close\\r\\n\\r\\n")
    answer = (await reader.read()).decode()
    writer.close()
    print(json.dumps({"healthz": answer.split("\\r\\n", 1)[0], "modules": loaded}), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the usual stop

runtime.Sidecar.start = start
sys.exit(main(sys.argv[1:]))
"""

# Never before serving, on any backend.
NEVER = {
    "prometheus_client", "sidecar.metrics",  # the first scrape builds the registry
    "sidecar.cli.exec_command", "sidecar.cli.exec_supervise", "sidecar.cli.exec_guard",
    "sidecar.cli.status", "sidecar.cli.handover",  # other commands
    "importlib.metadata", "pkg_resources",  # version lookups: sidecar.__version__ is a str
    "kopf", "kubernetes", "yaml",  # the operator's; a JSON kubeconfig needs no YAML parser
    "sidecar.injector", "sidecar.operator",
    # The apiserver client's: the HTTP endpoint is h11's, and the pod label, Events and
    # the kubernetes backend import aiohttp with their first request, after this moment.
    "aiohttp",
}
# Only on the backends that use them.
ONLY_ON = {
    "asyncpg": {"postgres", "postgres-row"},
    "pyodbc": {"sqlserver"},
    "sidecar.lease.sql": {"postgres-row", "sqlserver"},
    "sqlite3": {"sqlite"},
}


@pytest.mark.parametrize("backend", list(DSNS))
def test_run_serves_healthz_before_importing_what_only_later_needs(
        backend: str, tmp_path: Path) -> None:
    if backend == "sqlserver":
        pytest.importorskip("pyodbc", reason="the sqlserver extra is not installed")
    args = ["run", "--backend", backend, "--name", "jobs", "--state-dir", str(tmp_path / "s"),
            "--http-addr", "127.0.0.1:0", "--pod-label", "on", "--log-level", "error"]
    if backend != "kubernetes":
        args += ["--dsn", DSNS[backend] or str(tmp_path / "l.db")]
    done = subprocess.run([sys.executable, "-c", PROBE, *args], env=pod_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["healthz"] == "HTTP/1.1 200 OK", report["healthz"]  # it was serving
    loaded = set(report["modules"])
    assert "sidecar.publish.http.server" in loaded  # the probe saw a real start

    def present(name: str) -> bool:
        return any(m == name or m.startswith(name + ".") for m in loaded)

    assert not {name for name in NEVER if present(name)}
    unexpected = {name for name, backends in ONLY_ON.items()
                  if present(name) and backend not in backends}
    assert not unexpected, unexpected


def test_the_modules_named_here_exist() -> None:
    """A module renamed away would make the checks above pass for nothing."""
    ours = [name for name in (*NEVER, *ONLY_ON) if name.startswith("sidecar.")]
    assert ours and all(importlib.util.find_spec(name) for name in ours), [
        name for name in ours if not importlib.util.find_spec(name)]
