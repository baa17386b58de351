"""Who may ``POST /release``, ``/handover`` and ``/heartbeat``: a process of this pod, never a web
page. All three make a leader step down or keep leading, so all follow the same rules.

Loopback is not always this pod: ``kubectl port-forward`` delivers on 127.0.0.1, and so
do service meshes that redirect inbound traffic through a local proxy, and a pod with
``hostNetwork`` shares the node's loopback. For those, :class:`ControlToken`
(``LEASE_CONTROL_TOKEN_FILE``, opt-in) also asks for a token that only holders of the
file know."""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit


def is_loopback(remote: str | None) -> bool:
    """Only a process in this pod (or on this host) may make us step down."""
    if not remote:
        return False
    try:
        return ipaddress.ip_address(remote.split("%")[0]).is_loopback
    except ValueError:
        return False


def release_hosts(bound_host: str, port: int) -> frozenset[tuple[str, int]]:
    """(host, port) pairs a ``POST /release`` may carry in ``Host``: the loopback forms
    of our port, and the bound address itself unless it is a wildcard."""
    hosts = {"localhost", "127.0.0.1", "::1"}
    if bound_host and bound_host not in ("0.0.0.0", "::"):
        hosts.add(bound_host.lower())
    return frozenset((host, port) for host in hosts)


def host_allowed(header: str | None, allowed: frozenset[tuple[str, int]]) -> bool:
    """``Host`` names this endpoint, not some other name that resolves here (DNS
    rebinding: a web page on ``evil.example`` re-pointed at 127.0.0.1)."""
    if not header:
        return False
    try:
        parts = urlsplit(f"//{header}")
        host, port = parts.hostname, parts.port or 80
    except ValueError:
        return False
    if host is None or parts.username is not None or parts.path:
        return False
    return (host, port) in allowed or (is_loopback(host) and ("127.0.0.1", port) in allowed)


def refusal(remote: str | None, headers: Mapping[str, str],  # lower-case names
            allowed: frozenset[tuple[str, int]], what: str) -> str | None:
    """Why ``what`` is refused to this request (the ``403``'s error), None if it is not.

    Browsers send Origin with every POST, and a page that re-points its own name at
    127.0.0.1 (DNS rebinding) still sends that name as Host.
    """
    if not is_loopback(remote):
        return f"{what} is accepted only from loopback"
    if "origin" in headers:
        return f"{what} is refused to requests with an Origin header"
    if not host_allowed(headers.get("host"), allowed):
        return f"{what} needs Host: localhost or 127.0.0.1 with this endpoint's port"
    return None


class ControlToken:
    """``LEASE_CONTROL_TOKEN_FILE``: the token every control ``POST`` must carry as
    ``Authorization: Bearer <token>``. The file is read on each request, so replacing it
    rotates the token; :meth:`ensure` writes a random one at start if there is none."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def ensure(self) -> None:
        """Create the file with a random token unless it exists (mode 0644 less the
        umask, as the leader file: it shares that file's readers); OSError otherwise."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            self.read()  # there and readable, or the OSError says why not
            return
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")

    def read(self) -> str:
        token = self.path.read_text().strip()
        if not token:
            raise OSError("the file is empty")
        return token

    def refusal(self, headers: Mapping[str, str], what: str) -> str | None:
        """Why ``what`` is refused for want of the token (None: it carries it)."""
        try:
            expected = self.read()
        except OSError as exc:
            return f"{what}: cannot read LEASE_CONTROL_TOKEN_FILE ({exc})"
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), expected.encode()):
            return (f"{what} needs Authorization: Bearer with the token in "
                    f"LEASE_CONTROL_TOKEN_FILE")
        return None
