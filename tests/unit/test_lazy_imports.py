"""Running on SQLite must not import the other backends' libraries."""

import json
import subprocess
import sys

HEAVY = ("asyncpg", "pyodbc", "kopf", "kubernetes", "cryptography")

PROBE = """
import asyncio, json, sys, tempfile
from sidecar import config
from sidecar.runtime import Sidecar

async def main():
    tmp = tempfile.mkdtemp()
    settings = config.load({"dsn": tmp + "/l.db", "state_dir": tmp, "http_addr": "127.0.0.1:0",
                            "lease_duration": "2s", "renew_interval": "100ms",
                            "renew_deadline": "1s", "safety_margin": "200ms",
                            "claim_horizon": "50ms"}, env={})
    sidecar = Sidecar(settings)
    await sidecar.start()
    for _ in range(100):
        if sidecar.states[0].claim().leader:
            break
        await asyncio.sleep(0.05)
    leader = sidecar.states[0].claim().leader
    await sidecar.stop()
    print(json.dumps({"leader": leader, "modules": sorted(sys.modules)}))

asyncio.run(main())
"""


def test_sqlite_run_imports_no_heavy_backend_library():
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            timeout=60, check=True)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["leader"] is True  # the probe really ran an election
    loaded = {name.split(".")[0] for name in report["modules"]}
    assert not loaded & set(HEAVY), loaded & set(HEAVY)
