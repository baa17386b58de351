"""``GET /shards``: this member's shards as of now, or — with ``?wait=SECONDS`` and
``If-None-Match`` — as of the next change of the shards it leads, parked until then
(the rules of ``GET /leader``'s long-poll, :mod:`.longpoll`; the document and its ETag:
:mod:`sidecar.publish.shards`). Always ``200``: an empty list is an answer."""

from __future__ import annotations

import json

from sidecar.publish.http.limits import Limits
from sidecar.publish.http.longpoll import wait_seconds
from sidecar.publish.http.server import Request, Response
from sidecar.publish.shards import ShardBoard


async def shards(request: Request, board: ShardBoard, limits: Limits) -> Response:
    wait = wait_seconds(request) if request.query_string else 0.0
    headers: dict[str, str] = {}
    if wait:
        seen = request.headers.get("if-none-match")
        _, current = board.body()
        if seen is None or seen.removeprefix("W/") == current.removeprefix("W/"):
            await limits.park(lambda: board.wait_for_change(current, wait), headers)
    body, tag = board.body()
    headers["ETag"] = tag
    return Response(json.dumps(body).encode(), 200, headers)
