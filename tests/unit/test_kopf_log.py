"""kopf's request retries through our JSON logger: one line when the apiserver goes, one
when it is back (issue 19: a 90 s outage gave 34 kopf ERROR lines per sidecar).

kopf's own request function runs against a real loopback port: closed at first (every
attempt fails with "connection refused"), then served by a real aiohttp server.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator

import kopf
import pytest
from aiohttp import web
from kopf._cogs.clients import api, auth

from sidecar.base import jsonlog
from testkit.support import free_port


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """jsonlog.setup as the sidecar does it, writing into a buffer; restored after."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogger("kopf").level,
             logging.getLogger(jsonlog.KOPF_WATCH_LOGGER).level)
    buffer = io.StringIO()
    jsonlog.setup("info")
    root.handlers[0].setStream(buffer)  # type: ignore[attr-defined]  # jsonlog installs a StreamHandler
    try:
        yield buffer
    finally:
        root.handlers[:], level, kopf_level, watch_level = saved
        root.setLevel(level)
        logging.getLogger("kopf").setLevel(kopf_level)
        logging.getLogger(jsonlog.KOPF_WATCH_LOGGER).setLevel(watch_level)


async def _request(port: int, backoffs: list[float]) -> None:
    context = auth.APIContext(kopf.ConnectionInfo(server=f"http://127.0.0.1:{port}"))
    try:
        response = await api.request("GET", "/version", settings=kopf.OperatorSettings(),
                                     backoffs=backoffs, context=context,
                                     logger=logging.getLogger(jsonlog.KOPF_WATCH_LOGGER))
        response.close()
    finally:
        await context.session.close()


async def _serve_after(port: int, delay: float) -> web.AppRunner:
    await asyncio.sleep(delay)
    async def version(request: web.Request) -> web.Response:
        return web.json_response({"major": "1"})

    app = web.Application()
    app.router.add_get("/version", version)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _lines(buffer: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


async def test_an_outage_is_one_line_and_the_recovery_another(log_lines: io.StringIO) -> None:
    port = free_port()
    server = asyncio.create_task(_serve_after(port, 0.5))
    await _request(port, [0.1] * 20)  # ~5 attempts fail before the server is up
    await (await server).cleanup()
    lines = _lines(log_lines)
    assert [(line["level"], line["msg"]) for line in lines] == [
        ("warning", "kubernetes API unreachable (kopf retries; one line until it is back)"),
        ("info", "kubernetes API reachable again (kopf)")]
    assert lines[0]["request"] == f"GET http://127.0.0.1:{port}/version"
    assert "Connect" in str(lines[0]["error"])
    assert isinstance(lines[1]["failures_not_logged"], int)
    assert lines[1]["failures_not_logged"] >= 2


async def test_a_request_that_gives_up_and_the_next_outage(log_lines: io.StringIO) -> None:
    """Escalated (retries exhausted): still one line. A later outage, after kopf's next
    request went through at its first attempt (which kopf does not log), is reported
    again once the quiet period has passed."""
    port = free_port()
    with pytest.raises(Exception, match="Connect"):
        await _request(port, [0.01] * 3)
    assert len(_lines(log_lines)) == 1
    # The filter's quiet period, shortened: the same filter object the handler holds.
    outage = next(f for f in logging.getLogger().handlers[0].filters
                  if isinstance(f, jsonlog.KopfApiOutage))
    outage.quiet = 0.05
    await asyncio.sleep(0.1)
    with pytest.raises(Exception, match="Connect"):
        await _request(port, [0.01] * 3)
    assert [line["msg"] for line in _lines(log_lines)] == [
        "kubernetes API unreachable (kopf retries; one line until it is back)"] * 2


def test_other_kopf_lines_pass_and_debug_stays_out(log_lines: io.StringIO) -> None:
    logging.getLogger("kopf.objects").error("Handler 'x' failed permanently")
    logging.getLogger(jsonlog.KOPF_WATCH_LOGGER).debug("Starting the watch-stream for pods")
    assert [line["msg"] for line in _lines(log_lines)] == ["Handler 'x' failed permanently"]
