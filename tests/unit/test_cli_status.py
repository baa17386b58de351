"""``status`` rendering and the per-command settings, without any backend.

The real-process tests are in tests/integration/test_cli.py; these pin the pure parts:
the table and JSON shapes, the time format, and which flags each command parses.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime

import pytest

from sidecar import config
from sidecar.base.clock import rfc3339
from sidecar.cli import status as cli_status
from sidecar.lease import LeaseInfo

EXPIRES = datetime(2025, 5, 1, 12, 0, 3, 250999, tzinfo=UTC)


def test_table_aligns_columns_and_shows_dashes_for_nothing() -> None:
    text = cli_status.table([
        LeaseInfo("jobs", "pod-a", 7, EXPIRES),
        LeaseInfo("a-much-longer-name", None, None, None),
    ])
    assert text.splitlines() == [
        "LEASE               HOLDER  FENCING TOKEN  EXPIRES",
        "jobs                pod-a   7              2025-05-01T12:00:03.250Z",
        "a-much-longer-name  -       -              -",
    ]


def test_a_holder_with_a_newline_cannot_break_the_table() -> None:
    text = cli_status.table([LeaseInfo("jobs", "evil\nLEASE x", 1, None)])
    assert len(text.splitlines()) == 2 and "'evil\\nLEASE x'" in text


def test_json_row_uses_the_leader_time_format_for_every_time() -> None:
    started = datetime(2025, 5, 1, 11, 0, 0, 123456, tzinfo=UTC)
    row = cli_status.row(LeaseInfo("jobs", "pod-a", None, EXPIRES,
                                   {"pid": 42, "backend_start": started}))
    assert row == {"lease": "jobs", "holder": "pod-a", "fencing_token": None,
                   "expires_at": rfc3339(EXPIRES.timestamp()), "pid": 42,
                   "backend_start": "2025-05-01T11:00:00.123Z"}
    assert row["expires_at"] == "2025-05-01T12:00:03.250Z"
    json.dumps(row)  # plain JSON, no datetime left


def parser_for(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    config.add_arguments(parser, command)
    return parser


@pytest.mark.parametrize("command", ["status", "schema"])
def test_read_only_commands_refuse_the_holders_flags(command: str) -> None:
    with pytest.raises(SystemExit):
        parser_for(command).parse_args(["--lease-duration", "3s"])
    args = parser_for(command).parse_args(["--backend", "postgres-row", "--table", "t"])
    assert vars(args)["table"] == "t"


def test_every_command_still_reads_every_variable() -> None:
    """A flag ``status`` lacks is still read (and checked) from the environment."""
    flags = vars(parser_for("status").parse_args([]))
    env = {"LEASE_DURATION": "3s", "LEASE_NAME": "jobs"}
    settings = config.load(flags, env=env)
    assert settings.timing.lease_duration == 3.0 and settings.names == ("jobs",)
    assert "names" in settings.explicit
    with pytest.raises(config.ConfigError, match="LEASE_DURATION"):
        config.load(flags, env={"LEASE_DURATION": "forever"})


def test_only_printing_the_schema_goes_without_a_dsn() -> None:
    flags = {"backend": "postgres-row"}
    settings = config.load(flags, env={}, dsn_required=False)
    assert settings.store.dsn is None
    with pytest.raises(config.ConfigError, match="LEASE_DSN / --dsn: the postgres-row backend"):
        config.load(flags, env={})
