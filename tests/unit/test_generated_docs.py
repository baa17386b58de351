"""The generated reference tables match their sources: run `python -m scripts.gendocs`
after changing the option table, the metrics, or the chart's values."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scripts import gendocs
from testkit.support import REPO


@pytest.mark.parametrize("name", sorted(gendocs.TARGETS))
def test_the_generated_block_matches_its_source(name: str) -> None:
    path, _ = gendocs.TARGETS[name]
    written = gendocs.current(name)
    assert written is not None, f"{path.relative_to(REPO)} lost its '{name}' block"
    assert written == gendocs.expected(name), (
        f"{path.relative_to(REPO)} ({name}) is out of date: run python -m scripts.gendocs")


def test_every_setting_every_metric_and_every_value_is_in_its_table() -> None:
    from sidecar.config import OPTIONS

    settings = gendocs.current("settings") or ""
    assert all(f"| `{o.env}` | `{o.flag}` |" in settings for o in OPTIONS)
    values = gendocs.current("chart-values") or ""
    for key in ("lease.backend", "injector.enabled", "leaderService.enabled",
                "monitoring.podMonitor.enabled"):
        assert f"| `{key}` |" in values, key


def test_the_check_mode_fails_on_a_stale_block(tmp_path, monkeypatch, capsys) -> None:
    """--check exits 1 naming the file when a block differs, and 0 when all match."""
    path, make = gendocs.TARGETS["settings"]
    stale = tmp_path / "configuration.md"
    stale.write_text(path.read_text().replace("`LEASE_BACKEND`", "`LEASE_BACKEND_X`"))
    monkeypatch.setitem(gendocs.TARGETS, "settings", (stale, make))
    assert gendocs.main(["--check"]) == 1
    assert str(stale) in capsys.readouterr().err
    gendocs.write("settings")
    assert gendocs.main(["--check"]) == 0


def test_the_generator_runs_without_loading_it_into_the_sidecar() -> None:
    done = subprocess.run([sys.executable, "-c",
                           "import sys, sidecar.cli, sidecar.runtime; "
                           "print(any(m.startswith('scripts') for m in sys.modules))"],
                          cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
