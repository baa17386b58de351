"""A stopping member of a shard group hands its shards over once its view of the members
has held still for ``LEAVE_WAIT`` renew intervals, not at the next round trip after that:
with round trips one renew interval apart, a view that last changed at the second round
trip after the stop held still long enough before the third, which came after the bound
(``LEAVE_LIMIT``), so every member leaving with others waited out the bound and logged
that it could not follow the group."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from sidecar.base.clock import SystemClock
from sidecar.settings import Timing
from sidecar.shards import manager as shard_manager
from sidecar.shards.manager import ShardManager
from tests.unit.fakes import ScriptedGroup


def leaving_member(group: Any, timing: Timing) -> ShardManager:
    """A member holding one shard (no elector runs: only its leave is under test)."""
    manager = ShardManager(group, {}, "m3", timing, SystemClock(),
                           make_elector=lambda *_: None)
    manager.owned = lambda: ["work-0"]
    return manager


async def test_a_leaving_member_hands_over_once_its_view_held_still(
        caplog: pytest.LogCaptureFixture) -> None:
    timing = Timing(lease_duration=3.0, renew_interval=0.2, renew_deadline=2.0,
                    safety_margin=0.2, claim_horizon=0.05)
    group = ScriptedGroup("m3")
    manager = leaving_member(group, timing)
    leave = asyncio.ensure_future(manager._leave())
    await group.beats.put(("m0", "m1", "m2", "m4"))  # our record is gone; m4 leaves too
    await asyncio.sleep(timing.renew_interval)
    await group.beats.put(("m0", "m1", "m2"))  # m4's record went at its round trip
    # No more round trips (the next would come after the bound): the view has held
    # still for LEAVE_WAIT renew intervals well before LEAVE_LIMIT.
    with caplog.at_level(logging.WARNING, logger="sidecar.shards"):
        await asyncio.wait_for(leave, shard_manager.LEAVE_LIMIT * timing.renew_interval + 1)
    assert group.advertised == [False]
    assert manager._leaving == ("m0", "m1", "m2")
    assert not [r for r in caplog.records if "could not follow" in r.getMessage()], \
        "the leave waited for the bound instead of handing over once the view held still"
