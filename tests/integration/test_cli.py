"""The command line as a user meets it: real ``lease-sidecar`` processes, real files.

``--version``, each subcommand's own flags in its help, ``status`` (table, ``--json``,
exit 3 for what does not exist, never creating anything) against a real holder on
SQLite, and ``schema --print`` without a DSN. The PostgreSQL and Kubernetes status tests
live at the end of this file and use the real test beds.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

import sidecar
from sidecar.lease.postgres_advisory.sql import lock_id
from sidecar.lease.sql.dialect import PostgresDialect, TsqlDialect
from sidecar.settings import StoreSettings
from testkit.kube_support import create_pods, install_rbac, lease_spec, lease_token
from testkit.kube_support import sidecar as kube_sidecar
from testkit.support import REPO, SidecarProcess, get_json, one_leader, unix_time, wait_until
from testkit.testbed.kube import ControlPlane
from testkit.testbed.postgres import PgServer

FAST = ["--lease-duration", "2s", "--renew-interval", "300ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]
# /leader's format (sidecar.base.clock.rfc3339): UTC, milliseconds, Z.
RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
HEADER = ["LEASE", "HOLDER", "FENCING TOKEN", "EXPIRES"]


def cli(*args: str, env: dict[str, str] | None = None,
        cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """One ``lease-sidecar`` process; no LEASE_* variable leaks in from the test run."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEASE_")}
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True,
                          text=True, timeout=60, cwd=cwd, env={**clean, **(env or {})})


def table(stdout: str) -> list[dict[str, str]]:
    """The status table back as dicts, split on its column starts."""
    lines = stdout.splitlines()
    starts = [lines[0].index(name) for name in HEADER]
    assert starts == sorted(starts), lines[0]
    bounds = [*starts[1:], None]
    return [{name: line[start:end].strip() for name, start, end in zip(HEADER, starts, bounds,
                                                                         strict=True)}
            for line in lines[1:]]


def parse_time(text: str) -> float:
    assert RFC3339_MS.match(text), text
    return unix_time(text)


# -- --version and help ---------------------------------------------------------------------
def test_version_is_the_package_version() -> None:
    result = cli("--version")
    assert result.returncode == 0, result.stderr
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert importlib.metadata.version("lease-sidecar") == sidecar.__version__
    assert result.stdout.strip() == f"lease-sidecar {sidecar.__version__}"
    chart = yaml.safe_load((REPO / "charts/lease-sidecar/Chart.yaml").read_text())
    assert chart["appVersion"] == sidecar.__version__


HOLDING = {"--backend", "--dsn", "--replica-dsn", "--replica-timeout", "--name", "--identity",
           "--key-prefix", "--lease-duration", "--renew-interval", "--renew-deadline",
           "--safety-margin", "--claim-horizon", "--http-addr", "--state-dir", "--role",
           "--schema", "--table", "--odbc-driver", "--pod-label", "--log-level",
           "--work-stall-after", "--ensure-schema", "--app-ready-url", "--app-unready-after",
           "--app-ready-containers", "--shutdown-handover", "--app-ready-outage-grace",
           "--control-token-file", "--shards", "--help"}
FLAGS = {
    "run": HOLDING,
    "exec": HOLDING | {"--grace", "--acquire-timeout"},
    "status": {"--backend", "--dsn", "--name", "--key-prefix", "--schema", "--table",
               "--odbc-driver", "--shards", "--json", "--help"},
    "schema": {"--backend", "--dsn", "--schema", "--table", "--odbc-driver", "--print",
               "--apply", "--help"},
}


@pytest.mark.parametrize("command", list(FLAGS))
def test_each_command_lists_its_own_flags_and_no_other(command: str) -> None:
    result = cli(command, "--help")
    assert result.returncode == 0, result.stderr
    options = result.stdout.split("options:", 1)[1]
    listed = set(re.findall(r"(?m)^\s+(?:-[a-z], )?(--[a-z][a-z-]*)", options))
    assert listed == FLAGS[command]
    if command in ("status", "schema"):
        for flag in ("--lease-duration", "--http-addr", "--grace", "--identity"):
            assert flag not in result.stdout


def test_top_level_help_names_the_commands_and_version() -> None:
    result = cli("--help")
    assert result.returncode == 0
    for word in ("run", "exec", "schema", "status", "--version"):
        assert word in result.stdout
    assert "--lease-duration" not in result.stdout


def test_a_flag_of_another_command_is_refused() -> None:
    result = cli("status", "--lease-duration", "3s")
    assert result.returncode == 2
    assert "unrecognized arguments: --lease-duration" in result.stderr


def test_a_bad_acquire_timeout_is_named() -> None:
    result = cli("exec", "--backend", "sqlite", "--name", "x", "--identity", "a",
                 "--acquire-timeout", "soon", "--", "true")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lease-sidecar: error: --acquire-timeout: "), \
        lines
    assert "soon" in lines[0]


@pytest.mark.parametrize("command", [["run"], ["exec", "--", "true"]])
def test_the_pod_label_outside_a_pod_is_not_blamed_on_another_flag(
        command: list[str], tmp_path: Path) -> None:
    # Only --acquire-timeout's own parse error names --acquire-timeout.
    result = cli(*command, env={"LEASE_BACKEND": "sqlite", "LEASE_NAME": "x",
                                "LEASE_IDENTITY": "a", "LEASE_POD_LABEL": "on",
                                "LEASE_DSN": str(tmp_path / "l.db"),
                                "LEASE_STATE_DIR": str(tmp_path / "state"),
                                "LEASE_HTTP_ADDR": "127.0.0.1:0"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "lease-sidecar: error: the pod label needs POD_NAME and POD_NAMESPACE")


# -- schema --print needs no DSN ------------------------------------------------------------
def test_schema_print_needs_no_dsn() -> None:
    result = cli("schema", "--print", "--backend", "postgres-row")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == PostgresDialect().schema_script()
    assert result.stderr == ""
    tsql = cli("schema", "--print", "--backend", "sqlserver", "--table", "JobLeases")
    assert tsql.returncode == 0, tsql.stderr
    assert tsql.stdout.strip() == TsqlDialect("lease", "JobLeases").schema_script()


# Run as ``python -c``: makes importing one top-level package fail as if it were not
# installed, then runs the CLI with the remaining arguments.
WITHOUT = """
import sys
missing = sys.argv[1]
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name == missing or name.startswith(missing + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Missing())
from sidecar.cli import main
sys.exit(main(sys.argv[2:]))
"""


def cli_without(package: str, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEASE_")}
    return subprocess.run([sys.executable, "-c", WITHOUT, package, *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=clean)


@pytest.mark.parametrize(("backend", "driver", "extra"), [
    ("postgres-row", "asyncpg", "postgres"), ("sqlserver", "pyodbc", "sqlserver")])
def test_schema_print_needs_no_driver(backend: str, driver: str, extra: str) -> None:
    result = cli_without(driver, "schema", "--print", "--backend", backend)
    assert result.returncode == 0, result.stderr
    dialect = PostgresDialect() if backend == "postgres-row" else TsqlDialect()
    assert result.stdout.strip() == dialect.schema_script()
    # A command that connects still says what is missing, before connecting.
    dsn = ("postgresql://u@127.0.0.1:1/db" if backend == "postgres-row"
           else "Server=127.0.0.1,1;Database=db;UID=u;PWD=p")
    for command in (["schema", "--apply"], ["status"], ["run"]):
        refused = cli_without(driver, *command, "--backend", backend, "--dsn", dsn)
        assert refused.returncode == 2, (command, refused.stderr)
        assert refused.stderr.strip().splitlines() == [
            f"lease-sidecar: error: LEASE_BACKEND / --backend: the {backend} backend cannot "
            f"load (No module named '{driver}'); install lease-sidecar[{extra}]"], command


def test_schema_apply_still_needs_a_dsn() -> None:
    result = cli("schema", "--apply", "--backend", "postgres-row")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "lease-sidecar: error: LEASE_DSN / --dsn: the postgres-row backend needs a DSN"]


# -- status on SQLite ------------------------------------------------------------------------
@pytest.fixture
def holder(tmp_path: Path):
    """One real sidecar holding ``jobs`` and ``reports`` in a SQLite file."""
    proc = SidecarProcess(tmp_path, "node-a", args=["--dsn", str(tmp_path / "leases.db"),
                                                    "--name", "jobs,reports", *FAST]).start()
    proc.wait_http()
    wait_until(lambda: one_leader([proc]), timeout=10)
    wait_until(lambda: get_json(proc.url + "/leader/reports")[0] == 200, timeout=10)
    yield proc
    proc.stop()


def leader_body(proc: SidecarProcess, lease: str) -> dict[str, Any]:
    status, body, _ = get_json(f"{proc.url}/leader" + ("" if lease == "jobs" else f"/{lease}"))
    assert status == 200, body
    return body


def test_status_table_names_holder_token_and_expiry(holder: SidecarProcess,
                                                    tmp_path: Path) -> None:
    before = time.time()
    result = cli("status", "--dsn", str(tmp_path / "leases.db"))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines()[0].split("  ")[0] == "LEASE"
    rows = table(result.stdout)
    assert [row["LEASE"] for row in rows] == ["jobs", "reports"]
    for row in rows:
        assert row["HOLDER"] == "node-a"
        assert int(row["FENCING TOKEN"]) == leader_body(holder, row["LEASE"])["fencing_token"]
        # The row's expiry: renewed every 300 ms for 2 s, so 1.4 to 2 s ahead (+ slack).
        assert before < parse_time(row["EXPIRES"]) < time.time() + 2.5


def test_status_json_is_one_document_in_the_leader_time_format(holder: SidecarProcess,
                                                               tmp_path: Path) -> None:
    result = cli("status", "--json", "--dsn", str(tmp_path / "leases.db"))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)  # one document, not JSON lines
    assert document["backend"] == "sqlite" and document["key_prefix"] == "lease-sidecar"
    assert document["unknown"] == []
    assert [row["lease"] for row in document["leases"]] == ["jobs", "reports"]
    for row in document["leases"]:
        published = leader_body(holder, row["lease"])
        assert row["holder"] == published["holder"] == "node-a"
        assert row["fencing_token"] == published["fencing_token"]
        assert RFC3339_MS.match(published["valid_until"])
        parse_time(row["expires_at"])


def test_status_reads_lease_name_from_the_environment(holder: SidecarProcess,
                                                      tmp_path: Path) -> None:
    result = cli("status", "--json", env={"LEASE_DSN": str(tmp_path / "leases.db"),
                                          "LEASE_NAME": "reports"})
    assert result.returncode == 0, result.stderr
    assert [row["lease"] for row in json.loads(result.stdout)["leases"]] == ["reports"]


def test_unknown_lease_exits_3(holder: SidecarProcess, tmp_path: Path) -> None:
    db = str(tmp_path / "leases.db")
    alone = cli("status", "--dsn", db, "--name", "nosuch")
    assert alone.returncode == 3
    assert alone.stdout == ""
    assert alone.stderr.strip().splitlines() == [
        "lease-sidecar: no such lease: nosuch (backend sqlite, key prefix 'lease-sidecar')"]
    mixed = cli("status", "--json", "--dsn", db, "--name", "jobs,nosuch")
    assert mixed.returncode == 3
    document = json.loads(mixed.stdout)
    assert [row["lease"] for row in document["leases"]] == ["jobs"]
    assert document["unknown"] == ["nosuch"]
    other_prefix = cli("status", "--dsn", db, "--name", "jobs", "--key-prefix", "other")
    assert other_prefix.returncode == 3


def test_expired_lease_exists_but_is_free(holder: SidecarProcess, tmp_path: Path) -> None:
    """SIGKILL leaves the row behind: the lease exists, nobody holds it once it expires."""
    token = leader_body(holder, "jobs")["fencing_token"]
    holder.signal(signal.SIGKILL)
    holder.proc.wait(5)  # type: ignore[union-attr]  # the fixture started it
    db = str(tmp_path / "leases.db")

    def expired() -> subprocess.CompletedProcess[str] | None:
        result = cli("status", "--dsn", db, "--name", "jobs")
        return result if table(result.stdout)[0]["HOLDER"] == "-" else None

    result = wait_until(expired, timeout=5, interval=0.2)
    assert result.returncode == 0, result.stderr
    row = table(result.stdout)[0]
    assert row["FENCING TOKEN"] == str(token)
    assert parse_time(row["EXPIRES"]) <= time.time()
    document = json.loads(cli("status", "--json", "--dsn", db, "--name", "jobs").stdout)
    assert document["leases"][0]["holder"] is None
    assert document["leases"][0]["fencing_token"] == token


def test_released_lease_exists_but_is_free(holder: SidecarProcess, tmp_path: Path) -> None:
    """SIGTERM releases: the row stays, expired at the release (with the release record
    for the next holder), so the lease is shown free at once with its last term's token."""
    token = leader_body(holder, "jobs")["fencing_token"]
    holder.signal(signal.SIGTERM)
    assert holder.proc.wait(10) == 0  # type: ignore[union-attr]  # the fixture started it
    db = str(tmp_path / "leases.db")
    listing = cli("status", "--dsn", db, "--name", "jobs")
    assert listing.returncode == 0, listing.stderr
    row = table(listing.stdout)[0]
    assert row["HOLDER"] == "-" and row["FENCING TOKEN"] == str(token)
    assert parse_time(row["EXPIRES"]) <= time.time()


def test_status_on_a_missing_database_creates_nothing(tmp_path: Path) -> None:
    for db in (tmp_path / "leases.sqlite3", tmp_path / "lease-sidecar" / "leases.sqlite3"):
        for args in ((), ("--json",), ("--name", "jobs")):
            result = cli("status", "--dsn", str(db), *args, cwd=tmp_path)
            assert result.returncode == 3
            assert result.stdout == ""
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and f"no such lease database: {db}" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_status_on_a_database_without_the_table_creates_nothing(tmp_path: Path) -> None:
    db = tmp_path / "other.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE unrelated (x)")
    conn.close()
    result = cli("status", "--dsn", str(db))
    assert result.returncode == 3
    assert "no lease table leases in" in result.stderr
    with sqlite3.connect(db) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master")]
    conn.close()
    assert tables == ["unrelated"]


def test_status_backend_error_exits_1(tmp_path: Path) -> None:
    db = tmp_path / "not-a-database.db"
    db.write_bytes(b"this is not sqlite" * 100)
    result = cli("status", "--dsn", str(db))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lease-sidecar: error: sqlite {db}:")
    assert db.read_bytes() == b"this is not sqlite" * 100


# -- status on the real PostgreSQL test bed --------------------------------------------------
PG_FAST = ["--lease-duration", "3s", "--renew-interval", "300ms", "--renew-deadline", "2s",
           "--claim-horizon", "250ms"]


def contenders(tmp_path: Path, backend: str, dsn: str, count: int) -> list[SidecarProcess]:
    procs = [SidecarProcess(tmp_path, f"{backend}-{i}",
                            args=["--backend", backend, "--dsn", dsn, "--name", "jobs",
                                  *PG_FAST]).start()
             for i in range(count)]
    for proc in procs:
        proc.wait_http()
    return procs


@pytest.mark.postgres
def test_status_postgres_advisory_lock(tmp_path: Path, pg: PgServer, pg_dsn: str) -> None:
    procs = contenders(tmp_path, "postgres", pg_dsn, 2)
    try:
        leader = wait_until(lambda: one_leader(procs), timeout=10)
        result = cli("status", "--backend", "postgres", "--dsn", pg_dsn, "--name", "jobs")
        assert result.returncode == 0, result.stderr
        # The advisory lock keeps no expiry, and the token lives only in the holder.
        assert table(result.stdout) == [{"LEASE": "jobs", "HOLDER": leader.identity,
                                         "FENCING TOKEN": "-", "EXPIRES": "-"}]
        document = json.loads(cli("status", "--json", "--backend", "postgres", "--dsn", pg_dsn,
                                  "--name", "jobs").stdout)
        row = document["leases"][0]
        assert row["holder"] == leader.identity
        assert row["lock_id"] == lock_id(StoreSettings().key("jobs"))
        holder_pid = int(pg.psql(
            "select pid from pg_stat_activity where application_name = "
            f"'{leader.identity}'", dbname=pg_dsn.rsplit("/", 1)[1]))
        assert row["pid"] == holder_pid
        parse_time(row["backend_start"])
        missing = cli("status", "--backend", "postgres", "--dsn", pg_dsn, "--name", "nosuch")
        assert missing.returncode == 3 and "no such lease: nosuch" in missing.stderr
        for output in (result, missing):
            assert pg.password not in output.stdout + output.stderr
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.postgres
def test_status_postgres_row_never_creates_the_schema(pg: PgServer, pg_dsn: str,
                                                      pg_database: str) -> None:
    result = cli("status", "--backend", "postgres-row", "--dsn", pg_dsn)
    assert result.returncode == 3
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "schema --apply" in lines[0], result.stderr
    assert pg.password not in result.stderr
    assert pg.psql("select count(*) from pg_namespace where nspname = 'lease'",
                   dbname=pg_database) == "0"


@pytest.mark.postgres
def test_status_postgres_row(tmp_path: Path, pg: PgServer, pg_dsn: str) -> None:
    applied = cli("schema", "--apply", "--backend", "postgres-row", "--dsn", pg_dsn)
    assert applied.returncode == 0, applied.stderr
    procs = contenders(tmp_path, "postgres-row", pg_dsn, 2)
    try:
        leader = wait_until(lambda: one_leader(procs), timeout=10)
        token = leader_body(leader, "jobs")["fencing_token"]
        before = time.time()
        result = cli("status", "--backend", "postgres-row", "--dsn", pg_dsn)
        assert result.returncode == 0, result.stderr
        [row] = table(result.stdout)
        assert row["LEASE"] == "jobs" and row["HOLDER"] == leader.identity
        # The row's version grows with every renew; the holder keeps its acquire's.
        assert row["FENCING TOKEN"] == "-"
        assert before < parse_time(row["EXPIRES"]) < time.time() + 3.5
        document = json.loads(cli("status", "--json", "--backend", "postgres-row",
                                  "--dsn", pg_dsn, "--name", "jobs").stdout)
        [entry] = document["leases"]
        assert entry["holder"] == leader.identity and entry["fencing_token"] is None
        assert entry["row_version"] >= token
        missing = cli("status", "--backend", "postgres-row", "--dsn", pg_dsn, "--name", "nosuch")
        assert missing.returncode == 3 and "no such lease: nosuch" in missing.stderr
        assert pg.password not in result.stdout + result.stderr + missing.stderr
    finally:
        for proc in procs:
            proc.stop()


# -- status on the real kube-apiserver ---------------------------------------------------------
@pytest.mark.kube
@pytest.mark.slow
def test_status_kubernetes_reads_and_never_creates_a_lease(
        control_plane: ControlPlane, kube_namespace: str, tmp_path: Path) -> None:
    # The Role names both Leases (resourceNames), so "nosuch" is readable and absent.
    kubeconfig = install_rbac(control_plane, kube_namespace,
                              ("lease-sidecar.jobs", "lease-sidecar.nosuch"))
    create_pods(control_plane, kube_namespace, "pod-a")
    proc = kube_sidecar(tmp_path, "pod-a", kube_namespace, kubeconfig)
    # As the sidecar's own ServiceAccount, in its namespace: what `kubectl exec` would run.
    env = {"KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": kube_namespace}

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return cli("status", "--backend", "kubernetes", *args, env=env)

    try:
        proc.start()
        proc.wait_http()
        wait_until(lambda: one_leader([proc]), timeout=15)
        token = leader_body(proc, "jobs")["fencing_token"]
        result = status("--name", "jobs")
        assert result.returncode == 0, result.stderr
        [row] = table(result.stdout)
        assert row["LEASE"] == "jobs" and row["HOLDER"] == "pod-a"
        assert int(row["FENCING TOKEN"]) == lease_token(control_plane, kube_namespace) == token
        parse_time(row["EXPIRES"])
        entry = json.loads(status("--json", "--name", "jobs").stdout)["leases"][0]
        assert entry["object"] == f"{kube_namespace}/lease-sidecar.jobs"

        # Listing every Lease needs list without resourceNames, which this Role lacks:
        # one line saying so, exit 1.
        listed = status()
        assert listed.returncode == 1 and "forbidden to list leases in namespace" in listed.stderr
        assert len(listed.stderr.strip().splitlines()) == 1

        missing = status("--name", "nosuch")
        assert missing.returncode == 3 and "no such lease: nosuch" in missing.stderr
        assert lease_spec(control_plane, kube_namespace, "nosuch") == {}

        proc.stop()  # SIGTERM: the holder clears holderIdentity, the Lease stays
        released = status("--name", "jobs")
        assert released.returncode == 0, released.stderr
        [row] = table(released.stdout)
        assert row["HOLDER"] == "-" and row["FENCING TOKEN"] == str(token)
    finally:
        proc.stop()
