"""The leader file: exists exactly while leading, atomic, refreshed, per-lease names."""

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from sidecar.base.clock import SystemClock
from sidecar.publish.file import FilePublisher
from sidecar.state import LeaseState


def states_for(*names: str) -> list[LeaseState]:
    return [LeaseState(lease=n, identity="me", role="all", claim_horizon=0.3,
                       clock=SystemClock()) for n in names]


def lead(state: LeaseState, seconds: float = 10.0) -> None:
    now = state.clock.monotonic()
    state.update(holding=True, claim_from=now, valid_until=now + seconds, fencing_token=9)


@asynccontextmanager
async def publishing(state: LeaseState, directory: Path) -> AsyncIterator[FilePublisher]:
    """A started publisher of the one lease ``state`` into ``directory``; stopped after."""
    publisher = FilePublisher([state], directory)
    await publisher.start()
    try:
        yield publisher
    finally:
        await publisher.stop()


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of a neighbour's (or ours) that a planted symlink points at: it must stay
    as it is. The state directory is ``tmp_path / "state"``."""
    (tmp_path / "state").mkdir()
    target = tmp_path / "victim"
    target.write_text("precious\n")
    return target


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
    async with publishing(state, tmp_path) as publisher:
        lead(state, seconds=0.5)
        await publisher.changed(state)
        before = json.loads((tmp_path / "leader").read_text())["valid_until"]
        await asyncio.sleep(0.2)
        after = json.loads((tmp_path / "leader").read_text())["valid_until"]
        assert after > before  # refreshed within the horizon
        await asyncio.sleep(0.6)  # lease validity over; nobody called changed()
        assert not (tmp_path / "leader").exists()


async def test_a_symlink_planted_at_the_old_temp_name_is_not_followed(tmp_path, victim):
    """Issue 11: a neighbour planted ``.leader.<pid>.tmp`` → a file of theirs (or ours)."""
    import os

    state_dir = tmp_path / "state"
    for name in ("leader", "a"):
        (state_dir / f".{name}.{os.getpid()}.tmp").symlink_to(victim)
    (state,) = states_for("a")
    async with publishing(state, state_dir) as publisher:
        lead(state)
        await publisher.changed(state)
        assert json.loads((state_dir / "leader").read_text())["leader"] is True
    assert victim.read_text() == "precious\n"


async def test_temp_name_collisions_never_follow_or_reuse(tmp_path, victim, monkeypatch):
    """Whatever sits at the temp name (a symlink, a file) is skipped, never opened.

    The random name is forced to collide with planted entries (the only stand-in here:
    a neighbour cannot predict 64 random bits); the files and the symlink are real.
    """
    from sidecar.publish import file as file_module

    state_dir = tmp_path / "state"
    planted_link = state_dir / ".leader.planted-link.tmp"
    planted_link.symlink_to(victim)
    planted_file = state_dir / ".leader.planted-file.tmp"
    planted_file.write_text("theirs\n")
    names = iter([planted_link, planted_file])
    real = file_module.temp_name
    monkeypatch.setattr(file_module, "temp_name", lambda path: next(names, None) or real(path))
    file_module.write_atomically(state_dir / "leader", b'{"leader": true}')
    assert (state_dir / "leader").read_bytes() == b'{"leader": true}'
    assert victim.read_text() == "precious\n"
    assert planted_file.read_text() == "theirs\n" and planted_link.is_symlink()
    assert (state_dir / "leader").stat().st_mode & 0o777 == 0o644 & ~_umask()


async def test_a_leader_symlink_is_replaced_not_followed(tmp_path, victim):
    (tmp_path / "state" / "leader").symlink_to(victim)
    (state,) = states_for("a")
    lead(state)
    async with publishing(state, tmp_path / "state"):
        assert not (tmp_path / "state" / "leader").is_symlink()
        assert json.loads((tmp_path / "state" / "leader").read_text())["leader"] is True
    assert victim.read_text() == "precious\n"


def _umask() -> int:
    import os

    current = os.umask(0)
    os.umask(current)
    return current


async def test_a_standby_arms_no_timer_and_a_due_first_claim_is_written(tmp_path):
    """Issue 20 (idle CPU): nothing wakes the publisher of a standby; and a term whose
    first claim is not due yet when the elector tells the publisher (a wake-up ended its
    wait early) gets its file when the claim is due, without another word."""
    (state,) = states_for("a")
    async with publishing(state, tmp_path) as publisher:
        assert publisher._timer is None  # a standby: no periodic wake-ups at all
        now = state.clock.monotonic()
        state.update(holding=True, claim_from=now + 0.2, valid_until=now + 10,
                     fencing_token=3)
        await publisher.changed(state)
        assert not (tmp_path / "leader").exists()  # not due yet
        await asyncio.sleep(0.3)
        assert json.loads((tmp_path / "leader").read_text())["fencing_token"] == 3
        state.update(holding=False)
        await publisher.changed(state)
        assert not (tmp_path / "leader").exists()
        await asyncio.sleep(0.2)  # the armed rewrite finds nothing and stops
        assert publisher._timer is None


async def test_rewrites_replace_the_file_whole_and_leave_no_temp_file(tmp_path):
    (state,) = states_for("a")
    async with publishing(state, tmp_path) as publisher:
        lead(state)
        await publisher.changed(state)
        inodes = set()
        for _ in range(3):
            await asyncio.sleep(0.21)  # a rewrite every two thirds of a horizon (200 ms)
            inodes.add((tmp_path / "leader").stat().st_ino)
        assert len(inodes) >= 2  # rewritten by rename, a new file each time
        assert not list(tmp_path.glob(".*.tmp"))


async def test_the_second_name_is_a_link_that_never_follows_what_was_planted(
        tmp_path, victim, monkeypatch):
    """The first lease's two files (``leader`` and its own name) are one write and a hard
    link (issue 20); a name planted where the link would go is skipped, never followed,
    as the temp file's is."""
    from sidecar.publish import file as file_module

    state_dir = tmp_path / "state"
    planted = state_dir / ".a.planted.tmp"
    planted.symlink_to(victim)
    real = file_module.temp_name
    names = iter([None, planted])  # leader's temp name: real; a's: the planted symlink
    monkeypatch.setattr(file_module, "temp_name",
                        lambda path: next(names, None) or real(path))
    (state,) = states_for("a")
    async with publishing(state, state_dir) as publisher:
        lead(state)
        await publisher.changed(state)
        leader, own = state_dir / "leader", state_dir / "a"
        assert leader.read_bytes() == own.read_bytes()
        assert json.loads(own.read_text())["fencing_token"] == 9
        assert not own.is_symlink() and not leader.is_symlink()
        assert leader.stat().st_ino == own.stat().st_ino  # one file, two names
    assert victim.read_text() == "precious\n" and planted.is_symlink()


async def test_a_name_written_before_a_failed_write_is_still_removed(tmp_path):
    """One write replaces both names in turn; when the second fails (here ``leader`` has
    become a directory), the first is on disk and must go when the term ends, even though
    the other name cannot be removed."""
    (state,) = states_for("a")
    publisher = FilePublisher([state], tmp_path)
    await publisher.start()
    try:
        (tmp_path / "leader").mkdir()
        (tmp_path / "leader" / "x").write_text("in the way\n")
        lead(state)
        with pytest.raises(OSError):
            await publisher.changed(state)
        assert json.loads((tmp_path / "a").read_text())["leader"] is True
        state.update(released=True)
        with pytest.raises(IsADirectoryError):  # leader: still in the way, and said so
            await publisher.changed(state)
        assert not (tmp_path / "a").exists()  # removed all the same
        assert not list(tmp_path.glob(".*.tmp"))
    finally:
        (tmp_path / "leader" / "x").unlink()
        (tmp_path / "leader").rmdir()
        await publisher.stop()
