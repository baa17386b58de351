"""This member's shards as the application sees them: ``GET /shards`` and the file
``{state_dir}/shards``.

Both carry one JSON document: every shard this member leads *now*, each with the claim
of ``GET /leader/{shard}`` (``fencing_token``, ``valid_until``, ``valid_until_ms``: the
same rules, a claim at most one horizon long, computed when asked), and how the group
looks (members, shards assigned to this member). A shard this member holds but does not
claim (its first claim is due, it is being handed over) is not listed: the list is what
the application may work on until each shard's ``valid_until``.

The ETag follows the set of shards led and their tokens, not the claims' expiries, so a
long-poll (``?wait=`` with ``If-None-Match``) sleeps through renews and wakes when a
shard is gained or lost. The electors of the shards tell this publisher of every
transition (:meth:`ShardBoard.changed`); a claim that lapses with no transition (a renew
that hangs until the validity ends) is caught at the claim rule's next boundary.

The file is rewritten every two thirds of a horizon while the member leads a shard (each
entry's ``valid_until`` moves), and once more when it leads none; like the leader file,
an entry counts only until its ``valid_until``: a killed sidecar's file stays on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.base.clock import epoch_ms, rfc3339
from sidecar.publish.file import AtomicFile
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.publish.shards")

# The file of this member's shards in the state directory: no lease may take its name.
SHARDS_FILE = "shards"
# What the group looks like to this member: {"members": n, "assigned": [...], "ok": bool}.
GroupView = Callable[[], dict[str, Any]]


class ShardBoard:
    """This member's shards, for the HTTP endpoint and the shards file."""

    def __init__(self, states: list[LeaseState], identity: str, view: GroupView,
                 path: Path | None = None) -> None:
        self.states = states
        self.identity = identity
        self.view = view
        self._file = AtomicFile(path) if path is not None else None
        self._changed = asyncio.Event()
        horizon = min((s.claim_horizon for s in states), default=math.inf)
        self._period = horizon * 2 / 3
        self._timer: asyncio.TimerHandle | None = None
        self._soon: asyncio.Handle | None = None  # a write due in this turn of the loop

    # -- what it says ------------------------------------------------------------------
    def led(self) -> list[dict[str, Any]]:
        """The shards led now, each with its claim (handed out: it counts for the
        step-down's wait, as every claim does)."""
        found = []
        for state in self.states:
            claim = state.claim()
            if not claim.leader:
                continue
            until = state.to_wall(claim.valid_until)
            found.append({"shard": state.lease, "fencing_token": claim.facts.fencing_token,
                          "valid_until": rfc3339(until), "valid_until_ms": epoch_ms(until)})
        return found

    def body(self) -> tuple[dict[str, Any], str]:
        """The document, and its ETag (of the shards led and their tokens)."""
        shards = self.led()
        view = self.view()
        body = {"identity": self.identity, "shards": shards, "count": len(shards),
                "members": view.get("members", 0), "assigned": view.get("assigned", []),
                "group_ok": view.get("ok", False)}
        return body, self.etag(shards)

    def etag(self, shards: list[dict[str, Any]]) -> str:
        key = json.dumps([self.identity, [(s["shard"], s["fencing_token"]) for s in shards]])
        return f'W/"shards-{hashlib.blake2b(key.encode(), digest_size=8).hexdigest()}"'

    # -- waiting -------------------------------------------------------------------------
    async def wait_for_change(self, seen: str, timeout: float) -> None:
        """Block while the ETag is still ``seen``, at most ``timeout`` seconds: woken by
        the electors' transitions, and at the claim rule's next boundary."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.etag(self.led()) == seen:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            boundary = self._next_flip()
            if boundary is not None:
                remaining = min(remaining, max(0.0, boundary))
            event = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await event.wait()

    def _next_flip(self) -> float | None:
        """Seconds until the first shard's claim rule may flip with no transition."""
        flips = []
        for state in self.states:
            now = state.clock.monotonic()
            flip = state.facts.next_flip(now)
            if flip is not None:
                flips.append(flip - now)
        return min(flips) if flips else None

    # -- Publisher (told by the shards' electors) -------------------------------------
    async def start(self) -> None:
        self._write()

    async def changed(self, state: LeaseState) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        # One write for all the transitions of one turn of the loop: a member taking
        # 1,024 shards wrote the whole document once per shard (a million entries). A
        # later write is safe: the document is computed when written, and a shard
        # stepping down waits out every claim handed out, the file's included.
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self._write)

    async def stop(self) -> None:
        for handle in (self._timer, self._soon):
            if handle is not None:
                handle.cancel()
        self._timer = self._soon = None
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.remove()

    def _write(self) -> None:
        """Write the file now; again in two thirds of a horizon while a shard is led,
        or at the moment a held shard's first claim is due."""
        self._soon = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        body, _ = self.body()
        if self._file is not None:
            try:
                self._file.write(json.dumps(body).encode())
            except OSError as exc:
                log.warning("cannot write the shards file", extra={"error": str(exc)})
        delay = self._period if body["shards"] else self._next_flip()
        if delay is not None:
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, min(delay, self._period)), self._write)
