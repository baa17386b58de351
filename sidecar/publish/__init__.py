"""Publishers turn state changes into what the application sees.

Each publisher consumes :class:`~sidecar.state.LeaseState` and nothing else: it never
talks to the backend. The elector calls ``changed`` after every transition and awaits
it (bounded) before releasing a lease, which is what makes "unpublish, then release"
hold for the file and the pod label. The HTTP endpoint needs no call: it reads the
state at request time.

Every channel publishes the same JSON for a claim (:func:`claim_body`): ``GET /leader``,
the leader file, the pod's annotation, ``exec``'s environment and ``/status``.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from sidecar.base.clock import epoch_ms, rfc3339
from sidecar.state import Claim, LeaseState


class Publisher(Protocol):
    async def start(self) -> None: ...

    async def changed(self, state: LeaseState) -> None:
        """Bring the published view of ``state`` up to date (idempotent)."""
        ...

    async def stop(self) -> None: ...


def claim_body(state: LeaseState, claim: Claim,
               until_wall: float | None = None) -> dict[str, Any]:
    """The JSON of ``GET /leader`` and of the leader file."""
    facts = claim.facts
    if until_wall is None:
        until_wall = state.to_wall(claim.valid_until)
    return {
        "leader": claim.leader,
        "lease": state.lease,
        "identity": state.identity,
        "holder": state.identity if claim.leader else facts.holder,
        "fencing_token": facts.fencing_token if claim.leader else None,
        "since": rfc3339(facts.since),
        "valid_until": rfc3339(until_wall),
        # The same instant as Unix milliseconds: easy to compare in a shell.
        "valid_until_ms": epoch_ms(until_wall),
        "role": state.role,
    }


# The body's expiry fields for a wall time of 0, as ``json.dumps`` spells them: where
# :class:`ClaimEncoder` puts each claim's own.
_UNTIL_ZERO = '"valid_until": "1970-01-01T00:00:00.000Z", "valid_until_ms": 0'


class ClaimEncoder:
    """:func:`claim_body` of one lease as JSON bytes, shared by all claims of the same
    millisecond.

    ``/leader`` under load asks many times per millisecond; the body only changes with
    the state version and the (floored) millisecond of ``valid_until``, and later claims
    in that millisecond are valid at least as long as the first.
    """

    def __init__(self, state: LeaseState) -> None:
        self.state = state
        self._key: tuple[int, bool, int | None] | None = None
        self._encoded = b""
        self._template_key: tuple[int, bool] | None = None
        self._template = ("", "")

    def __call__(self, claim: Claim) -> bytes:
        until = self.state.to_wall(claim.valid_until)
        ms = epoch_ms(until)
        key = (claim.facts.version, claim.leader, ms)
        if key != self._key:
            # Only the expiry moves between claims of one version: the rest of the JSON
            # is kept as text around it (the leader file asks six times a second).
            if key[:2] != self._template_key:
                text = json.dumps(claim_body(self.state, claim, 0.0))
                head, found, tail = text.partition(_UNTIL_ZERO)
                assert found, "claim_body() must keep valid_until and valid_until_ms together"
                self._template, self._template_key = (head, tail), key[:2]
            head, tail = self._template
            until_text = "null" if until is None else f'"{rfc3339(until)}"'
            self._encoded = (f'{head}"valid_until": {until_text}, "valid_until_ms": '
                             f'{"null" if ms is None else ms}{tail}').encode()
            self._key = key
        return self._encoded
