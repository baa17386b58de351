"""`lease-sidecar <command> --help` prints its usage, never a traceback, whichever extras
are installed: run in real interpreters, once as installed here (every extra) and once
with every extra's modules made unimportable, as in the sidecar image or a bare
`pip install .`."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from testkit.support import REPO


def _commands() -> tuple[str, ...]:
    """The parser's own list, so a new command is held to these tests at once."""
    from sidecar.cli import _parser

    (sub,) = [a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return tuple(sub.choices)


COMMANDS = _commands()
# The modules the extras bring (postgres, sqlserver, injector).
EXTRAS = ("asyncpg", "pyodbc", "kopf", "kubernetes", "cryptography")


def lease_sidecar(*args: str, without: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    # A module set to None in sys.modules cannot be imported: ModuleNotFoundError, as
    # when it is not installed.
    program = ("import sys\n"
               f"for name in {without!r}: sys.modules[name] = None\n"
               "from sidecar.cli import main\n"
               "raise SystemExit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", program, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("without", [(), EXTRAS], ids=["every-extra", "no-extra"])
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_prints_its_help(command: str, without: tuple[str, ...]) -> None:
    done = lease_sidecar(command, "--help", without=without)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: lease-sidecar {command}"), done.stdout


def test_the_top_level_help_lists_every_command() -> None:
    done = lease_sidecar("--help", without=EXTRAS)
    assert done.returncode == 0, done.stderr
    for command in COMMANDS:
        assert command in done.stdout


def test_the_operator_without_its_extra_says_so_in_one_line() -> None:
    done = lease_sidecar("operator", without=EXTRAS)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "lease-sidecar: error: operator: needs the injector extra (pip install "
        "'lease-sidecar[injector]', or the operator image): no module 'kopf'"]


def test_a_bad_operator_flag_is_refused_without_the_extra() -> None:
    done = lease_sidecar("operator", "--no-such-flag", without=EXTRAS)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "unrecognized arguments: --no-such-flag" in done.stderr


def test_docs_cli_lists_every_command() -> None:
    table = (REPO / "docs" / "cli.md").read_text().split("## Stopping")[0]
    for command in COMMANDS:
        assert f"| `lease-sidecar {command}" in table, f"docs/cli.md lacks {command}"
