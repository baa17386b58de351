"""``lease-sidecar handover [--to IDENTITY]``: ask the sidecar on this host or pod to
hand its lease over (``POST /handover`` on LEASE_HTTP_ADDR, over loopback, with the
token of LEASE_CONTROL_TOKEN_FILE where one is set).

Exit codes: 0 the leader is handing over; ``EXIT_FAILED`` refused (not the leader,
``--to`` names it or a pod that cannot lead, a hand-over already under way), or no
sidecar answers; ``EXIT_NO_SUCH_LEASE``.
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
    headers = {}
    if settings.control_token_file:
        try:
            with open(settings.control_token_file) as token:
                headers["Authorization"] = f"Bearer {token.read().strip()}"
        except OSError as exc:
            print(f"lease-sidecar: LEASE_CONTROL_TOKEN_FILE / --control-token-file: "
                  f"{settings.control_token_file}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_FAILED
    request = urllib.request.Request(target, method="POST", data=b"", headers=headers)
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
    checked = f" ({body['checked']})" if body.get("checked") else ""
    print(f"handing over lease {settings.name}{whom}{checked}")
    return 0


def _error_of(exc: urllib.error.HTTPError) -> str:
    raw = exc.read() or b""
    try:
        return str(json.loads(raw).get("error") or raw.decode(errors="replace"))
    except (ValueError, AttributeError):
        return raw.decode(errors="replace").strip() or str(exc.reason)
