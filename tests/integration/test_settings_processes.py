"""Settings against real ``lease-sidecar`` processes, real files and a real event loop.

Bad settings end the process with exit 2 and one line on stderr before anything
connects; a short lease alone works; passwords never reach the logs or ``/status``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar import config
from sidecar.runtime import Sidecar
from sidecar.settings import Settings
from testkit.support import SidecarProcess, free_port, get_json, wait_until


def lease_sidecar() -> list[str]:
    """The installed console script, as a user runs it (``python -m sidecar`` if absent)."""
    script = Path(sys.executable).with_name("lease-sidecar")
    return [str(script)] if script.exists() else [sys.executable, "-m", "sidecar"]


def run_briefly(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEASE_")}
    return subprocess.run(
        [*lease_sidecar(), "run", "--http-addr", f"127.0.0.1:{free_port()}", *args],
        env={**clean, "LEASE_STATE_DIR": str(tmp_path / "state"),
             "LEASE_DSN": str(tmp_path / "leases.db"), **env},
        capture_output=True, text=True, timeout=30)


SECRET = "s3cret-Pw"

BAD = [
    ({"LEASE_DURATION": "9" * 400}, "LEASE_DURATION / --lease-duration: '999999999999'"),
    ({"LEASE_DURATION": "inf"}, "LEASE_DURATION / --lease-duration: 'inf' is not a duration"),
    ({"LEASE_RENEW_INTERVAL": "1us"},
     "LEASE_RENEW_INTERVAL / --renew-interval: 1\u00b5s is less than the minimum 10ms"),
    ({"LEASE_DSN": ":memory:"}, "LEASE_DSN / --dsn: ':memory:' is an in-memory database"),
    ({"LEASE_DSN": "{tmp}"}, "LEASE_DSN / --dsn: '{tmp}' is a directory"),
    ({"LEASE_BACKEND": "postgres-row",
      "LEASE_DSN": f"postgresql://lease:{SECRET}@127.0.0.1:99999/x"},
     "LEASE_DSN / --dsn: the port of host '127.0.0.1' is not a number from 1 to 65535"),
    ({"LEASE_BACKEND": "postgres", "LEASE_DSN": f"postgresql://lease:{SECRET}@[::1/x"},
     "LEASE_DSN / --dsn: bad IPv6 host '[::1'"),
    ({"LEASE_BACKEND": "postgres",
      "LEASE_DSN": f"postgresql://lease:{SECRET}@127.0.0.1/x?sslmode=requre"},
     "LEASE_DSN / --dsn: sslmode 'requre' is not one of"),
    ({"LEASE_BACKEND": "postgres-row", "LEASE_DSN": f"postgresql://lease:p@{SECRET}@db/x"},
     "LEASE_DSN / --dsn: more than one '@' before the host"),
    ({"LEASE_BACKEND": "kubernetes", "LEASE_SAFETY_MARGIN": "500ms"},
     "LEASE_SAFETY_MARGIN / --safety-margin: 500ms is less than 1s"),
    ({"LEASE_DURATION": "3s", "LEASE_CLAIM_HORIZON": "2s"},
     "LEASE_CLAIM_HORIZON / --claim-horizon: 2s plus LEASE_RENEW_INTERVAL 400ms (derived"),
]


@pytest.mark.parametrize(("env", "expected"), BAD)
def test_bad_settings_exit_2_with_one_line(env, expected, tmp_path: Path):
    env = {k: v.replace("{tmp}", str(tmp_path)) for k, v in env.items()}
    started = time.monotonic()
    result = run_briefly(tmp_path, env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("lease-sidecar: error: " + expected.replace("{tmp}",
                                                                             str(tmp_path)))
    assert SECRET not in result.stderr + result.stdout
    assert not (tmp_path / "state").exists()  # refused before anything started
    assert time.monotonic() - started < 20


def test_a_leader_directory_in_the_state_dir_is_named_as_a_state_dir_problem(tmp_path: Path):
    (tmp_path / "state" / "leader").mkdir(parents=True)
    result = run_briefly(tmp_path, {})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [f"lease-sidecar: error: LEASE_STATE_DIR / --state-dir: "
                     f"{tmp_path}/state/leader: Is a directory"]


def test_a_busy_http_address_is_still_named_as_such(tmp_path: Path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_briefly(tmp_path, {}, "--http-addr", f"127.0.0.1:{port}")
    assert result.returncode == 2
    assert result.stderr.startswith(
        f"lease-sidecar: error: LEASE_HTTP_ADDR / --http-addr: cannot listen on 127.0.0.1:{port}")


def _strict_json(text: str):
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_short_lease_alone_starts_and_leads(tmp_path: Path):
    """LEASE_DURATION=3s and nothing else: the derived renew deadline and interval fit."""
    proc = SidecarProcess(tmp_path, "short", env={"LEASE_DURATION": "3s"},
                          args=["--dsn", str(tmp_path / "leases.db")]).start()
    try:
        proc.wait_http()
        wait_until(lambda: proc.leader() == 200, timeout=10)
        first = get_json(proc.url + "/leader")[1]
        time.sleep(1.5)  # several renewals at the derived 400 ms
        assert proc.leader() == 200
        assert get_json(proc.url + "/leader")[1]["fencing_token"] == first["fencing_token"]
        with __import__("urllib.request").request.urlopen(proc.url + "/status") as response:
            status = _strict_json(response.read().decode())
        shown = status["settings"]
        assert (shown["lease_duration"], shown["renew_interval"], shown["renew_deadline"]) == (
            3.0, 0.4, 2.0)
    finally:
        assert proc.stop() == 0


@pytest.mark.parametrize(("backend", "dsn"), [
    ("postgres-row", "postgresql://lease:<secret>@127.0.0.1:<port>/x?sslpassword=K3y-<secret>"),
    ("postgres", "postgresql://lease:<secret>@127.0.0.1:<port>/x?sslpassword=K3y-<secret>"),
    ("sqlserver", "DRIVER={No Such Driver};SERVER=127.0.0.1,<port>;UID=sa;PWD={a}};<secret>}"),
])
def test_passwords_stay_out_of_logs_and_status(backend, dsn, tmp_path: Path):
    """A real backend error (nothing listens there) with the DSN echoed by the drivers."""
    dsn = dsn.replace("<secret>", SECRET).replace("<port>", str(free_port()))
    proc = SidecarProcess(tmp_path, "secretive", args=["--backend", backend, "--dsn", dsn,
                                                       "--pod-label", "off"]).start()
    try:
        proc.wait_http()
        wait_until(lambda: "backend unreachable" in proc.logs(), timeout=15)
        status = get_json(proc.url + "/status")[1]
        assert status["leases"][0]["reason"].startswith("backend unreachable")
        shown = proc.logs() + json.dumps(status)
        assert SECRET not in shown and "K3y" not in shown
        assert "***" in json.dumps(status["settings"])
        # Over-redaction must not eat the reason itself.
        assert ("Connect call failed" in shown if backend.startswith("postgres")
                else "ODBC driver not installed: No Such Driver" in shown)
    finally:
        proc.stop()


async def _terms(settings: Settings, seconds: float) -> list[dict]:
    sidecar = Sidecar(replace(settings, http_addr=("127.0.0.1", 0)))
    await sidecar.start()
    try:
        await asyncio.sleep(seconds)
        return list(sidecar.states[0].transitions)
    finally:
        await sidecar.stop()


async def test_a_horizon_the_rule_refuses_really_ends_a_term_before_its_first_renew(
        tmp_path: Path) -> None:
    """What the claim-horizon rule prevents, on the real elector and a real SQLite file.

    Validity 2s - 500ms = 1.5s. Horizon 1.3s + renew 300ms (±10 %) ≥ 1.57s: a term that
    waits its horizon (the first here: nothing was released before it, as after a crash
    or a hand edit) gets its first renew after the validity ran out and steps down
    unrenewed. The next term follows our own recorded release, so it claims at once and
    holds; so does every term with a horizon of 100ms, which leaves a second to spare.
    """
    base = {"dsn": str(tmp_path / "leases.db"), "state_dir": str(tmp_path / "state"),
            "lease_duration": "2s", "safety_margin": "500ms", "renew_interval": "300ms"}
    with pytest.raises(config.ConfigError, match="LEASE_CLAIM_HORIZON / --claim-horizon"):
        config.load({**base, "claim_horizon": "1300ms"}, env={})
    good = config.load({**base, "claim_horizon": "100ms"}, env={})
    # Timing refuses this horizon on construction too; bypass it to show what it prevents.
    bad_timing = copy.copy(good.timing)
    object.__setattr__(bad_timing, "claim_horizon", 1.3)
    bad = replace(good, timing=bad_timing)

    lapsed = [(t["event"], t["reason"]) for t in await _terms(bad, 4.0)]
    assert lapsed[:2] == [("acquired", "holding"),
                          ("released", "lease validity ran out before a renew succeeded")]
    assert lapsed[2:] == [("acquired", "holding")], lapsed

    (tmp_path / "leases.db").unlink()  # a fresh start: nothing recorded
    steady = await _terms(good, 3.0)
    assert [t["event"] for t in steady] == ["acquired"]


# -- DSN verdicts against asyncpg and a real PostgreSQL server ------------------------------

@pytest.mark.postgres
async def test_accepted_urls_connect_and_refused_ones_never_could(pg) -> None:
    """Every URL form we accept connects to a real server through asyncpg; every one we
    refuse fails in asyncpg or at the server, so refusing it up front loses nothing."""
    import urllib.parse

    import asyncpg

    from sidecar.base.dsn import _PG_UNSUPPORTED, DsnError, check_postgres_url

    pw = urllib.parse.quote(pg.password, safe="")
    base = f"postgresql://lease:{pw}@127.0.0.1:{pg.port}/lease"
    sock = urllib.parse.quote(str(pg.sockdir), safe="")
    accepted = [
        base, base.replace("postgresql://", "postgres://"),
        f"{base}?application_name=jobs&sslmode=prefer",
        f"postgresql:///lease?host=127.0.0.1&port={pg.port}&user=lease&password={pw}",
        f"postgresql:///lease?host={pg.sockdir}&port={pg.port}&user=lease",
        f"postgresql://{sock}:{pg.port}/lease?user=lease",
        f"postgresql://127.0.0.1:{pg.port},127.0.0.1:{pg.port}/lease?user=lease&password={pw}"
        "&target_session_attrs=primary",
    ]
    for dsn in accepted:
        check_postgres_url(dsn)
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            assert await conn.fetchval("select current_user") == "lease"
        finally:
            await conn.close()

    refused = [
        f"postgresql://lease:{pw}@127.0.0.1:99999/lease",
        f"postgresql://lease:{pw}@[::1/lease",
        f"{base}?sslmode=requre",
        f"postgresql://lease:p@{pw}@127.0.0.1:{pg.port}/lease",
        *(f"{base}?{key}=1" for key in _PG_UNSUPPORTED),
        f"{base}?sslmod=disable",
    ]
    for dsn in refused:
        with pytest.raises(DsnError):
            check_postgres_url(dsn)
        # Any failure, in the driver (bad value) or at the server (unknown parameter).
        with pytest.raises((ValueError, OverflowError, OSError, asyncpg.PostgresError,
                            asyncpg.InterfaceError)):
            conn = await asyncpg.connect(dsn, timeout=10)
            await conn.close()
