"""The long-poll (``GET /leader?wait=``) of real ``lease-sidecar`` processes follows
leadership, not renews.

Two sidecars on one SQLite file renew every 100 ms, so a waiter woken by renews would
return within a tenth of a second; here a parked query on an idle leader or standby
returns only at its ``wait``, and wakes at once when the answer changes: a release, a
SIGTERM, a lease taken away in the file, a renew that hangs until the validity runs
out, and a standby's first claim. Each wait is bounded.
"""

from __future__ import annotations

import re
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from testkit.support import (
    Answer,
    SidecarProcess,
    get_json,
    long_poll,
    one_leader,
    serving,
    unix_time,
    wait_until,
)

VALIDITY = 1.7  # lease duration 2 s minus safety margin 300 ms
FAST = ["--lease-duration", "2s", "--renew-interval", "100ms", "--renew-deadline", "1500ms",
        "--safety-margin", "300ms", "--claim-horizon", "100ms"]
# Far beyond every wake-up expected here: an answer before it is a wake-up, not a timeout.
LONG = 30.0
# Generous for a loaded 2-core machine; bench/bench_longpoll.py measures the real figures.
PROMPT = 1.0


def current(proc: SidecarProcess) -> Answer:
    return long_poll(proc.url, None, 0)


def renews(proc: SidecarProcess) -> float:
    text = get_json(proc.url + "/metrics")[1]
    found = re.search(r'^lease_sidecar_renew_duration_seconds_count\{lease="default",'
                      r'outcome="held"\} (\S+)$', text, re.M)
    assert found, text[:500]
    return float(found.group(1))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[SidecarProcess, SidecarProcess, Path]]:
    db = tmp_path / "leases.db"
    procs = [SidecarProcess(tmp_path, f"node-{i}", args=["--dsn", str(db), *FAST])
             for i in range(2)]
    with serving(procs):
        leader = wait_until(lambda: one_leader(procs), timeout=10)
        standby = next(p for p in procs if p is not leader)
        wait_until(lambda: current(standby).body["holder"] == leader.identity, timeout=5)
        yield leader, standby, db


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


def park(pool: ThreadPoolExecutor, proc: SidecarProcess, wait: float = LONG
         ) -> tuple[Answer, Future[Answer]]:
    """The current answer, and a blocking query parked with its tag."""
    now = current(proc)
    return now, pool.submit(long_poll, proc.url, now.tag, wait)


def follow_until_leader(proc: SidecarProcess, first: Answer, limit: int = 5) -> list[Answer]:
    """Re-park with each new tag until the answer is 200; every answer must come early."""
    answers = [first]
    while answers[-1].status != 200 and len(answers) <= limit:
        answers.append(long_poll(proc.url, answers[-1].tag, LONG))
    assert answers[-1].status == 200, [(a.status, a.body) for a in answers]
    assert all(a.waited < LONG / 2 for a in answers), [a.waited for a in answers]
    return answers


def assert_first_claim_answered_at_once(answers: list[Answer]) -> None:
    """The 200 came as the claim began: at ``since`` (the acquire), as the standby took
    over a release on record (no horizon to wait)."""
    first_claim = unix_time(answers[-1].body["since"])
    assert answers[-1].returned_wall >= first_claim - 0.01
    assert answers[-1].returned_wall - first_claim < PROMPT


def test_renews_do_not_wake_a_parked_query(pair, pool) -> None:
    leader, standby, _ = pair
    before = renews(leader)
    (lead_now, lead_wait), (stand_now, stand_wait) = park(pool, leader, 3), park(pool, standby, 3)
    lead, stand = lead_wait.result(15), stand_wait.result(15)
    renewed = renews(leader) - before
    assert renewed >= 10, renewed  # ~30 renews at 100 ms, each one a state change
    for now, answer, status in ((lead_now, lead, 200), (stand_now, stand, 503)):
        assert answer.status == status
        assert 2.95 <= answer.waited < 6, answer.waited  # the wait, not a renew, ended it
        assert answer.tag == now.tag
    # The body is fresh all the same: a claim valid from now on, not the parked one's.
    assert lead.body["valid_until_ms"] > lead_now.body["valid_until_ms"]
    assert lead.body["valid_until_ms"] >= lead.returned_wall * 1000 - 50
    # If-None-Match as before: a stale tag answers at once, the current one parks.
    stale = long_poll(leader.url, 'W/"default-0000000000000000"', LONG)
    assert stale.status == 200 and stale.waited < PROMPT
    assert long_poll(leader.url, lead.tag, 0.5).waited >= 0.45


def test_release_wakes_the_leader_and_the_standby_becomes_leader(pair, pool) -> None:
    leader, standby, _ = pair
    (_, lead_wait), (_, stand_wait) = park(pool, leader), park(pool, standby)
    time.sleep(0.3)  # parked through three renews
    assert not lead_wait.done() and not stand_wait.done()
    asked = time.monotonic()
    assert leader.release() == 202
    lead = lead_wait.result(LONG)
    assert lead.status == 503 and lead.returned - asked < PROMPT
    assert lead.body["leader"] is False
    answers = follow_until_leader(standby, stand_wait.result(LONG))
    assert answers[-1].body["holder"] == standby.identity
    assert_first_claim_answered_at_once(answers)


def test_sigterm_wakes_the_leader_and_the_standby_becomes_leader(pair, pool) -> None:
    leader, standby, _ = pair
    (_, lead_wait), (_, stand_wait) = park(pool, leader), park(pool, standby)
    time.sleep(0.3)
    assert not lead_wait.done() and not stand_wait.done()
    asked = time.monotonic()
    leader.signal(signal.SIGTERM)
    lead = lead_wait.result(LONG)
    assert lead.status == 503 and lead.returned - asked < PROMPT
    assert leader.proc is not None and leader.proc.wait(10) == 0
    assert_first_claim_answered_at_once(follow_until_leader(standby, stand_wait.result(LONG)))


def test_a_lease_taken_away_wakes_the_leader(pair, pool) -> None:
    """Another owner written into the file: the next renew is refused (a real loss)."""
    leader, standby, db = pair
    (_, lead_wait), (_, stand_wait) = park(pool, leader), park(pool, standby)
    time.sleep(0.3)
    with sqlite3.connect(db, timeout=5) as conn:
        changed = conn.execute(
            "UPDATE leases SET owner = 'thief', expires_at = expires_at + 30 "
            "WHERE name = 'lease-sidecar.default'").rowcount
    taken = time.monotonic()
    assert changed == 1
    lead = lead_wait.result(LONG)
    assert lead.status == 503 and lead.returned - taken < PROMPT
    stand = stand_wait.result(LONG)  # the standby's answer changed too: a new holder
    assert stand.status == 503 and stand.returned - taken < PROMPT
    assert stand.body["holder"] == "thief"


def test_a_renew_that_hangs_until_validity_runs_out_wakes_the_leader(pair, pool) -> None:
    """A write lock held on the file: renews hang, nothing is decided, the claim lapses."""
    leader, _, db = pair
    _, lead_wait = park(pool, leader)
    time.sleep(0.3)
    conn = sqlite3.connect(db, timeout=5, isolation_level=None, check_same_thread=False)
    unlock = threading.Timer(VALIDITY + 2.0, conn.rollback)
    try:
        conn.execute("BEGIN IMMEDIATE")
        locked = time.monotonic()
        unlock.start()
        lead = lead_wait.result(LONG)
        assert lead.status == 503
        # Within one validity of the lock (the last renew came before it), while the
        # lock still holds every renew and acquire back.
        assert lead.returned - locked < VALIDITY + 0.3, lead.returned - locked
        assert lead.returned - locked < VALIDITY + 2.0
    finally:
        unlock.join()
        conn.close()
