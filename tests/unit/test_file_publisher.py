"""The leader file: exists exactly while leading, atomic, refreshed, per-lease names."""

import asyncio
import json

from sidecar.publish.file import FilePublisher
from sidecar.state import LeaseState, SystemClock


def states_for(*names: str) -> list[LeaseState]:
    return [LeaseState(lease=n, identity="me", role="all", claim_horizon=0.3,
                       clock=SystemClock()) for n in names]


def lead(state: LeaseState, seconds: float = 10.0) -> None:
    now = state.clock.monotonic()
    state.update(holding=True, claim_from=now, valid_until=now + seconds, fencing_token=9)


async def test_file_exists_exactly_while_leading(tmp_path):
    first, second = states_for("a", "b")
    publisher = FilePublisher([first, second], tmp_path)
    (tmp_path / "leader").write_text("{}")  # a previous run's leftover
    await publisher.start()
    try:
        assert not (tmp_path / "leader").exists()
        lead(first)
        await publisher.changed(first)
        body = json.loads((tmp_path / "leader").read_text())
        assert body["leader"] is True and body["fencing_token"] == 9
        assert json.loads((tmp_path / "a").read_text())["lease"] == "a"
        assert not (tmp_path / "b").exists()
        lead(second)
        await publisher.changed(second)
        assert json.loads((tmp_path / "b").read_text())["lease"] == "b"
        first.update(released=True)
        await publisher.changed(first)
        assert not (tmp_path / "leader").exists() and not (tmp_path / "a").exists()
        assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temp files
    finally:
        await publisher.stop()
    assert not (tmp_path / "b").exists()  # stop removes what it wrote


async def test_file_is_refreshed_and_removed_when_validity_lapses(tmp_path):
    (state,) = states_for("a")
    publisher = FilePublisher([state], tmp_path)
    await publisher.start()
    try:
        lead(state, seconds=0.5)
        await publisher.changed(state)
        before = json.loads((tmp_path / "leader").read_text())["valid_until"]
        await asyncio.sleep(0.2)
        after = json.loads((tmp_path / "leader").read_text())["valid_until"]
        assert after > before  # refreshed within the horizon
        await asyncio.sleep(0.6)  # lease validity over; nobody called changed()
        assert not (tmp_path / "leader").exists()
    finally:
        await publisher.stop()
