"""The ``postgres`` shard group's acquire when its caller stops waiting (the manager stops
the electors of shards that move). The lock statement runs on a fake connection here
that lets the test hold the reply back: with a real server the window (granted in the
server, reply not yet read) is a few microseconds wide. The simulator's model of
asyncpg reaches the same window in its random runs (a cancelled statement whose reply
is dropped). And which standby a shard's release wakes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from sidecar.lease.postgres_advisory.group import UNLOCK, AdvisoryShardGroup
from sidecar.lease.postgres_advisory.session import Session
from sidecar.settings import Settings, StoreSettings, Timing
from tests.unit.fakes import FakeClock


@dataclass
class Version:
    major: int = 16
    minor: int = 0


class HeldReplyConnection:
    """Grants every lock statement in the "server" at once, and answers it when the test
    lets it; counts the locks the session holds."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.reply = asyncio.Event()
        self.statements: list[str] = []

    def is_closed(self) -> bool:
        return False

    def get_server_version(self) -> Version:
        return Version()

    def terminate(self) -> None:
        raise AssertionError("the session was dropped")

    async def fetchrow(self, sql: str, *args: Any) -> Any:
        if sql == UNLOCK:
            keys = args[0]
            self.statements.append("unlock" if len(keys) == 1 else f"unlock {len(keys)}")
            self.held.difference_update(keys)
            return True, keys, len(keys)
        if "pg_control_checkpoint" in sql:
            return 1, 3600.0
        keys = args[0]
        self.statements.append("lock" if len(keys) == 1 else f"lock {len(keys)}")
        already = [key for key in keys if key in self.held]
        got = [key for key in keys if key not in self.held]
        self.held.update(got)  # granted in the server before any reply
        await self.reply.wait()
        # ours, already held, granted, counter, timeline, uptime, -, -
        return True, already, got, 7, 1, 3600.0, None, None


def group_on(conn: HeldReplyConnection) -> AdvisoryShardGroup:
    settings = Settings(store=StoreSettings(backend="postgres", dsn="postgresql://h/db"),
                        timing=Timing(), identity="member-a")
    group = AdvisoryShardGroup(settings, FakeClock(), "lease-sidecar.jobs")
    fake: Any = conn  # stands in for asyncpg.Connection
    group._session = Session(conn=fake, marker="m", backend_pid=1, proxied=False)
    return group


async def test_an_acquire_abandoned_after_the_grant_gives_the_lock_back() -> None:
    """Cancelled between the grant and its reply, the acquire left a lock the group did
    not count on its session; the shard's next acquire found it and dropped the session
    with every shard (``terminate`` here)."""
    conn = HeldReplyConnection()
    group = group_on(conn)
    lease = group.lease("jobs-3")
    attempt = asyncio.create_task(lease.try_acquire())
    while "lock" not in conn.statements:
        await asyncio.sleep(0)
    attempt.cancel()
    await asyncio.sleep(0)
    assert attempt.cancelled()
    conn.reply.set()
    while group.releasing:
        await asyncio.sleep(0)
    assert conn.statements == ["lock", "unlock"]
    assert conn.held == set()
    grant = await lease.try_acquire()  # the next acquire: a plain grant, nothing dropped
    assert grant.held and grant.fencing_token is not None
    assert conn.statements == ["lock", "unlock", "lock"]


async def test_an_acquire_abandoned_before_its_turn_sends_nothing() -> None:
    conn = HeldReplyConnection()
    group = group_on(conn)
    async with group._busy:  # another statement has the session
        attempt = asyncio.create_task(group.lease("jobs-3").try_acquire())
        await asyncio.sleep(0)
        attempt.cancel()
        await asyncio.sleep(0)
    while group.releasing:
        await asyncio.sleep(0)
    assert conn.statements == []


async def test_a_shard_whose_unlock_is_still_queued_is_not_locked_again() -> None:
    """The elector bounds a release; the unlock goes on, queued behind the session's
    other statements. An acquire of the same shard meanwhile sent its lock statement
    first, found the lock on the session uncounted, and dropped the session with every
    shard (``terminate`` here): a member of 1,024 shards did that over and over."""
    conn = HeldReplyConnection()
    conn.reply.set()
    group = group_on(conn)
    lease = group.lease("jobs-3")
    assert (await lease.try_acquire()).held
    async with group._busy:  # the heartbeat, say, has the session
        release = asyncio.create_task(lease.release())
        await asyncio.sleep(0)
        release.cancel()  # the elector stops waiting; the unlock stays queued
        async with asyncio.timeout(1):  # before the fix: waits behind the held session
            grant = await lease.try_acquire()
        assert not grant.held and "still in flight" in grant.reason
        assert conn.statements == ["lock"]
    while group.releasing:
        await asyncio.sleep(0)
    assert conn.statements == ["lock", "unlock"]
    assert (await lease.try_acquire()).held
    assert conn.statements == ["lock", "unlock", "lock"]


async def test_a_release_wakes_the_standby_of_its_own_shard_only() -> None:
    """A member waits for hundreds of shards on one channel: the NOTIFY of one shard's
    unlock (its lock id as payload) wakes that shard's standby, not every standby, whose
    lock statements would all queue ahead of the one that can win."""
    group = group_on(HeldReplyConnection())
    mine, other = group.lease("work-1"), group.lease("work-2")
    waiting = asyncio.ensure_future(mine.wait_for_change(30.0))
    await asyncio.sleep(0)
    group._notified(None, 1, "channel", str(other.lock_id))
    group._notified(None, 1, "channel", "not a lock id")
    await asyncio.sleep(0.01)
    assert not waiting.done()
    group._notified(None, 1, "channel", str(mine.lock_id))
    await asyncio.wait_for(waiting, 1.0)
    # A release announced after our last try and before the wait began is not slept
    # through.
    group._notified(None, 1, "channel", str(other.lock_id))
    await asyncio.wait_for(other.wait_for_change(30.0), 1.0)


async def test_acquires_asked_together_share_one_lock_statement() -> None:
    """Members that leave together free dozens of shards for each member that stays. One
    lock statement (a round trip and a durable commit) per shard on the one session made
    the last shard wait for every other's commit: the acquires waiting for their turn now
    go in one statement, and one it no longer waits for is not sent."""
    conn = HeldReplyConnection()
    conn.reply.set()
    group = group_on(conn)
    leases = [group.lease(f"work-{i}") for i in range(5)]
    async with group._busy:  # the heartbeat, say, has the session
        attempts = [asyncio.create_task(lease.try_acquire()) for lease in leases]
        await asyncio.sleep(0)
        attempts[2].cancel()
        await asyncio.sleep(0)
    grants = await asyncio.gather(*attempts[:2], *attempts[3:])
    assert attempts[2].cancelled()
    while group.releasing:
        await asyncio.sleep(0)
    assert conn.statements == ["lock 4"]
    assert all(grant.held for grant in grants)
    assert {grant.fencing_token for grant in grants} == {grants[0].fencing_token}
    assert leases[2].lock_id not in conn.held
    assert conn.held == {lease.lock_id for lease in leases} - {leases[2].lock_id}


async def test_a_failed_lock_statement_fails_every_acquire_it_carried() -> None:
    class Failing(HeldReplyConnection):
        async def fetchrow(self, sql: str, *args: Any) -> Any:
            self.statements.append("lock")
            raise asyncpg.PostgresConnectionError("connection lost")

        def terminate(self) -> None:
            self.statements.append("terminate")

    conn = Failing()
    group = group_on(conn)
    async with group._busy:
        attempts = [asyncio.create_task(group.lease(f"work-{i}").try_acquire())
                    for i in range(3)]
        await asyncio.sleep(0)
    results = await asyncio.gather(*attempts, return_exceptions=True)
    assert [type(r).__name__ for r in results] == ["BackendError"] * 3, results
    assert conn.statements == ["lock", "terminate"]


async def test_releases_asked_together_share_one_unlock_statement() -> None:
    """A member that stops gives every shard back at once: one unlock statement (and its
    NOTIFYs) for all the releases that wait for the session together, not one each."""
    conn = HeldReplyConnection()
    conn.reply.set()
    group = group_on(conn)
    leases = [group.lease(f"work-{i}") for i in range(4)]
    for lease in leases:
        assert (await lease.try_acquire()).held
    async with group._busy:  # the heartbeat, say, has the session
        releases = [asyncio.create_task(lease.release()) for lease in leases]
        await asyncio.sleep(0.01)
    await asyncio.gather(*releases)
    assert conn.statements == ["lock"] * 4 + ["unlock 4"]
    assert conn.held == set()


async def test_a_heartbeat_cut_off_by_its_bound_drops_the_session() -> None:
    """Found by the simulator: after a failover that moved the server's address, the
    group's session sat on a connection whose server was gone without a word. Every
    heartbeat waited out its bound on it and the next one went to the same connection,
    so the member held no shard until TCP gave up, many minutes later. A heartbeat cut
    off by its bound now ends the session; the next round trip opens a new one."""

    class Silent(HeldReplyConnection):
        terminated = False

        async def fetchrow(self, sql: str, *args: Any) -> Any:
            await asyncio.Event().wait()  # no reply, ever

        def terminate(self) -> None:
            self.terminated = True

        def is_closed(self) -> bool:
            return self.terminated

    conn = Silent()
    group = group_on(conn)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await group._round_trip({}, True)
    assert conn.terminated
    assert group._session is None
