"""No ``kopf`` and no ``kubernetes`` module in a running sidecar, on any backend, with the
pod label and the pod Events on: they talk to the apiserver through sidecar.kubeapi
(aiohttp). kopf and the ``kubernetes`` client belong to ``lease-sidecar operator``.

Each backend runs for real in a fresh process, pointed at addresses where nothing
listens (a closed loopback port; an apiserver that is not there): the sidecar starts,
contends, fails to reach its backend and apiserver, and keeps running, which is when
everything it would ever load is loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.nowhere import DSNS, pod_env

PROBE = """
import asyncio, json, sys
from sidecar import config
from sidecar.runtime import Sidecar

async def main():
    settings = config.load(json.loads(sys.argv[1]))
    sidecar = Sidecar(settings)
    await sidecar.start()
    await asyncio.sleep(1.5)
    await sidecar.stop()
    print(json.dumps({"labels": any(type(p).__name__ == "PodLabelPublisher"
                                    for p in sidecar.publishers),
                      "modules": sorted(sys.modules)}))

asyncio.run(main())
"""


@pytest.mark.parametrize("backend", list(DSNS))
def test_a_running_sidecar_loads_neither_kopf_nor_the_kubernetes_client(
        backend: str, tmp_path: Path) -> None:
    flags = {"backend": backend, "state_dir": str(tmp_path), "http_addr": "127.0.0.1:0",
             "pod_label": "on", "dsn": DSNS[backend] or str(tmp_path / "l.db")}
    if backend == "kubernetes":
        flags.pop("dsn")
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(flags)],
                          env=pod_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["labels"] is True  # the label publisher really ran
    loaded = {name.split(".")[0] for name in report["modules"]}
    assert not loaded & {"kopf", "kubernetes"}, loaded & {"kopf", "kubernetes"}
