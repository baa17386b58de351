"""Advisory lock ids, and the per-session timing settings of the ``postgres`` backend.

The lock id must be the same in every process and every version, so it is compared with
the value PostgreSQL itself computes from the same text (the real server of the test bed).
"""

from __future__ import annotations

import pytest

from sidecar.lease import pg_session
from sidecar.lease.postgres_advisory.session import application_name, session_settings
from sidecar.lease.postgres_advisory.sql import key_from_halves, lock_halves, lock_id, wait_lock_sql
from sidecar.settings import StoreSettings, Timing
from testkit.testbed.postgres import PgServer

IN_POSTGRES = ("select ('x' || substr(encode(sha256(convert_to(t, 'UTF8')), 'hex'), 1, 16))"
               "::bit(64)::bigint from (select {text}::text as t) s")

NAMES = [("lease-sidecar", "default"), ("svc-a", "sweeper"), ("p", "ünïcode-名前"),
         ("", "x"), ("lease-sidecar", "leader")]


def literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def key(prefix: str, name: str) -> str:
    return StoreSettings(key_prefix=prefix).key(name)


@pytest.mark.postgres
@pytest.mark.parametrize(("prefix", "name"), NAMES)
def test_lock_id_matches_postgres(pg: PgServer, prefix: str, name: str) -> None:
    """The id is computed from the lease's one key, the text PostgreSQL hashes here."""
    expected = int(pg.psql(IN_POSTGRES.format(text=literal(key(prefix, name)))))
    assert lock_id(key(prefix, name)) == expected


@pytest.mark.postgres
@pytest.mark.parametrize(("prefix", "name"), [(p, n) for p, n in NAMES if p])
def test_lock_id_is_unchanged_for_every_non_empty_prefix(pg: PgServer, prefix: str,
                                                         name: str) -> None:
    """Earlier versions hashed their own ``{prefix}.{name}``; with a prefix that is the
    text of the one key, so sidecars of both versions hold the same lock."""
    concatenated = f"{literal(prefix)} || '.' || {literal(name)}"
    assert lock_id(key(prefix, name)) == int(pg.psql(IN_POSTGRES.format(text=concatenated)))


def test_an_empty_prefix_hashes_the_name_alone() -> None:
    """``--key-prefix ""``: the key is the name, as for the row name and the Lease object;
    earlier versions hashed ``.{name}`` (a changed lock id, noted in the README)."""
    assert key("", "x") == "x"
    assert lock_id(key("", "x")) == lock_id("x") != lock_id(".x")


def test_lock_id_is_a_signed_bigint_and_prefix_matters() -> None:
    ids = {lock_id(key(prefix, name)) for prefix, name in NAMES}
    assert len(ids) == len(NAMES)
    assert all(-(2**63) <= value < 2**63 for value in ids)
    assert lock_id(key("a", "b")) != lock_id(key("b", "b"))
    # Known value, pinned so a refactor cannot silently change every lock id in the field.
    default = lock_id(key("lease-sidecar", "default"))
    assert default == int.from_bytes(bytes.fromhex("8b8b41b32fa65ada"), "big", signed=True)
    assert default < 0  # the high bit is set: signed, not unsigned


@pytest.mark.parametrize("key", [0, 1, -1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0])
def test_pg_locks_halves_round_trip(key: int) -> None:
    classid, objid = lock_halves(key)
    assert 0 <= classid < 2**32 and 0 <= objid < 2**32
    assert key_from_halves(classid, objid) == key


def test_application_name_is_cut_to_63_bytes_on_a_character_boundary() -> None:
    assert application_name("pod-a") == "pod-a"
    long = "é" * 40  # 80 bytes
    cut = application_name(long)
    assert len(cut.encode()) <= 63 and long.startswith(cut) and len(cut) == 31


@pytest.mark.parametrize(("lease", "renew", "deadline", "horizon"),
                         [(15, 2, 10, 0.25), (3, 0.5, 2, 0.25), (5, 1, 5, 2)])
def test_server_outlasts_the_client(lease: float, renew: float, deadline: float,
                                    horizon: float) -> None:
    """The server must not end a silent session before the client stopped claiming."""
    timing = Timing(lease_duration=lease, renew_interval=renew, renew_deadline=deadline,
                    claim_horizon=horizon, holds_by="session")
    values = session_settings(timing, 150000)
    client_done = deadline + horizon
    keepalive = (int(values["tcp_keepalives_idle"])
                 + int(values["tcp_keepalives_interval"]) * int(values["tcp_keepalives_count"]))
    assert keepalive > client_done
    assert int(values["tcp_user_timeout"]) / 1000 > client_done
    idle = float(values["idle_session_timeout"].removesuffix("ms")) / 1000
    assert idle > client_done and idle >= lease
    assert idle <= max(lease, client_done) + 1  # "about the lease duration"


def test_older_servers_get_only_the_settings_they_know() -> None:
    timing = Timing(holds_by="session")
    assert "idle_session_timeout" not in session_settings(timing, 130000)
    assert "tcp_user_timeout" in session_settings(timing, 130000)
    assert "tcp_user_timeout" not in session_settings(timing, 110000)


def test_sessions_turn_off_the_roles_timeouts_and_keep_their_own() -> None:
    """A role's statement_timeout would cancel the in-server wait (a reconnect each time);
    the advisory session turns the four timeouts off but keeps its own idle timeout (the
    in-server wait's lock_timeout is set per statement)."""
    values = session_settings(Timing(holds_by="session"), 150000)
    assert values["statement_timeout"] == "0"
    assert values["lock_timeout"] == "0"
    assert values["idle_in_transaction_session_timeout"] == "0"
    assert values["idle_session_timeout"].endswith("ms")
    assert int(values["idle_session_timeout"].removesuffix("ms")) > 0
    assert "idle_session_timeout" not in pg_session.overrides(130000)
    assert "set_config('lock_timeout', $6, true)" in wait_lock_sql(150000)
