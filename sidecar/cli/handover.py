"""``lease-sidecar handover [--to IDENTITY]``: ask the sidecar on this host or pod to
hand its lease over (``POST /handover`` on LEASE_HTTP_ADDR, over loopback).

Exit codes: 0 the leader is handing over; ``EXIT_FAILED`` it is not the leader (or
``--to`` names it), or no sidecar answers; ``EXIT_NO_SUCH_LEASE``.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.parse
import urllib.request

from sidecar.base.errors import EXIT_FAILED, EXIT_NO_SUCH_LEASE
from sidecar.settings import Settings

TIMEOUT = 5.0


def url(settings: Settings, to: str | None) -> str:
    """The loopback form of LEASE_HTTP_ADDR (the endpoint refuses any other caller)."""
    host, port = settings.http_addr
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    query = f"?{urllib.parse.urlencode({'to': to})}" if to else ""
    return f"http://{host}:{port}/handover/{urllib.parse.quote(settings.name, safe='')}{query}"


def run(settings: Settings, to: str | None) -> int:
    target = url(settings, to)
    request = urllib.request.Request(target, method="POST", data=b"")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
            body = json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as exc:
        detail = _error_of(exc)
        print(f"lease-sidecar: handover refused ({exc.code}): {detail}", file=sys.stderr)
        return EXIT_NO_SUCH_LEASE if exc.code == 404 else EXIT_FAILED
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"lease-sidecar: no sidecar answers at {target.split('/handover')[0]} "
              f"(LEASE_HTTP_ADDR / --http-addr): {reason}", file=sys.stderr)
        return EXIT_FAILED
    whom = f" to {body['to']}" if body.get("to") else ""
    print(f"handing over lease {settings.name}{whom}")
    return 0


def _error_of(exc: urllib.error.HTTPError) -> str:
    raw = exc.read() or b""
    try:
        return str(json.loads(raw).get("error") or raw.decode(errors="replace"))
    except (ValueError, AttributeError):
        return raw.decode(errors="replace").strip() or str(exc.reason)
