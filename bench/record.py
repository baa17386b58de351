"""What every results file records besides its figures, and where it is written.

Each benchmark calls ``start(trials)`` before it measures and ``write(name, run, figures)``
after: the file then opens with the commit it measured, the date, the machine's cores,
the load average at start and end and the trial count, so the docs generated from it
(``python -m bench.report``) can say what they describe. ``python -m bench run --quick``
sets ``LEASE_BENCH_RESULTS`` to a scratch directory, so a quick run never replaces the
figures the docs are built from.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
# Metadata keys, in the order they open every results file (bench.report reads them).
KEYS = ("commit", "date", "cores", "loadavg_at_start", "loadavg_at_end", "trials")
# Paths whose uncommitted changes would change the figures: a "+dirty" commit means the
# run measured code that no commit holds.
MEASURED = ("sidecar", "charts", "Dockerfile", "pyproject.toml", "bench", "testkit",
            ":(exclude)bench/results")


def results_dir() -> Path:
    return Path(os.environ.get("LEASE_BENCH_RESULTS") or RESULTS)


def commit() -> str:
    """``git rev-parse HEAD``, with ``+dirty`` when the measured code has local changes."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", *MEASURED],
                           capture_output=True, text=True, check=False).stdout.strip()
    return head + ("+dirty" if dirty else "")


def _load() -> list[float]:
    return [round(x, 1) for x in os.getloadavg()]


def start(trials: int) -> dict[str, Any]:
    """The run's metadata, taken before the first trial; ``trials`` is the repeat count
    of each measured row (a row that repeats a different number of times says so)."""
    return {"commit": commit(),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "cores": os.cpu_count(), "loadavg_at_start": _load(), "loadavg_at_end": None,
            "trials": trials}


def write(name: str, run: dict[str, Any], figures: dict[str, Any],
          path: Path | None = None) -> Path:
    """Write ``figures`` under the run's metadata to ``path`` or ``results_dir()/name``."""
    out = path or results_dir() / name
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {**run, "loadavg_at_end": _load()}
    clash = set(KEYS) & set(figures)
    if clash:
        raise ValueError(f"figures may not use the metadata keys {sorted(clash)}")
    out.write_text(json.dumps({**meta, **figures}, indent=1) + "\n")
    return out
