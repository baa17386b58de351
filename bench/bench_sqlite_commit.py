"""What the rollback journal costs the sqlite backend against WAL, per commit.

    python -m bench.bench_sqlite_commit [--dir /var/tmp] [--commits 300]

Runs ``BEGIN IMMEDIATE; UPDATE; COMMIT`` (the shape of a renew) in each journal mode
(default ``synchronous``, as the backend uses it), alternating the modes twice.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
import time
from pathlib import Path

from bench import record
from bench.failover import summary


def commits(directory: Path, mode: str, count: int) -> list[float]:
    conn = sqlite3.connect(directory / f"{mode}-{time.time_ns()}.db", isolation_level=None)
    conn.execute(f"PRAGMA journal_mode={mode}")
    conn.execute("CREATE TABLE t (name TEXT PRIMARY KEY, v INTEGER)")
    conn.execute("INSERT INTO t VALUES ('a', 0)")
    times = []
    for _ in range(count):
        started = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("UPDATE t SET v = v + 1")
        conn.execute("COMMIT")
        times.append(time.perf_counter() - started)
    conn.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--commits", type=int, default=300)
    args = parser.parse_args()
    run = record.start(args.commits * 2)
    results: dict[str, list[float]] = {"WAL": [], "DELETE": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for _ in range(2):
            for mode in results:
                results[mode] += commits(Path(tmp), mode, args.commits)
    figures = {"directory": args.dir,
               "commit_time": {mode: summary(times) for mode, times in results.items()}}
    print(json.dumps(figures))
    record.write("sqlite-commit.json", run, figures)


if __name__ == "__main__":
    main()
