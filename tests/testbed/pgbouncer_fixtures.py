"""pytest fixtures for a real PgBouncer (see :mod:`testkit.testbed.pgbouncer`).

Registered in tests/conftest.py. ``pgbouncer`` (function) is a factory: call it with a
``pool_mode`` and a ``pool_size`` to get a started :class:`PgBouncer` in front of the
session's PostgreSQL (``pg``); every pooler a test started is stopped when it ends.

A missing ``pgbouncer`` binary FAILS the test instead of skipping it, like the
PostgreSQL fixtures: CI must never go green without touching the real pooler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from testkit.testbed.pgbouncer import PgBouncer, PgBouncerError
from testkit.testbed.postgres import PgServer

StartBouncer = Callable[..., PgBouncer]


@pytest.fixture
def pgbouncer(pg: PgServer) -> Iterator[StartBouncer]:
    started: list[PgBouncer] = []

    def start(pool_mode: str = "transaction", pool_size: int = 1,
              **extra: str) -> PgBouncer:
        try:
            bouncer = PgBouncer(pg, pool_mode=pool_mode, pool_size=pool_size, extra=extra)
        except PgBouncerError as exc:
            pytest.fail(f"pgbouncer test bed: {exc}", pytrace=False)
        started.append(bouncer)
        try:
            return bouncer.start()
        except PgBouncerError as exc:
            pytest.fail(f"pgbouncer test bed: did not start:\n{exc}", pytrace=False)

    yield start
    for bouncer in started:
        bouncer.destroy()
