"""A real aiohttp server on a free loopback port, for unit tests that need a real peer."""

from __future__ import annotations

from aiohttp import web


async def serve_on_loopback(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on 127.0.0.1 (a port the kernel picks); its runner (``cleanup()``
    stops it) and its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"
