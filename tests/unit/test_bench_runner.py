"""`python -m bench run` knows every benchmark, and what a benchmark writes names its run.

Through subprocesses: tests do not import ``bench`` (tests/unit/test_support_layers.py).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

from testkit.support import REPO

# What every results file opens with (bench/record.py).
METADATA = ["commit", "date", "cores", "loadavg_at_start", "loadavg_at_end", "trials"]


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_the_runner_knows_every_benchmark_module():
    modules = {f"bench.{p.stem}" for p in (REPO / "bench").glob("*.py")
               if p.stem not in ("__init__", "__main__")}
    modules |= {f"bench.{p.name}" for p in (REPO / "bench").iterdir()
                if (p / "__main__.py").exists()}
    listing = bench("list")
    assert listing.returncode == 0, listing.stderr
    runs = set(re.findall(r"^\S+\s+python -m (\S+)", listing.stdout, re.M))
    helpers = set(re.search(r"^helpers, not benchmarks: (.*)$", listing.stdout,
                            re.M).group(1).split())
    assert modules - helpers == runs, (
        "add the benchmark to bench.runner.BENCHES (or a helper module to HELPERS)")
    names = re.findall(r"^(\S+)\s+python -m", listing.stdout, re.M)
    assert len(names) == len(set(names)) > 15


def test_a_quick_run_writes_the_run_metadata_into_a_scratch_directory(tmp_path):
    # The fastest benchmark (a few dozen SQLite commits, no sidecar), through the runner.
    before = sorted((REPO / "bench" / "results").iterdir())
    done = bench("run", "--quick", "--results", str(tmp_path), "sqlite_commit")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "sqlite-commit.json").read_text())
    assert list(result)[:len(METADATA)] == METADATA
    assert all(result[key] is not None for key in METADATA), result
    assert result["trials"] == 20
    assert result["commit_time"]["WAL"]["n"] == 20
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    assert result["commit"].split("+")[0] == head
    assert sorted((REPO / "bench" / "results").iterdir()) == before


def test_an_unknown_benchmark_is_named():
    done = bench("run", "--quick", "nonesuch")
    assert done.returncode != 0
    assert "unknown benchmark nonesuch" in done.stderr


def test_every_benchmark_module_imports():
    # A rename elsewhere (testkit, sidecar) breaks a benchmark only when it runs, hours
    # later; importing each one here finds it at once.
    listing = bench("list").stdout
    modules = re.findall(r"^\S+\s+python -m (\S+)", listing, re.M)
    modules = [m + ".__main__" if m == "bench.chaos" else m for m in modules]
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    done = subprocess.run([sys.executable, "-c", code, *sorted(set(modules))], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_benchmark_writes_its_results_through_the_shared_record():
    # bench/record.py puts the commit, date, cores, load and trials in every file.
    listing = bench("list").stdout
    modules = set(re.findall(r"^\S+\s+python -m (\S+)", listing, re.M))
    sources = {m: (REPO / Path(*m.split("."))).with_suffix(".py") for m in modules}
    sources["bench.chaos"] = REPO / "bench" / "chaos" / "__main__.py"
    lacking = [m for m, path in sources.items() if "record.write(" not in path.read_text()]
    assert not lacking, lacking
