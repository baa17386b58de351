"""The PostgreSQL token layout and the promotion guard's arithmetic (no server needed)."""

from __future__ import annotations

import asyncio
import math

from sidecar.lease import pg_timeline
from sidecar.lease.pg_timeline import Timelines, checkpoint_age, claim_delay, timeline_of, token


def test_a_later_timeline_outranks_every_counter_of_earlier_ones() -> None:
    assert token(2, 0) > token(1, (1 << 42) - 1) > 10**9  # old plain txids stay smaller
    assert timeline_of(token(7, 123)) == 7 and timeline_of(731) == 0
    assert token(2047, (1 << 42) - 1) == 2**53 - 1  # the largest is JSON-safe


def test_out_of_range_parts_give_no_token() -> None:
    assert token(2048, 1) is None and token(1, 1 << 42) is None and token(0, 5) is None
    assert "docs/high-availability.md" in pg_timeline.OUT_OF_RANGE


def test_age_is_known_only_for_timeline_one_or_a_timeline_seen_before() -> None:
    seen = Timelines()
    assert seen.age(1, 100.0) == math.inf
    assert seen.age(2, 100.0) == 0.0  # never seen: just promoted, as far as we know
    seen.saw(2, 100.0)
    seen.saw(2, 105.0)  # the first sighting counts
    assert seen.age(2, 108.0) == 8.0
    assert claim_delay(10.0, 8.0) == 2.0 and claim_delay(10.0, math.inf) == 0.0


def test_checkpoint_evidence_counts_only_on_the_same_timeline() -> None:
    async def on(row: tuple) -> float:
        async def ask() -> tuple:
            return row
        return await checkpoint_age(ask, 3, "here")

    async def forbidden() -> tuple:
        raise PermissionError("permission denied for function pg_control_checkpoint")

    assert asyncio.run(on((3, 30.5))) == 29.5  # stored in whole seconds: one less
    assert asyncio.run(on((2, 300.0))) == 0.0  # taken before the promotion
    assert asyncio.run(checkpoint_age(forbidden, 3, "here")) == 0.0
