"""Addresses where nothing listens, for tests that run a real sidecar process on every
backend and need it to start, contend and fail to reach its backend and apiserver
(test_lean_sidecar.py, test_start_imports.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from testkit.procs import free_port

CLOSED = free_port()  # nothing listens here
# Each backend's DSN pointing at CLOSED; None: the backend needs none (sqlite: a file).
DSNS = {
    "sqlite": None,
    "postgres": f"postgresql://lease@127.0.0.1:{CLOSED}/lease",
    "postgres-row": f"postgresql://lease@127.0.0.1:{CLOSED}/lease",
    "sqlserver": (f"Driver={{ODBC Driver 18 for SQL Server}};Server=127.0.0.1,{CLOSED};"
                  "Database=lease;UID=u;PWD=p;Encrypt=no"),
    "kubernetes": None,
}


def pod_env(workdir: Path) -> dict[str, str]:
    """The environment of a sidecar that believes it runs in pod ``apps/web-0``, with a
    kubeconfig (JSON, written into ``workdir``) naming an apiserver at CLOSED."""
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": f"https://127.0.0.1:{CLOSED}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}))
    return {**os.environ, "POD_NAME": "web-0", "POD_NAMESPACE": "apps",
            "KUBECONFIG": str(kubeconfig)}
