"""The example app of docs/sharding.md, run next to real sidecars sharing one SQLite file:
it works only on shards its sidecar leads, only while their claims last, with their
tokens, and follows the shards as members join and leave."""

from __future__ import annotations

import itertools
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

from testkit.support import REPO, SidecarProcess, wait_until

EXAMPLE = REPO / "docs" / "examples" / "shard_worker.py"
DOC = REPO / "docs" / "sharding.md"
SHARDS = 6
LINE = re.compile(r"^work shard=(\S+) token=(\d+) now_ms=(\d+) until_ms=(\d+)$")
FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--safety-margin", "300ms",
        "--claim-horizon", "100ms"]


def test_the_example_is_in_the_page_verbatim() -> None:
    blocks = re.findall(r"<!-- example: (\S+) -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert blocks == [("shard_worker.py", EXAMPLE.read_text())]


class Worker:
    """The example, run next to one sidecar; its lines, kept."""

    def __init__(self, sidecar: SidecarProcess) -> None:
        self.name = sidecar.identity
        self.units: list[tuple[str, int, int, int]] = []  # shard, token, now_ms, until_ms
        self.other: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-u", str(EXAMPLE)], text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={"LEASE_SIDECAR_URL": sidecar.url})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            found = LINE.match(line.strip())
            if found:
                shard, token, now, until = found.groups()
                self.units.append((shard, int(token), int(now), int(until)))
            else:
                self.other.append(line)

    def shards_since(self, ms: int) -> set[str]:
        return {shard for shard, _, now, _ in list(self.units) if now >= ms}

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_workers_follow_their_sidecars_shards(tmp_path: Path) -> None:
    sidecars = [SidecarProcess(tmp_path, f"pod-{i}", args=[
        "--dsn", str(tmp_path / "leases.db"), "--name", "orders", "--shards", str(SHARDS),
        *FAST]) for i in range(3)]
    workers: list[Worker] = []
    try:
        for sidecar in sidecars[:2]:
            sidecar.start().wait_http()
            workers.append(Worker(sidecar))
        every = {f"orders-{i}" for i in range(SHARDS)}

        def worked_since(ms: int, group: list[Worker]) -> bool:
            found = [w.shards_since(ms) for w in group]
            return set().union(*found) == every and sum(map(len, found)) == SHARDS

        start_ms = time.time_ns() // 1_000_000
        wait_until(lambda: worked_since(start_ms + 2000, workers), timeout=20, interval=0.2)
        sidecars[2].start().wait_http()
        workers.append(Worker(sidecars[2]))
        joined_ms = time.time_ns() // 1_000_000
        wait_until(lambda: worked_since(time.time_ns() // 1_000_000 - 500, workers)
                   and len(workers[2].shards_since(joined_ms)) == SHARDS // 3,
                   timeout=20, interval=0.2)
        sidecars[0].signal(signal.SIGTERM)
        assert sidecars[0].proc is not None and sidecars[0].proc.wait(15) == 0
        stopped_ms = time.time_ns() // 1_000_000
        wait_until(lambda: worked_since(time.time_ns() // 1_000_000 - 500, workers[1:]),
                   timeout=20, interval=0.2)
        time.sleep(0.5)
    finally:
        for worker in workers:
            worker.stop()
        for sidecar in sidecars:
            sidecar.stop()

    units = [(w.name, *unit) for w in workers for unit in w.units]
    assert all(now < until for _, _, _, now, until in units)  # never past a claim
    assert not [u for u in workers[0].units if u[2] > stopped_ms]  # its sidecar is gone
    by_shard: dict[str, list[tuple[int, int, str, int]]] = defaultdict(list)
    for name, shard, token, now, until in units:
        by_shard[shard].append((now, until, name, token))
    for shard, seen in by_shard.items():
        seen.sort()
        for (_, _, a, token_a), (_, _, b, token_b) in itertools.pairwise(seen):
            # The token only grows, and a change of worker comes with a larger one.
            assert token_b > token_a if a != b else token_b >= token_a, (shard, a, b)
        # No two workers' units of one shard within one claim of each other.
        for i, (now_a, until_a, a, _) in enumerate(seen):
            for now_b, _, b, _ in seen[i + 1:]:
                if now_b >= until_a:
                    break
                assert a == b, (shard, a, now_a, until_a, b, now_b)
    assert not [line for w in workers for line in w.other], [w.other for w in workers]
