"""postgres-row: renew throughput over 1,000 names, round trips per renew, SIGTERM handover.

    flock /tmp/lease-bench.lock python bench/bench_postgres_row.py [--dsn URL] [--seconds 10]
        [--trials 20] [--claim-horizon 250ms --claim-horizon 100ms]

Without ``--dsn`` it starts a throw-away PostgreSQL from the test bed. Figures are printed
and written to bench/results/postgres_row.json.

- throughput: 1,000 leases held by one backend (its default pool of 4 connections),
  renewed by 64 concurrent callers for ``--seconds``; renews/s and per-renew latency.
- round trips: 200 sequential renews through a counting TCP proxy on 127.0.0.1; a round
  trip is one client→server write answered by the server. Driver calls are counted too.
- handover: two ``lease-sidecar run`` processes; SIGTERM the leader and time until the
  other answers ``GET /leader`` with 200. The old leader first waits out its outstanding
  claims (up to one claim horizon), so the horizon is part of the figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import record  # noqa: E402
from bench.failover import failover_trials, pct, summary  # noqa: E402
from sidecar.base.clock import SystemClock, parse_duration  # noqa: E402
from sidecar.config import load  # noqa: E402
from sidecar.lease import postgres_row  # noqa: E402
from sidecar.lease.sql.asyncpg_driver import AsyncpgDriver  # noqa: E402
from sidecar.lease.sql.dialect import PostgresDialect  # noqa: E402
from sidecar.lease.sql.store import SqlRowStore  # noqa: E402


def settings(dsn: str, identity: str = "bench"):
    return load({"backend": "postgres-row", "dsn": dsn, "identity": identity,
                 "lease_duration": "30s"}, env={})


async def throughput(dsn: str, seconds: float, names: int = 1000, callers: int = 64) -> dict:
    s = settings(dsn)
    await postgres_row.ENTRY.apply_schema(s)
    backend = postgres_row.ENTRY.create(s, SystemClock())
    leases = [backend.lease(f"bench-{i}") for i in range(names)]
    try:
        for lease in leases:
            assert (await lease.try_acquire()).held
        latencies: list[float] = []
        loop = asyncio.get_running_loop()
        stop = loop.time() + seconds

        async def caller(offset: int) -> None:
            # Each caller renews its own leases only: two renews of one lease at once
            # would race on its row version, and the loser's renew is (rightly) refused.
            mine = leases[offset::callers]
            i = 0
            while loop.time() < stop:
                sent = time.perf_counter()
                assert (await mine[i % len(mine)].try_renew()).held
                latencies.append(time.perf_counter() - sent)
                i += 1

        started = time.perf_counter()
        await asyncio.gather(*(caller(k) for k in range(callers)))
        elapsed = time.perf_counter() - started
    finally:
        await backend.close()
    return {"names": names, "callers": callers, "pool_size": 4, "seconds": round(elapsed, 2),
            "renews": len(latencies), "renews_per_s": round(len(latencies) / elapsed),
            "latency_ms_p50": round(pct(latencies, 50) * 1000, 2),
            "latency_ms_p99": round(pct(latencies, 99) * 1000, 2)}


class CountingProxy:
    """TCP proxy that counts reads in each direction (a read ≈ one flushed message batch)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.to_server = 0
        self.to_client = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target)

        async def pump(reader, writer, upstream: bool) -> None:
            try:
                while data := await reader.read(65536):
                    if upstream:
                        self.to_server += 1
                    else:
                        self.to_client += 1
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pump(client_r, server_w, True), pump(server_r, client_w, False))

    async def close(self) -> None:
        self.server.close()


async def round_trips(dsn: str, renews: int = 200) -> dict:
    host_port = dsn.split("@", 1)[1].split("/", 1)[0]
    port = int(host_port.rsplit(":", 1)[1])
    proxy = CountingProxy(port)
    proxied = dsn.replace(host_port, f"127.0.0.1:{await proxy.start()}")
    driver = AsyncpgDriver(proxied, timeout=5.0)
    calls = 0
    fetch = driver.fetch

    async def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return await fetch(*args, **kwargs)

    driver.fetch = counted  # type: ignore[method-assign]  # counting wrapper
    store = SqlRowStore(PostgresDialect(), driver)
    try:
        row = await store.acquire("rt", "bench", 30.0)
        assert row is not None
        row = await store.renew("rt", "bench", 30.0, row.version)  # warm: statement prepared
        assert row is not None
        before = (proxy.to_server, proxy.to_client, calls)
        for _ in range(renews):
            row = await store.renew("rt", "bench", 30.0, row.version)
            assert row is not None
        sent, received = proxy.to_server - before[0], proxy.to_client - before[1]
        return {"renews": renews, "driver_calls_per_renew": (calls - before[2]) / renews,
                "client_writes_per_renew": sent / renews,
                "server_replies_per_renew": received / renews}
    finally:
        await store.close()
        await proxy.close()


def handover(dsn: str, trials: int, horizon: str, workdir: Path) -> dict:
    args = ["--backend", "postgres-row", "--dsn", dsn, "--name", f"handover-{horizon}",
            "--lease-duration", "5s", "--renew-interval", "1s", "--renew-deadline", "3s",
            "--claim-horizon", horizon]
    here = workdir / f"h{horizon}"
    here.mkdir(exist_ok=True)
    # Two contenders; 1.5 s lets the standby try once and wait, LISTENing.
    times = failover_trials(signal.SIGTERM, trials, args, here, contenders=2, settle=1.5,
                            timeout=20)
    return {"claim_horizon_s": parse_duration(horizon), "trials": trials,
            **{k: v for k, v in summary(times["claim"]).items() if k != "n"}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--claim-horizon", action="append", dest="horizons")
    opts = parser.parse_args()
    horizons = opts.horizons or ["250ms", "100ms"]
    run = record.start(opts.trials)

    server = None
    dsn = opts.dsn
    if dsn is None:
        from testkit.testbed.postgres import PgServer

        server = PgServer().init()
        dsn = server.dsn
    try:
        results = {"throughput": asyncio.run(throughput(dsn, opts.seconds)),
                   "round_trips": asyncio.run(round_trips(dsn))}
        print(json.dumps(results, indent=2), flush=True)
        with tempfile.TemporaryDirectory(prefix="bench-pgrow-") as workdir:
            results["sigterm_handover"] = [handover(dsn, opts.trials, h, Path(workdir))
                                           for h in horizons]
    finally:
        if server is not None:
            server.destroy()
    results["targets"] = {"renews_per_s": ">= 2000", "round_trips_per_renew": 1,
                          "sigterm_handover_p99_ms": "<= 250"}
    print(json.dumps(results, indent=2))
    record.write("postgres_row.json", run, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
