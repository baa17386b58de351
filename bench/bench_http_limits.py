"""HTTP bounds of a real sidecar process: parked long-polls, connection flood, slowloris.

    python -m bench.bench_http_limits [--waiters 8000] [--slowloris 300] [--out FILE]

1. Idle RSS of a leader (embedded SQLite).
2. ``--waiters`` clients each send ``GET /leader?wait=300`` with the current ETag, so
   each one would park until the state changes. Reports how many parked, how many were
   answered at once (the wait cap), how many connections were refused (the connection
   cap), and the sidecar's peak RSS against the chart's memory limit (128 Mi). Then a
   ``POST /release`` changes the state: every parked waiter must be answered, with a
   non-leader answer (the release is what changed). RSS again after all have closed.
3. ``MAX_CONNECTIONS`` clients each send the largest request head the limits allow,
   minus its final blank line (the most a slow client can make us buffer). Peak RSS.
4. ``--slowloris`` clients send a request head one header line per second and never
   finish it. Reports how long the sidecar kept each connection open (connect → close),
   against the header timeout.

Loopback only; every phase is bounded in count and time. Prints figures and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import record
from sidecar.publish.http import limits
from testkit.support import SidecarProcess, get_json, wait_until

CHART_MEMORY_LIMIT_MIB = 128


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class PeakRss:
    """Samples a process's RSS every 50 ms in a thread; keeps the maximum."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(0.05)


async def _status_line(reader: asyncio.StreamReader, timeout: float) -> bytes:
    try:
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        return b""


async def waiters_phase(proc: SidecarProcess, count: int, settle: float) -> dict[str, Any]:
    status, _, headers = get_json(proc.url + "/leader")
    assert status == 200, "the bench sidecar should lead"
    tag = headers["ETag"]
    request = (f"GET /leader?wait=300 HTTP/1.1\r\nHost: 127.0.0.1:{proc.port}\r\n"
               f"If-None-Match: {tag}\r\n\r\n").encode()
    connects = asyncio.Semaphore(256)
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None] = []

    async def open_one() -> None:
        async with connects:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", proc.port), 30)
                writer.write(request)
                await writer.drain()
                conns.append((reader, writer))
            except (OSError, TimeoutError):
                conns.append(None)

    assert proc.proc is not None
    with PeakRss(proc.proc.pid) as peak:
        started = time.monotonic()
        await asyncio.gather(*(open_one() for _ in range(count)))
        opened_s = time.monotonic() - started
        await asyncio.sleep(settle)
        rss_open = rss_mib(proc.proc.pid)
        # What each connection has seen so far, without waiting: a parked waiter has
        # nothing to read yet.
        early = await asyncio.gather(*(
            _status_line(c[0], 0.5) if c else asyncio.sleep(0, b"") for c in conns))
        parked = [c for c, head in zip(conns, early, strict=True) if c and not head]
        answered_at_once = sum(1 for h in early if h.startswith(b"HTTP/1.1 200")
                               and b"Lease-Wait: full" in h)
        refused = sum(1 for h in early if h.startswith(b"HTTP/1.1 503")
                      and b"Retry-After" in h and b"Lease-Wait" not in h)
        failed = sum(1 for c in conns if c is None)
        # A state change must answer every parked waiter, and truthfully: the release
        # ends the claim, so no parked waiter may be told "leader".
        code = await asyncio.to_thread(_post, proc.url + "/release")
        late = await asyncio.gather(*(_status_line(c[0], 20) for c in parked))
        for conn in conns:
            if conn:
                conn[1].close()
        peak_open = peak.peak
    await asyncio.sleep(5)
    return {
        "connections_attempted": count,
        "connect_seconds": round(opened_s, 2),
        "connect_failures": failed,
        "parked": len(parked),
        "answered_at_once_wait_cap": answered_at_once,
        "refused_503_connection_cap": refused,
        "release_status": code,
        "parked_answered_after_release": sum(1 for h in late if h),
        "parked_told_leader_after_release": sum(1 for h in late if h.startswith(
            b"HTTP/1.1 200")),
        "rss_mib_all_open": round(rss_open, 1),
        "rss_mib_peak": round(peak_open, 1),
        "rss_mib_5s_after_close": round(rss_mib(proc.proc.pid), 1),
        "chart_limit_mib": CHART_MEMORY_LIMIT_MIB,
    }


def _post(url: str) -> int:
    """POST, honouring Retry-After while the connection cap turns us away (≤ 15 tries)."""
    import urllib.error
    import urllib.request

    for _ in range(15):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="POST"),
                                        timeout=5) as response:
                return response.status
        except urllib.error.HTTPError as err:
            if err.code != 503 or "Retry-After" not in err.headers:
                return err.code
            time.sleep(float(err.headers["Retry-After"]))
    return 503


async def fat_heads_phase(proc: SidecarProcess, count: int) -> dict[str, Any]:
    line = b"GET /leader?" + b"q" * (limits.MAX_LINE - 40) + b" HTTP/1.1\r\n"
    field = b"X-Fat-%d: " + b"v" * (limits.MAX_FIELD - 20) + b"\r\n"
    head = line + b"".join(field % i for i in range(limits.MAX_HEADERS - 1))
    conns: list[asyncio.StreamWriter] = []
    assert proc.proc is not None
    with PeakRss(proc.proc.pid) as peak:
        for _ in range(count):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", proc.port)
            except OSError:
                continue
            writer.write(head)
            conns.append(writer)
        await asyncio.gather(*(w.drain() for w in conns), return_exceptions=True)
        await asyncio.sleep(1.0)
        for writer in conns:
            writer.close()
        peak_mib = peak.peak
    await asyncio.sleep(limits.HEADER_TIMEOUT)
    return {"connections": len(conns), "head_bytes_each": len(head),
            "rss_mib_peak": round(peak_mib, 1),
            "rss_mib_after": round(rss_mib(proc.proc.pid), 1)}


async def slowloris_phase(proc: SidecarProcess, count: int, limit: float) -> dict[str, Any]:
    async def one() -> float | None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proc.port)
        except OSError:
            return None
        started = time.monotonic()
        writer.write(f"GET /leader HTTP/1.1\r\nHost: 127.0.0.1:{proc.port}\r\n".encode())
        try:
            i = 0
            while time.monotonic() - started < limit:
                try:
                    data = await asyncio.wait_for(reader.read(1024), 1.0)
                    if not data:
                        return time.monotonic() - started  # the server closed it
                except TimeoutError:
                    pass
                writer.write(f"X-Slow-{i}: a\r\n".encode())
                i += 1
                await writer.drain()
        except ConnectionError:
            return time.monotonic() - started
        finally:
            writer.close()
        return None  # still open when we gave up

    results = await asyncio.gather(*(one() for _ in range(count)))
    closed = sorted(r for r in results if r is not None)
    return {
        "connections": count,
        "closed_by_server": len(closed),
        "still_open_after_s": limit if len(closed) < count else None,
        "still_open": count - len(closed),
        "open_seconds_p50": round(statistics.median(closed), 2) if closed else None,
        "open_seconds_max": round(closed[-1], 2) if closed else None,
        "header_timeout_s": limits.HEADER_TIMEOUT,
    }


async def main_async(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    proc = SidecarProcess(workdir, "bench-http", args=[
        "--dsn", str(workdir / "leases.db"), "--lease-duration", "90s",
        "--renew-interval", "60s", "--renew-deadline", "80s"]).start()
    try:
        proc.wait_http()
        wait_until(lambda: proc.leader() == 200, 10)
        assert proc.proc is not None
        await asyncio.sleep(1)
        result: dict[str, Any] = {
            "limits": {"max_connections": limits.MAX_CONNECTIONS,
                       "max_waiters": limits.MAX_WAITERS,
                       "header_timeout_s": limits.HEADER_TIMEOUT, "max_line": limits.MAX_LINE,
                       "max_field": limits.MAX_FIELD, "max_headers": limits.MAX_HEADERS},
            "rss_mib_idle": round(rss_mib(proc.proc.pid), 1),
        }
        result["waiters"] = await waiters_phase(proc, args.waiters, settle=2.0)
        result["fat_heads"] = await fat_heads_phase(proc, limits.MAX_CONNECTIONS)
        result["slowloris"] = await slowloris_phase(proc, args.slowloris,
                                                    limit=args.slowloris_limit)
        result["alive_after"] = get_json(proc.url + "/healthz")[0] == 200
        return result
    finally:
        proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=8000)
    parser.add_argument("--slowloris", type=int, default=300)
    parser.add_argument("--slowloris-limit", type=float, default=60.0,
                        help="stop watching a slow connection after this many seconds")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/http-limits.json")
    args = parser.parse_args()
    run = record.start(1)  # one run; each phase says how many clients it used
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        result = asyncio.run(main_async(args, Path(tmp)))
    print(json.dumps(result, indent=2))
    record.write("http-limits.json", run, result, args.out)


if __name__ == "__main__":
    main()
