"""A small Kubernetes API client on aiohttp, for the sidecar process.

The sidecar is injected into every replica, so it must not pay for the ``kubernetes``
package (about 60 MiB of RSS with kopf, 126 MB on disk) to send a handful of JSON requests.
This module is all the sidecar needs: credentials, JSON GET/POST/PUT/PATCH, LIST and
WATCH, and errors as one-line messages. Following an object with watches, the way
client-go's reflector does (backoff, bookmarks, stall checks), is :mod:`sidecar.kubewatch`.

Credentials, one rule (the same as :mod:`sidecar.kube` for the operator): an explicit
``KUBECONFIG`` wins; else, inside a pod (``KUBERNETES_SERVICE_HOST`` set), the mounted
ServiceAccount (token file, CA file, namespace file); else ``~/.kube/config``.
``KUBECONFIG`` may list several files, merged as kubectl merges them (below). A token read
from a file (in-cluster, or a kubeconfig ``tokenFile``) is re-read every
:data:`TOKEN_REREAD` seconds, and any ``401`` (a request's or a watch's) re-reads the
token at once (the kubeconfig's own ``token`` too: a Secret it comes from may have been
updated), so kubelet's rotation of the bound token is followed. Kubeconfig users may use a
token, a token file or a client certificate; ``exec`` and ``auth-provider`` plugins,
basic auth and impersonation are refused with one line naming them.

The connection, as client-go makes it hold up:

- **Watches do not share the calls' connections.** Every watch holds a connection for
  minutes (HTTP/1.1), and one sidecar may follow 64 Leases: watches get a connection each
  (no pool limit; the callers open one per Lease), calls share a few
  (:data:`CALL_CONNECTIONS`: a renew takes milliseconds, 64 Leases renew about 14 times
  a second). :data:`CONNECT_TIMEOUT` counts only the TCP and TLS handshake, never a wait
  for a free connection (the caller's own deadline bounds that).
- **A small TLS read buffer.** asyncio gives every TLS connection a 256 KiB read buffer
  that stays resident (about 300 KiB of RSS a connection, measured); TLS records carry at
  most 16 KiB, so :data:`TLS_READ_BUFFER` does as well: about 60 KiB a connection, what
  makes one more Lease name cheap (``bench/bench_kube_names.py``).
- **Half-open connections** are found by TCP keepalive probes (:data:`KEEPALIVE_IDLE`
  s of silence, then :data:`KEEPALIVE_PROBES` probes :data:`KEEPALIVE_INTERVAL` s apart):
  a peer gone without a FIN or RST (a node lost, a NAT entry dropped) fails the
  connection within about 5 s instead of at the read timeout (aiohttp 3.12 or later,
  whose connector takes a socket factory).
- **``429`` with ``Retry-After``** (the apiserver's priority and fairness) is waited out
  and retried, at most :data:`RETRIES` times and :data:`RETRY_AFTER_MAX` s each; so is a
  GET's ``5xx`` with ``Retry-After``. A longer wait is the caller's: the error carries it.
- **Proxies**: ``HTTPS_PROXY``/``HTTP_PROXY``/``NO_PROXY`` are honoured, and a
  kubeconfig cluster's ``proxy-url`` wins over them (http or https; socks is refused).
- **Big objects**: answers and watch lines up to :data:`MAX_BODY` (a pod can be over a
  MiB of JSON); a watch line is read in pieces, whatever the server's chunking.

Errors: :class:`KubeError` carries the status; its text is one line, e.g.
``forbidden: patch pods t-1/pod-a`` or ``HTTP 409 Conflict: ...``. A watch answered
``410 Gone`` (its resourceVersion is too old) raises :class:`Gone`: the caller relists.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import importlib
import json
import os
import socket
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

if TYPE_CHECKING:
    import aiohttp

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
MERGE_PATCH = "application/merge-patch+json"
# A GET's answer without the object: its metadata only (resourceVersion), whatever its size.
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
CONNECT_TIMEOUT = 3.0  # seconds for TCP + TLS: a dead apiserver must fail a call, not park it
READ_TIMEOUT = 5.0  # seconds of silence within one answer (watches: their own, longer)
TOKEN_REREAD = 60.0  # seconds: kubelet rotates bound tokens well before they expire
USER_AGENT = "lease-sidecar"
KEEPALIVE_IDLE = 2  # seconds of silence before the first TCP keepalive probe
KEEPALIVE_INTERVAL = 1  # seconds between probes
KEEPALIVE_PROBES = 3  # unanswered probes that end the connection
CALL_CONNECTIONS = 4  # connections calls share; watches have one each
TLS_READ_BUFFER = 32 * 1024  # bytes; asyncio's default is 256 KiB a connection
RETRY_AFTER_MAX = 10.0  # seconds: the longest Retry-After a call waits out itself
RETRIES = 3  # Retry-After waits per call
# An answer or watch line larger than this is refused: etcd stores objects up to about
# 1.5 MiB, more as JSON; this only bounds what a broken server can make us buffer.
MAX_BODY = 16 * 1024 * 1024

_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch",
          "DELETE": "delete"}


class KubeError(Exception):
    """An apiserver answer other than 2xx, or no answer; ``status`` 0 for no answer.
    ``retry_after``: the seconds the server asked us to wait, when it did."""

    def __init__(self, message: str, status: int = 0,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


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
    server_hostname: str | None = None  # the kubeconfig's tls-server-name
    proxy: str | None = None  # the kubeconfig's proxy-url (None: the environment's)
    # Reads the kubeconfig's own ``token`` again (after a 401); None: nothing to re-read.
    reload_token: Callable[[], str | None] | None = field(default=None, repr=False)
    _read_at: float = field(default=-float("inf"), repr=False)

    def bearer(self, fresh: bool = False) -> str | None:
        """The token to send; a token file is re-read when due (or when ``fresh``)."""
        if self.token_file is not None and (
                fresh or time.monotonic() - self._read_at >= TOKEN_REREAD):
            with contextlib.suppress(OSError):  # a missing file: keep the last token
                self.token = self.token_file.read_text().strip()
                self._read_at = time.monotonic()
        return self.token

    def refresh(self) -> bool:
        """After a 401: read the token again, from its file or the kubeconfig; True if
        it changed (a request is then worth sending again)."""
        before = self.token
        if self.token_file is not None:
            self.bearer(fresh=True)
        elif self.reload_token is not None:
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                self.token = self.reload_token() or self.token
        return self.token != before


def load_credentials() -> Credentials:
    """By the one rule in the module docstring; ``CredentialsError`` if there are none."""
    try:
        explicit = os.environ.get("KUBECONFIG")
        if explicit or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            paths = kubeconfig_paths(explicit)
            return _from_kubeconfig(paths, f"kubeconfig {explicit or '~/.kube/config'}")
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


def kubeconfig_paths(explicit: str | None) -> list[Path]:
    """The files of ``KUBECONFIG`` in order (empty entries skipped), or the default."""
    if not explicit:
        return [Path("~/.kube/config").expanduser()]
    return [Path(part).expanduser() for part in explicit.split(os.pathsep) if part]


def _load_document(path: Path) -> dict[str, Any]:
    text = path.read_text()
    try:
        doc = json.loads(text)
    except ValueError:
        import yaml  # only kubeconfig files need it; JSON ones do not

        doc = yaml.safe_load(text)
    if doc is None:
        return {}  # an empty file, as kubectl reads it
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a kubeconfig (expected a mapping at the top)")
    return doc


@dataclass(frozen=True)
class _Entry:
    """A named cluster, user or context, and the directory its relative paths are in."""

    value: dict[str, Any]
    base: Path


@dataclass
class Kubeconfig:
    """``KUBECONFIG``'s files merged by kubectl's rules (client-go's ``clientcmd``
    loader): files in order, a missing one skipped; the first file to name a cluster,
    user or context wins that name, the first ``current-context`` set wins; relative
    paths are relative to the file that named the entry."""

    current: str = ""
    sections: dict[str, dict[str, _Entry]] = field(default_factory=lambda: {
        "clusters": {}, "users": {}, "contexts": {}})
    read: list[Path] = field(default_factory=list)

    @classmethod
    def load(cls, paths: list[Path]) -> Kubeconfig:
        merged = cls()
        for path in paths:
            if not path.is_file():
                continue
            doc = _load_document(path)
            merged.read.append(path)
            merged.current = merged.current or str(doc.get("current-context") or "")
            for section, key in (("clusters", "cluster"), ("users", "user"),
                                 ("contexts", "context")):
                items = doc.get(section) or []
                if not isinstance(items, list):
                    raise ValueError(f"{path}: {section} is not a list")
                for item in items:
                    if not isinstance(item, dict) or not item.get("name"):
                        raise ValueError(f"{path}: an entry of {section} has no name")
                    value = item.get(key) or {}
                    if not isinstance(value, dict):
                        raise ValueError(f"{path}: {section} {item['name']!r} is not a mapping")
                    merged.sections[section].setdefault(
                        str(item["name"]), _Entry(value, path.parent))
        if not merged.read:
            raise ValueError(f"no kubeconfig at {os.pathsep.join(map(str, paths))}")
        return merged

    def named(self, section: str, name: str) -> _Entry:
        what = section[:-1]
        if not name:
            raise ValueError(f"the kubeconfig names no {what} (current-context unset?)")
        try:
            return self.sections[section][name]
        except KeyError:
            raise ValueError(f"{what} {name!r} not found in the kubeconfig") from None


# Kubeconfig user fields that would make requests as someone else, or need programs the
# image does not carry: refused by name rather than ignored.
_UNSUPPORTED_USER = {
    "exec": "exec", "auth-provider": "auth-provider", "username": "basic auth (username)",
    "password": "basic auth (password)", "as": "impersonation (as)",
    "as-uid": "impersonation (as-uid)", "as-groups": "impersonation (as-groups)",
    "as-user-extra": "impersonation (as-user-extra)"}


def _from_kubeconfig(paths: list[Path], source: str) -> Credentials:
    config = Kubeconfig.load(paths)
    context = config.named("contexts", config.current).value
    cluster_entry = config.named("clusters", str(context.get("cluster") or ""))
    cluster, base = cluster_entry.value, cluster_entry.base
    user_name = str(context.get("user") or "")
    user_entry = config.named("users", user_name) if user_name else _Entry({}, base)
    user, user_base = user_entry.value, user_entry.base
    for key, what in _UNSUPPORTED_USER.items():
        if user.get(key):
            raise ValueError(f"the kubeconfig user uses {what}, which lease-sidecar does "
                             "not support (use a token, a tokenFile or a client certificate)")
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise ValueError(f"the kubeconfig cluster's server {server!r} is not an http(s) URL")
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
        _load_client_cert(tls, user, user_base)
    proxy = cluster.get("proxy-url") or None
    if proxy is not None and urlsplit(str(proxy)).scheme not in ("http", "https"):
        raise ValueError(f"the kubeconfig's proxy-url {proxy!r} is not an http(s) proxy "
                         "(socks proxies are not supported)")
    creds = Credentials(server, context.get("namespace"), source, tls,
                        insecure=bool(cluster.get("insecure-skip-tls-verify")),
                        server_hostname=cluster.get("tls-server-name") or None,
                        proxy=str(proxy) if proxy else None)
    if user.get("token"):
        creds.token = str(user["token"])

        def reload_token() -> str | None:
            fresh = Kubeconfig.load(paths).named("users", user_name).value
            return str(fresh.get("token") or "") or None

        creds.reload_token = reload_token
    elif user.get("tokenFile"):
        creds.token_file = user_base / user["tokenFile"]
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


def retry_after(headers: Any) -> float | None:
    """``Retry-After`` in seconds (a number or an HTTP date), None if absent or unreadable."""
    value = (headers.get("Retry-After") or "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _small_tls_buffers() -> None:
    """:data:`TLS_READ_BUFFER` for asyncio's TLS connections (see the module docstring):
    a class attribute asyncio reads when it makes each connection. Left alone where it is
    not the 256 KiB this was measured against (another Python may do it otherwise)."""
    import asyncio.sslproto

    protocol = asyncio.sslproto.SSLProtocol
    if getattr(protocol, "max_size", None) == 256 * 1024:
        protocol.max_size = TLS_READ_BUFFER


def _keepalive_socket(addr_info: tuple[Any, ...]) -> socket.socket:
    """A TCP socket that probes a silent peer (see the module docstring); aiohttp's
    ``socket_factory`` (3.12 and later) makes every connection with it."""
    family, type_, proto = addr_info[:3]
    sock = socket.socket(family=family, type=type_, proto=proto)
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the defaults
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    return sock


async def _read_body(response: aiohttp.ClientResponse) -> bytes:
    """The whole answer, refused past :data:`MAX_BODY`."""
    if (response.content_length or 0) > MAX_BODY:
        raise ValueError(f"answer larger than {MAX_BODY // 2**20} MiB")
    chunks, size = [], 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > MAX_BODY:
            raise ValueError(f"answer larger than {MAX_BODY // 2**20} MiB")
        chunks.append(chunk)
    return b"".join(chunks)


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The answer's lines (without the newline), however the server cut them into
    chunks; one longer than :data:`MAX_BODY` is refused. aiohttp's own line reader
    stops at its buffer's size (``LineTooLong``), which a big pod's event exceeds."""
    buffer = bytearray()
    scanned = 0  # bytes of ``buffer`` known to hold no newline
    async for chunk in response.content.iter_any():
        buffer += chunk
        while (end := buffer.find(b"\n", scanned)) >= 0:
            yield bytes(buffer[:end])
            del buffer[:end + 1]
            scanned = 0
        scanned = len(buffer)
        if scanned > MAX_BODY:
            raise ValueError(f"watch event larger than {MAX_BODY // 2**20} MiB")
    # A piece after the last newline is an event cut off: the caller resumes after the
    # last whole one.


class KubeClient:
    """JSON requests to one apiserver; one aiohttp session (made on first use, on the
    running loop). Retries only what the server asks to be retried (``Retry-After``)
    and a 401 once with a re-read token; callers retry anything else on their own
    schedule."""

    def __init__(self, credentials: Credentials, namespace: str) -> None:
        self.credentials = credentials
        self.namespace = namespace
        self._calls: aiohttp.ClientSession | None = None
        self._watches: aiohttp.ClientSession | None = None

    @classmethod
    def connect(cls, namespace: str | None = None) -> KubeClient:
        """Credentials by the one rule; the namespace is ``namespace`` (POD_NAMESPACE)
        if given, else the credentials', else ``default``. Connects on first request."""
        creds = load_credentials()
        return cls(creds, namespace or creds.namespace or "default")

    def _open(self, watch: bool = False) -> aiohttp.ClientSession:
        """The session for calls, or for watches (see the module docstring)."""
        session = self._watches if watch else self._calls
        if session is None or session.closed:
            import aiohttp

            _small_tls_buffers()
            limit = 0 if watch else CALL_CONNECTIONS
            try:
                connector = aiohttp.TCPConnector(ssl=self.credentials.ssl, limit=limit,
                                                 socket_factory=_keepalive_socket)
            except TypeError:  # aiohttp before 3.12: no socket factory, no keepalive
                connector = aiohttp.TCPConnector(ssl=self.credentials.ssl, limit=limit)
            session = aiohttp.ClientSession(
                connector=connector,
                headers={"User-Agent": USER_AGENT, "Accept": "application/json"},
                # The proxy variables, unless the kubeconfig names a proxy of its own.
                trust_env=self.credentials.proxy is None)
            if watch:
                self._watches = session
            else:
                self._calls = session
        return session

    async def close(self) -> None:
        for session in (self._calls, self._watches):
            if session is not None:
                await session.close()
        self._calls = self._watches = None

    def _headers(self, content_type: str | None, accept: str | None = None) -> dict[str, str]:
        headers = {}
        token = self.credentials.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content_type:
            headers["Content-Type"] = content_type
        if accept:
            headers["Accept"] = accept
        return headers

    def _options(self, read_timeout: float, total: float | None) -> dict[str, Any]:
        import aiohttp

        options: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(
            total=total, connect=None, sock_connect=CONNECT_TIMEOUT,
            sock_read=read_timeout)}
        if self.credentials.proxy is not None:
            options["proxy"] = self.credentials.proxy
        if self.credentials.server_hostname is not None:
            options["server_hostname"] = self.credentials.server_hostname
        return options

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json",
                      params: dict[str, str] | None = None,
                      read_timeout: float = READ_TIMEOUT,
                      accept: str | None = None) -> dict[str, Any]:
        """One call with plain JSON in and out; ``KubeError`` on anything but 2xx."""
        await load_aiohttp()
        import aiohttp

        url = self.credentials.server + path + (f"?{urlencode(params)}" if params else "")
        data = None if body is None else json.dumps(body).encode()
        # A slow drip of bytes must not hold a call for ever: the whole answer has a
        # bound too (a MiB-sized pod takes milliseconds on any working link).
        options = self._options(read_timeout, CONNECT_TIMEOUT + 4 * read_timeout)
        refreshed, waits = False, 0
        while True:
            headers = self._headers(content_type if data else None, accept)
            try:
                async with self._open().request(method, url, data=data, headers=headers,
                                                **options) as response:
                    raw = await _read_body(response)
                    status, wait = response.status, retry_after(response.headers)
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                raise KubeError(f"{describe(method, path)}: "
                                f"{one_line(str(exc) or type(exc).__name__)}") from None
            if 200 <= status < 300:
                try:
                    return json.loads(raw) if raw else {}
                except ValueError as exc:
                    raise KubeError(f"{describe(method, path)}: not JSON: "
                                    f"{one_line(str(exc))}") from None
            if status == 401 and not refreshed and self.credentials.refresh():
                refreshed = True  # any 401: read the token again; resend if it changed
                continue
            asked = status == 429 or (status >= 500 and method == "GET")
            if asked and wait is not None and wait <= RETRY_AFTER_MAX and waits < RETRIES:
                waits += 1
                await asyncio.sleep(wait)
                continue
            raise error_for(status, raw, method, path, retry_after=wait)

    async def get(self, path: str, **params: str) -> dict[str, Any]:
        return await self.request("GET", path, params=params or None)

    async def get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def version_of(self, path: str) -> str | None:
        """The ``resourceVersion`` of one object (None: it does not exist), from its
        metadata only: a cheap look whatever the object's size."""
        try:
            found = await self.request("GET", path, accept=METADATA_ONLY)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise
        return str((found.get("metadata") or {}).get("resourceVersion") or "")

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
        ``BOOKMARK`` events are yielded too (their object carries only the
        ``resourceVersion`` to resume from); 410 Gone, in the answer or as an ERROR
        event, raises :class:`Gone`; other failures :class:`KubeError` (a 401 re-reads
        the token first, so the next watch sends the new one).
        """
        await load_aiohttp()
        import aiohttp

        query = {**params, "watch": "true", "timeoutSeconds": str(timeout_seconds),
                 "allowWatchBookmarks": "true"}
        if resource_version:
            query["resourceVersion"] = resource_version
        url = f"{self.credentials.server}{path}?{urlencode(query)}"
        options = self._options(timeout_seconds + 10.0, None)
        what = describe("GET", path, watch=True)
        try:
            async with self._open(watch=True).get(url, headers=self._headers(None),
                                                  **options) as response:
                if response.status != 200:
                    if response.status == 401:
                        self.credentials.refresh()
                    raise error_for(response.status, await _read_body(response), "GET",
                                    path, watch=True,
                                    retry_after=retry_after(response.headers))
                if opened is not None:
                    opened()
                async for line in _lines(response):
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if not isinstance(event, dict):
                        raise ValueError("a watch event that is not a JSON object")
                    kind, obj = event.get("type"), event.get("object") or {}
                    if not isinstance(kind, str) or not isinstance(obj, dict):
                        raise ValueError("a watch event without a type or an object")
                    if kind == "ERROR":
                        raise error_for(int(obj.get("code") or 500), json.dumps(obj).encode(),
                                        "GET", path, watch=True)
                    yield kind, obj
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            raise KubeError(f"{what}: {one_line(str(exc) or type(exc).__name__)}") from None


def error_for(status: int, raw: bytes, method: str, path: str,
              watch: bool = False, retry_after: float | None = None) -> KubeError:
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
    if retry_after is not None:
        text += f" (retry after {retry_after:g}s)"
    return cls(one_line(text), status, retry_after)
