"""The fenced-write snippets of docs/fencing.md (Go database/sql with pgx, Java JDBC, Node.js
pg, Python with sidecar.client and psycopg), each run with its own toolchain and driver
against a real ``lease-sidecar run`` and the real PostgreSQL with the guard applied.

Each snippet reads the claim, writes one row in one guarded transaction and prints
``wrote token=T``; once a newer leader has written (the guard's record advanced past its
token) it must print ``refused token=T sqlstate=LF001``, exit 3 and write nothing; with no
claim it prints ``not leader`` and exits 4. The drivers come from their registries once
(Go module proxy, Maven, npm) into the test bed's cache.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest

from testkit.support import REPO, SidecarProcess, get_json, wait_until
from testkit.testbed.gobuild import cache_root

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SNIPPETS = REPO / "docs" / "snippets" / "fence"
DOC = REPO / "docs" / "fencing.md"
GO = shutil.which("go") or "/usr/local/go/bin/go"
PG_JDBC = "org.postgresql:postgresql:42.7.7"
PG_NODE = "pg@8.16.3"
LANGUAGES = ("go", "java", "node", "python")
FILES = {"go": "fence.go", "java": "Fence.java", "node": "fence.mjs", "python": "fence.py"}


def test_every_snippet_is_in_the_doc_verbatim() -> None:
    doc = DOC.read_text()
    blocks = dict(re.findall(r"<!-- snippet: fence/(\S+) -->\n```\w+\n(.*?)```", doc, re.S))
    assert set(blocks) == set(FILES.values())
    for name, text in blocks.items():
        assert text == (SNIPPETS / name).read_text(), f"{name} differs from the doc"


def cached(name: str) -> Path:
    """A directory of the cache for one driver, made once under a lock."""
    root = cache_root() / "snippets"
    root.mkdir(parents=True, exist_ok=True)
    return root / name


def locked(name: str):  # type: ignore[no-untyped-def]  # a test helper
    handle = open(cache_root() / "snippets" / f"{name}.lock", "w")  # noqa: SIM115
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def java_driver() -> Path:
    jar = cached("java") / f"postgresql-{PG_JDBC.rsplit(':', 1)[1]}.jar"
    with locked("java"):
        if not jar.exists():
            subprocess.run(["mvn", "-q", "-B", "dependency:copy", f"-Dartifact={PG_JDBC}",
                            f"-DoutputDirectory={jar.parent}"], check=True, timeout=600,
                           capture_output=True)
    return jar


def node_modules() -> Path:
    where = cached("node")
    with locked("node"):
        if not (where / "node_modules" / "pg").exists():
            where.mkdir(exist_ok=True)
            subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--no-save", PG_NODE],
                           cwd=where, check=True, timeout=600, capture_output=True)
    return where


# The tool each language needs beyond the worker snippets' toolchains, and its Debian
# package (this machine kind has them installed).
TOOLS = {"go": (GO, "golang-go"), "java": ("mvn", "maven"), "node": ("npm", "npm"),
         "python": (sys.executable, "python3")}


def command(language: str, dsn: str) -> tuple[list[str], Path, dict[str, str]]:
    """How to run one snippet: argv, working directory, environment."""
    tool, package = TOOLS[language]
    if not (shutil.which(tool) or Path(tool).exists()):
        pytest.fail(f"{tool} not installed: apt-get install {package}", pytrace=False)
    url = urlsplit(dsn)
    env = {**os.environ, "DATABASE_URL": dsn}
    if language == "go":
        # Built, then run: `go run` reports the program's exit code as its own 1.
        binary = cached("go") / "fence"
        with locked("go"):
            subprocess.run([GO, "build", "-o", str(binary), "."], cwd=SNIPPETS, check=True,
                           timeout=600, capture_output=True,
                           env={**env, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local",
                                "GOWORK": "off"})
        return [str(binary)], SNIPPETS, env
    if language == "java":
        jdbc = (f"jdbc:postgresql://{url.hostname}:{url.port}{url.path}?user={url.username}"
                f"&password={url.password}")
        return (["java", "-cp", str(java_driver()), str(SNIPPETS / FILES["java"])], SNIPPETS,
                {**env, "JDBC_URL": jdbc})
    if language == "node":
        where = node_modules()
        shutil.copy(SNIPPETS / FILES["node"], where / FILES["node"])  # beside its node_modules
        return ["node", FILES["node"]], where, env
    return ([sys.executable, str(SNIPPETS / FILES["python"])], SNIPPETS,
            {**env, "PYTHONPATH": str(REPO)})


@pytest.fixture
def app_dsn(pg_dsn: str) -> str:
    result = subprocess.run([sys.executable, "-m", "sidecar", "fence-schema", "--apply",
                             "--dsn", pg_dsn], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE writes (id bigserial PRIMARY KEY, token bigint)")
    return pg_dsn


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[SidecarProcess]:
    proc = SidecarProcess(tmp_path, "app-1", args=[
        "--dsn", str(tmp_path / "leases.db"), "--name", "jobs", "--lease-duration", "3s"])
    proc.start()
    try:
        proc.wait_http()
        wait_until(lambda: proc.leader() == 200, 15)
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("language", LANGUAGES)
def test_snippet_writes_under_its_token_and_is_refused_once_stale(
        language: str, sidecar: SidecarProcess, app_dsn: str) -> None:
    argv, cwd, env = command(language, app_dsn)
    env["LEASE_LEADER_URL"] = f"{sidecar.url}/leader"

    def run() -> tuple[int, str]:
        # Generous: the first `go run` or Java launch compiles on a busy machine.
        result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                                timeout=300)
        return result.returncode, (result.stdout + result.stderr).strip()

    def rows() -> list[int]:
        with psycopg.connect(app_dsn, autocommit=True) as conn:
            return [t for (t,) in conn.execute("SELECT token FROM writes ORDER BY id")]

    token = get_json(sidecar.url + "/leader")[1]["fencing_token"]
    assert run() == (0, f"wrote token={token}")
    assert rows() == [token]
    # A newer leader writes (its first guarded transaction records its token)...
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        conn.execute("SELECT lease.lease_fence('jobs', %s)", (token + 1,))
    # ...and this process, still holding its claim, is refused by the database.
    assert run() == (3, f"refused token={token} sqlstate=LF001")
    assert rows() == [token]
    assert sidecar.release() == 202
    wait_until(lambda: sidecar.leader() == 503, 10)
    assert run() == (4, "not leader")
