"""A small Kubernetes API client on aiohttp, for the sidecar process.

The sidecar is injected into every replica, so it must not pay for the ``kubernetes``
package (about 60 MiB of RSS with kopf, 126 MB on disk) to send a handful of JSON requests.
This module is all the sidecar needs: credentials, JSON GET/POST/PUT/PATCH, LIST and
WATCH, and errors as one-line messages.

Credentials, one rule (the same as :mod:`sidecar.kube` for the operator): an explicit
``KUBECONFIG`` wins; else, inside a pod (``KUBERNETES_SERVICE_HOST`` set), the mounted
ServiceAccount (token file, CA file, namespace file); else ``~/.kube/config``. A token read
from a file (in-cluster, or a kubeconfig ``tokenFile``) is re-read every
:data:`TOKEN_REREAD` seconds and at once after a 401, so kubelet's rotation of the bound
token is followed. Kubeconfig users may use a token, a token file or a client certificate;
``exec`` and ``auth-provider`` plugins are refused with a clear message (they would run
programs the sidecar image does not carry).

Errors: :class:`KubeError` carries the status; its text is one line, e.g.
``forbidden: patch pods t-1/pod-a`` or ``HTTP 409 Conflict: ...``. A watch answered
``410 Gone`` (its resourceVersion is too old) raises :class:`Gone`: the caller relists.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import importlib
import json
import os
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

if TYPE_CHECKING:
    import aiohttp

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"
CONNECT_TIMEOUT = 3.0  # seconds: a dead apiserver must fail a call, not park it
READ_TIMEOUT = 5.0  # seconds for one answer (watches: their own, longer)
TOKEN_REREAD = 60.0  # seconds: kubelet rotates bound tokens well before they expire
USER_AGENT = "lease-sidecar"

_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch",
          "DELETE": "delete"}


class KubeError(Exception):
    """An apiserver answer other than 2xx, or no answer; ``status`` 0 for no answer."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Gone(KubeError):
    """410: the watch's resourceVersion is too old; list again."""


class CredentialsError(KubeError):
    """No usable credentials (a setting problem, not an outage)."""


def one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return (text[:limit] + "…") if len(text) > limit else text


def describe(method: str, path: str, watch: bool = False) -> str:
    """``<verb> <resource> [<namespace>/]<name>`` for a request path, for error lines:
    ``PATCH /api/v1/namespaces/t/pods/a`` → ``patch pods t/a``."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    parts = parts[2:] if parts[:1] == ["api"] else parts[3:]  # drop api/v1, apis/g/v
    namespace = ""
    if parts[:1] == ["namespaces"] and len(parts) >= 3:
        namespace, parts = parts[1], parts[2:]
    resource = parts[0] if parts else "?"
    name = "/".join(parts[1:])
    verb = "watch" if watch else ("list" if method == "GET" and not name
                                  else _VERBS.get(method, method.lower()))
    where = "/".join(x for x in (namespace, name) if x)
    return f"{verb} {resource} {where}".strip() if where else f"{verb} {resource}"


# --------------------------------------------------------------------- credentials


@dataclass
class Credentials:
    server: str
    namespace: str | None  # the one the credentials name (kubeconfig context / SA file)
    source: str  # "kubeconfig <path>" or "in-cluster", for logs
    ssl: ssl.SSLContext | bool
    token: str | None = None
    token_file: Path | None = None
    insecure: bool = False  # insecure-skip-tls-verify: the apiserver is not authenticated
    _read_at: float = field(default=-float("inf"), repr=False)

    def bearer(self, fresh: bool = False) -> str | None:
        """The token to send; a token file is re-read when due (or when ``fresh``)."""
        if self.token_file is not None and (
                fresh or time.monotonic() - self._read_at >= TOKEN_REREAD):
            with contextlib.suppress(OSError):  # a missing file: keep the last token
                self.token = self.token_file.read_text().strip()
                self._read_at = time.monotonic()
        return self.token


def load_credentials() -> Credentials:
    """By the one rule in the module docstring; ``CredentialsError`` if there are none."""
    try:
        explicit = os.environ.get("KUBECONFIG")
        if explicit or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            path = explicit.split(os.pathsep)[0] if explicit else "~/.kube/config"
            return _from_kubeconfig(Path(path).expanduser(),
                                    f"kubeconfig {explicit or '~/.kube/config'}")
        return _in_cluster()
    except CredentialsError:
        raise
    except (OSError, ValueError, KeyError, TypeError, ssl.SSLError) as exc:
        raise CredentialsError(
            f"kubernetes: no usable credentials (KUBECONFIG or in-cluster): "
            f"{one_line(str(exc) or type(exc).__name__)}") from None


def _in_cluster() -> Credentials:
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    token_file = SERVICE_ACCOUNT_DIR / "token"
    if not token_file.exists():
        raise CredentialsError(
            f"kubernetes: no usable credentials (KUBECONFIG or in-cluster): "
            f"no ServiceAccount token at {token_file} (the pod mounts no ServiceAccount "
            f"token: automountServiceAccountToken false?)")
    context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT_DIR / "ca.crt"))
    namespace_file = SERVICE_ACCOUNT_DIR / "namespace"
    namespace = namespace_file.read_text().strip() if namespace_file.exists() else None
    creds = Credentials(f"https://{host}:{port}", namespace or None, "in-cluster", context,
                        token_file=token_file)
    creds.bearer(fresh=True)
    return creds


def _load_document(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"no kubeconfig at {path}")
    text = path.read_text()
    try:
        doc = json.loads(text)
    except ValueError:
        import yaml  # only kubeconfig files need it; JSON ones do not

        doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a kubeconfig (expected a mapping at the top)")
    return doc


def _named(items: list[dict[str, Any]] | None, name: str, what: str) -> dict[str, Any]:
    for item in items or []:
        if item.get("name") == name:
            return item.get(what) or {}
    raise ValueError(f"{what} {name!r} not found in the kubeconfig")


def _from_kubeconfig(path: Path, source: str) -> Credentials:
    doc = _load_document(path)
    context = _named(doc.get("contexts"), doc.get("current-context") or "", "context")
    cluster = _named(doc.get("clusters"), context["cluster"], "cluster")
    user = _named(doc.get("users"), context.get("user") or "", "user") if context.get(
        "user") else {}
    base = path.parent
    for plugin in ("exec", "auth-provider"):
        if user.get(plugin):
            raise ValueError(f"the kubeconfig user uses {plugin}, which lease-sidecar does "
                             "not support (use a token, a tokenFile or a client certificate)")
    server = cluster["server"].rstrip("/")
    tls: ssl.SSLContext | bool = False
    if server.startswith("https://"):
        if cluster.get("insecure-skip-tls-verify"):
            tls = ssl.create_default_context()
            tls.check_hostname = False
            tls.verify_mode = ssl.CERT_NONE
        elif cluster.get("certificate-authority-data"):
            tls = ssl.create_default_context(cadata=base64.b64decode(
                cluster["certificate-authority-data"]).decode())
        elif cluster.get("certificate-authority"):
            tls = ssl.create_default_context(cafile=str(base / cluster["certificate-authority"]))
        else:
            tls = ssl.create_default_context()
        if cluster.get("tls-server-name"):
            raise ValueError("tls-server-name in the kubeconfig is not supported")
        _load_client_cert(tls, user, base)
    creds = Credentials(server, context.get("namespace"), source, tls,
                        insecure=bool(cluster.get("insecure-skip-tls-verify")))
    if user.get("token"):
        creds.token = user["token"]
    elif user.get("tokenFile"):
        creds.token_file = base / user["tokenFile"]
        creds.bearer(fresh=True)
    return creds


def _load_client_cert(tls: ssl.SSLContext, user: dict[str, Any], base: Path) -> None:
    """Present the kubeconfig's client certificate; inline data goes through a private
    temporary directory because ``ssl`` loads certificate chains only from files."""
    if user.get("client-certificate"):
        tls.load_cert_chain(str(base / user["client-certificate"]),
                            str(base / user["client-key"]))
    elif user.get("client-certificate-data"):
        with tempfile.TemporaryDirectory() as private:
            cert, key = Path(private) / "c.pem", Path(private) / "k.pem"
            cert.write_bytes(base64.b64decode(user["client-certificate-data"]))
            key.touch(0o600)
            key.write_bytes(base64.b64decode(user["client-key-data"]))
            tls.load_cert_chain(str(cert), str(key))


# --------------------------------------------------------------------- the client


async def load_aiohttp() -> None:
    """Import aiohttp in a thread before its first use: its import is most of a process
    start (about 200 ms of CPU), and meanwhile the event loop keeps answering ``/healthz``
    and ``/leader`` (the HTTP endpoint is h11's, :mod:`sidecar.publish.http`). Every user
    of aiohttp in the sidecar process awaits this first; ``import aiohttp`` in a function
    is then a dictionary look-up. Two callers at once: the second thread waits on the
    first one's import lock, not the loop."""
    global _aiohttp_loaded
    if not _aiohttp_loaded:
        await asyncio.to_thread(importlib.import_module, "aiohttp")
        _aiohttp_loaded = True


_aiohttp_loaded = False


class KubeClient:
    """JSON requests to one apiserver; one aiohttp session (made on first use, on the
    running loop); no retries (callers retry on their own schedule)."""

    def __init__(self, credentials: Credentials, namespace: str) -> None:
        self.credentials = credentials
        self.namespace = namespace
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def connect(cls, namespace: str | None = None) -> KubeClient:
        """Credentials by the one rule; the namespace is ``namespace`` (POD_NAMESPACE)
        if given, else the credentials', else ``default``. Connects on first request."""
        creds = load_credentials()
        return cls(creds, namespace or creds.namespace or "default")

    def _open(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self.credentials.ssl, limit=8),
                headers={"User-Agent": USER_AGENT, "Accept": "application/json"})
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, fresh: bool, content_type: str | None) -> dict[str, str]:
        headers = {}
        token = self.credentials.bearer(fresh)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json",
                      params: dict[str, str] | None = None,
                      read_timeout: float = READ_TIMEOUT) -> dict[str, Any]:
        """One call with plain JSON in and out; ``KubeError`` on anything but 2xx."""
        await load_aiohttp()
        import aiohttp

        url = self.credentials.server + path + (f"?{urlencode(params)}" if params else "")
        data = None if body is None else json.dumps(body).encode()
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT,
                                        sock_connect=CONNECT_TIMEOUT, sock_read=read_timeout)
        for attempt in (0, 1):  # a 401 is tried once more with a freshly read token
            headers = self._headers(attempt == 1, content_type if data else None)
            try:
                async with self._open().request(method, url, data=data, headers=headers,
                                                timeout=timeout) as response:
                    raw = await response.read()
                    if response.status == 401 and attempt == 0 and (
                            self.credentials.token_file is not None):
                        continue
                    if 200 <= response.status < 300:
                        return json.loads(raw) if raw else {}
                    raise error_for(response.status, raw, method, path)
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                raise KubeError(f"{describe(method, path)}: "
                                f"{one_line(str(exc) or type(exc).__name__)}") from None
        raise AssertionError("unreachable")

    async def get(self, path: str, **params: str) -> dict[str, Any]:
        return await self.request("GET", path, params=params or None)

    async def get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def post(self, path: str, body: Any) -> dict[str, Any]:
        return await self.request("POST", path, body)

    async def put(self, path: str, body: Any) -> dict[str, Any]:
        return await self.request("PUT", path, body)

    async def patch(self, path: str, body: Any, content_type: str = MERGE_PATCH
                    ) -> dict[str, Any]:
        return await self.request("PATCH", path, body, content_type=content_type)

    async def list(self, path: str, **params: str) -> dict[str, Any]:
        """A collection (``items`` and ``metadata.resourceVersion``)."""
        return await self.request("GET", path, params=params or None)

    async def watch(self, path: str, resource_version: str | None = None,
                    timeout_seconds: int = 60, opened: Callable[[], None] | None = None,
                    **params: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield ``(type, object)`` for each event of one watch request on collection
        ``path``, from ``resource_version`` (None: the current state, replayed as ADDED)
        until the apiserver ends the request after ``timeout_seconds``. ``opened`` is
        called once the apiserver accepted the request (events may take long to come).
        ``BOOKMARK`` events are not yielded; 410 Gone, in the answer or as an ERROR
        event, raises :class:`Gone`; other failures :class:`KubeError`.
        """
        await load_aiohttp()
        import aiohttp

        query = {**params, "watch": "true", "timeoutSeconds": str(timeout_seconds),
                 "allowWatchBookmarks": "true"}
        if resource_version:
            query["resourceVersion"] = resource_version
        url = f"{self.credentials.server}{path}?{urlencode(query)}"
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT,
                                        sock_connect=CONNECT_TIMEOUT,
                                        sock_read=timeout_seconds + 10)
        what = describe("GET", path, watch=True)
        try:
            async with self._open().get(url, headers=self._headers(False, None),
                                        timeout=timeout) as response:
                if response.status != 200:
                    raise error_for(response.status, await response.read(), "GET", path,
                                    watch=True)
                if opened is not None:
                    opened()
                async for line in response.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        raise error_for(int(obj.get("code") or 500), json.dumps(obj).encode(),
                                        "GET", path, watch=True)
                    if kind != "BOOKMARK":
                        yield kind, obj
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            raise KubeError(f"{what}: {one_line(str(exc) or type(exc).__name__)}") from None


def error_for(status: int, raw: bytes, method: str, path: str,
              watch: bool = False) -> KubeError:
    """One line for a non-2xx answer: forbidden names the verb and resource."""
    what = describe(method, path, watch)
    message = ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        message = json.loads(raw).get("message") or ""
    if status == 403:
        return KubeError(f"forbidden: {what}", status)
    if status == 401:
        return KubeError(f"unauthorized: {what} (token expired or not accepted)", status)
    cls = Gone if status == 410 else KubeError
    text = f"{what}: HTTP {status}" + (f": {message}" if message else "")
    return cls(one_line(text), status)

