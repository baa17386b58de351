"""``GET /leader``: the claim as of now, or — with ``?wait=SECONDS`` and
``If-None-Match`` — as of the next change of leadership, parked until then.

The ETag follows leadership only (leader, holder, fencing token, role), not renews, so
an idle leader's waiters sleep through renews (:meth:`LeaseState.leadership_tag`).
"""

from __future__ import annotations

from aiohttp import web

from sidecar.publish.http.limits import LIMITS, RETRY_AFTER, Limits
from sidecar.state import Claim, LeaseState

MAX_WAIT = 300.0

# The app's lease states by name, first lease first (``/leader`` without a name).
STATES = web.AppKey("states", dict)


def etag(state: LeaseState, claim: Claim | None = None) -> str:
    """Follows leadership only (leader, holder, fencing token, role), not renews."""
    return state.leadership_tag(claim or state.claim())


def wait_seconds(request: web.Request) -> float:
    raw = request.query.get("wait")
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        raise web.HTTPBadRequest(text="wait must be a number of seconds\n") from None
    if not 0 <= seconds <= MAX_WAIT:
        raise web.HTTPBadRequest(text=f"wait must be between 0 and {MAX_WAIT:g}\n")
    return seconds


def no_such_lease(name: str | None) -> web.HTTPNotFound:
    return web.HTTPNotFound(text=f"no lease named {name!r}\n")


async def leader(request: web.Request) -> web.Response:
    """200 with the claim while leading, else 503 (the same JSON body)."""
    states: dict[str, LeaseState] = request.app[STATES]
    name = request.match_info.get("name")
    state = states.get(name) if name else next(iter(states.values()))
    if state is None:
        raise no_such_lease(name)
    # The hot path: skip query parsing when there is no query string.
    wait = wait_seconds(request) if request.query_string else 0.0
    headers = {"ETag": ""}
    if wait:
        seen = request.headers.get("If-None-Match")
        current = etag(state)
        # Weak comparison (RFC 9110 for If-None-Match): a client that drops the W/ of
        # the tag it echoes still parks.
        if seen is None or seen.removeprefix("W/") == current.removeprefix("W/"):
            limits: Limits = request.app[LIMITS]
            if limits.waiters >= limits.max_waiters:
                # Full: answer now with what a query without wait gets. The claim is
                # computed below, like any other, so it is never a made-up answer.
                limits.waits_refused += 1
                headers["Lease-Wait"] = "full"
                headers["Retry-After"] = str(RETRY_AFTER)
            else:
                limits.waiters += 1
                try:
                    await state.wait_for_leadership_change(current, wait)
                finally:
                    limits.waiters -= 1
    claim = state.claim()
    headers["ETag"] = etag(state, claim)
    return web.Response(body=state.encoded(claim), status=200 if claim.leader else 503,
                        headers=headers, content_type="application/json")
