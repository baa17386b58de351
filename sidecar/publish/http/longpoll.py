"""``GET /leader``: the claim as of now, or — with ``?wait=SECONDS`` and
``If-None-Match`` — as of the next change of leadership, parked until then.

The ETag follows leadership only (leader, holder, fencing token, role), not renews, so
an idle leader's waiters sleep through renews (:meth:`LeaseState.leadership`).
"""

from __future__ import annotations

import hashlib
import json

from sidecar.publish import ClaimEncoder
from sidecar.publish.http.limits import Limits
from sidecar.publish.http.server import HttpError, Request, Response
from sidecar.state import Claim, Facts, Leadership, LeaseState

MAX_WAIT = 300.0


class ServedLease:
    """One lease as ``GET /leader`` serves it: its state, its body's bytes and its ETag."""

    def __init__(self, state: LeaseState) -> None:
        self.state = state
        self.encoded = ClaimEncoder(state)
        self._key: Leadership | None = None
        self._facts: Facts | None = None
        self._leader: bool | None = None
        self._tag = ""

    def etag(self, claim: Claim) -> str:
        """A weak ETag of :meth:`LeaseState.leadership`: the body's bytes change with
        every claim (``valid_until``), what it says does not. Derived from the content,
        not from a counter, so it means the same answer across restarts of the sidecar."""
        # The hot path of GET /leader: facts are replaced whole, so the same facts
        # object and leader flag give the same tag without building the key.
        if claim.facts is self._facts and claim.leader is self._leader:
            return self._tag
        key = self.state.leadership(claim)
        if key != self._key:
            digest = hashlib.blake2b(json.dumps(key).encode(), digest_size=8).hexdigest()
            self._tag = f'W/"{self.state.lease}-{digest}"'
            self._key = key
        self._facts, self._leader = claim.facts, claim.leader
        return self._tag


def wait_seconds(request: Request) -> float:
    raw = request.query.get("wait")
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        raise HttpError(400, "wait must be a number of seconds\n") from None
    if not 0 <= seconds <= MAX_WAIT:
        raise HttpError(400, f"wait must be between 0 and {MAX_WAIT:g}\n")
    return seconds


def no_such_lease(name: str | None) -> HttpError:
    return HttpError(404, f"no lease named {name!r}\n")


async def leader(request: Request, leases: dict[str, ServedLease], limits: Limits) -> Response:
    """200 with the claim while leading, else 503 (the same JSON body). ``leases``: by
    name, first lease first (``/leader`` without a name)."""
    name = request.name
    served = leases.get(name) if name else next(iter(leases.values()))
    if served is None:
        raise no_such_lease(name)
    state = served.state
    # The hot path: skip query parsing when there is no query string.
    wait = wait_seconds(request) if request.query_string else 0.0
    headers = {"ETag": ""}
    if wait:
        seen = request.headers.get("if-none-match")
        arrival = state.claim()
        current = served.etag(arrival)
        # Weak comparison (RFC 9110 for If-None-Match): a client that drops the W/ of
        # the tag it echoes still parks.
        if seen is None or seen.removeprefix("W/") == current.removeprefix("W/"):
            # Full: answered now; the claim is computed below, like any other.
            await limits.park(lambda: state.wait_for_leadership_change(
                state.leadership(arrival), wait), headers)
    claim = state.claim()
    headers["ETag"] = served.etag(claim)
    return Response(served.encoded(claim), 200 if claim.leader else 503, headers)
