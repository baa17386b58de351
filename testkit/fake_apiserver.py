"""A misbehaving apiserver, for the tests of the sidecar's own Kubernetes client
(:mod:`sidecar.kubeapi`, :mod:`sidecar.kubewatch`): aiohttp.web on 127.0.0.1, plain HTTP,
on an event loop in a thread of its own, so in-process clients and real sidecar
processes can both talk to it.

Why a fake at all: the real kube-apiserver of the test bed (``testkit/testbed/kube.py``)
behaves well. It cannot be made to close every watch at once, stall a watch while
objects change, answer ``410`` or ``429`` on demand, or cut its lines into slow pieces,
which is what a struggling or broken apiserver (or a proxy in front of one) does. What
the client does against the real one is tested there.

It serves Leases and Pods (any namespace) from memory, as far as the sidecar uses them:
GET (also metadata only, ``as=PartialObjectMetadata``), LIST, POST, PUT guarded by
``resourceVersion`` (``409``), merge PATCH, and watches of one object by
``fieldSelector=metadata.name=…`` with ``resourceVersion`` resume and bookmarks. Every
request is recorded (:attr:`FakeApiserver.requests`). The misbehaviours, switched on and
off by the test at any time:

- ``close_watches``: every watch is answered ``200`` and ended at once;
- ``stall_watches``: new watches are answered and then sent nothing; open ones stop
  sending (the events are lost, as on a stream that stalled);
- ``gone_watches``: every watch is answered ``410 Gone`` as an ERROR event;
- :meth:`throttle`: the next requests are answered ``429`` with ``Retry-After``;
- ``piece_size`` / ``piece_delay``: each watch line is written in pieces of that many
  bytes with that delay between them (slow and partial lines);
- ``bookmark_every``: a BOOKMARK every that many seconds on each watch that asked;
- :meth:`put_pod` with ``padding``: a pod object as big as you like (1 MiB and more);
- ``tokens``: the bearer tokens accepted (others get ``401``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
PODS = "/api/v1/namespaces/{ns}/pods"
KINDS = {"leases": ("Lease", "coordination.k8s.io/v1"), "pods": ("Pod", "v1")}


@dataclass
class Seen:
    """One request as it arrived."""

    at: float  # time.monotonic()
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    host: str = ""

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


@dataclass
class _Watcher:
    collection: str
    name: str | None
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


class FakeApiserver:
    """Start with :meth:`start` (or ``with``); :attr:`url` is its address."""

    def __init__(self, tokens: set[str] | None = None) -> None:
        self.tokens = {"fake-token"} if tokens is None else tokens
        self.requests: list[Seen] = []
        self.close_watches = False
        self.stall_watches = False
        self.gone_watches = False
        self.piece_size = 0
        self.piece_delay = 0.0
        self.bookmark_every: float | None = None
        self._throttled: list[float] = []  # Retry-After of the next throttled answers
        self._objects: dict[str, dict[str, Any]] = {}  # object path -> object
        self._history: list[tuple[int, str, dict[str, Any]]] = []  # (rev, type, object)
        self._revision = 100
        self._watchers: list[_Watcher] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # -- life ------------------------------------------------------------------------
    def start(self) -> FakeApiserver:
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application(middlewares=[self._record], client_max_size=64 * 2**20)
            app.router.add_route("*", "/{path:.*}", self._handle)
            self._runner = web.AppRunner(app, handle_signals=False, access_log=None)
            loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="fake-apiserver", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fake apiserver did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._call(self._end_watches)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> FakeApiserver:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def kubeconfig(self, path: Path, namespace: str = "default", token: str = "fake-token",
                   server: str | None = None, **cluster: Any) -> Path:
        """A kubeconfig for this server (``server`` instead of its URL: to reach it
        through a proxy)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": server or self.url,
                                                      **cluster}}],
            "users": [{"name": "fake", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                      "namespace": namespace}}]}))
        return path

    # -- what tests do ---------------------------------------------------------------
    def throttle(self, count: int, retry_after: float) -> None:
        """Answer the next ``count`` requests ``429`` with ``Retry-After: retry_after``."""
        with self._lock:
            self._throttled.extend([retry_after] * count)

    def put_pod(self, namespace: str, name: str, ready: bool,
                containers: tuple[str, ...] = ("app",), padding: int = 0) -> None:
        """Create or replace a pod whose containers are all Ready or not; ``padding``
        bytes of annotation make it as big as wanted."""
        pod: dict[str, Any] = {
            "metadata": {"name": name, "namespace": namespace,
                         "annotations": {"padding": "x" * padding} if padding else {}},
            "spec": {"containers": [{"name": c, "image": "app"} for c in containers]},
            "status": {"containerStatuses": [{"name": c, "ready": ready}
                                             for c in containers]}}
        self._call(lambda: self._store(PODS.format(ns=namespace) + f"/{name}", pod))

    def delete(self, path: str) -> None:
        """Delete an object (its watchers get DELETED)."""
        self._call(lambda: self._remove(path))

    def end_watches(self) -> None:
        """End every open watch, as the apiserver does at their timeout."""
        self._call(self._end_watches)

    def get(self, path: str) -> dict[str, Any] | None:
        """An object as stored (a copy), or None."""
        return self._call(lambda: copy.deepcopy(self._objects.get(path)))

    def watches(self, since: float = 0.0, path: str | None = None) -> list[Seen]:
        """The watch requests that arrived after monotonic ``since`` (on ``path``)."""
        return [r for r in list(self.requests) if r.watch and r.at >= since
                and (path is None or r.path == path)]

    def calls(self, since: float = 0.0, method: str | None = None) -> list[Seen]:
        return [r for r in list(self.requests) if not r.watch and r.at >= since
                and (method is None or r.method == method)]

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the server's loop and return its result."""
        assert self._loop is not None
        done: asyncio.Future[T] = asyncio.run_coroutine_threadsafe(_value(fn), self._loop)
        return done.result(10)

    # -- the server ------------------------------------------------------------------
    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append(Seen(time.monotonic(), request.method, request.path,
                                  dict(request.query),
                                  {k.lower(): v for k, v in request.headers.items()},
                                  request.headers.get("Host", "")))
        with self._lock:
            wait = self._throttled.pop(0) if self._throttled else None
        if wait is not None:
            return _status(429, "TooManyRequests", "too many requests",
                           {"Retry-After": f"{wait:g}"})
        if self.tokens and request.headers.get("Authorization", "").removeprefix(
                "Bearer ") not in self.tokens:
            return _status(401, "Unauthorized", "Unauthorized")
        response: web.StreamResponse = await handler(request)
        return response

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        # /api/v1/namespaces/NS/RES[/NAME]  or  /apis/G/V/namespaces/NS/RES[/NAME]
        rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
        if len(rest) < 3 or rest[0] != "namespaces" or rest[2] not in KINDS:
            return _status(404, "NotFound", "no such resource")
        namespace, resource = rest[1], rest[2]
        collection = "/" + "/".join(parts[:len(parts) - len(rest) + 3])
        name = rest[3] if len(rest) > 3 else None
        if request.method == "GET" and name is None:
            if request.query.get("watch") in ("true", "1"):
                return await self._watch(request, collection)
            return self._list(collection, resource)
        path = f"{collection}/{name}" if name else collection
        if request.method == "GET" and name:
            found = self._objects.get(path)
            if found is None:
                return _status(404, "NotFound", f'{resource} "{name}" not found')
            if "as=PartialObjectMetadata" in request.headers.get("Accept", ""):
                return web.json_response({"kind": "PartialObjectMetadata",
                                          "apiVersion": "meta.k8s.io/v1",
                                          "metadata": found["metadata"]})
            return web.json_response(found)
        body = await request.json() if request.can_read_body else {}
        if request.method == "POST" and name is None:
            name = (body.get("metadata") or {}).get("name") or ""
            path = f"{collection}/{name}"
            if path in self._objects:
                return _status(409, "AlreadyExists", f'{resource} "{name}" already exists')
            return web.json_response(self._store(path, body, namespace, resource), status=201)
        if request.method == "PUT" and name:
            current = self._objects.get(path)
            wanted = (body.get("metadata") or {}).get("resourceVersion")
            if current is None:
                return _status(404, "NotFound", f'{resource} "{name}" not found')
            if wanted and wanted != current["metadata"]["resourceVersion"]:
                return _status(409, "Conflict", "the object has been modified")
            return web.json_response(self._store(path, body, namespace, resource))
        if request.method == "PATCH" and name:
            current = self._objects.get(path)
            if current is None:
                return _status(404, "NotFound", f'{resource} "{name}" not found')
            return web.json_response(self._store(path, _merge(copy.deepcopy(current), body),
                                                 namespace, resource))
        return _status(405, "MethodNotAllowed", "not here")

    def _list(self, collection: str, resource: str) -> web.Response:
        items = [obj for path, obj in self._objects.items()
                 if path.rsplit("/", 1)[0] == collection]
        kind, api = KINDS[resource]
        return web.json_response({"kind": f"{kind}List", "apiVersion": api, "items": items,
                                  "metadata": {"resourceVersion": str(self._revision)}})

    def _store(self, path: str, obj: dict[str, Any], namespace: str | None = None,
               resource: str | None = None) -> dict[str, Any]:
        collection, name = path.rsplit("/", 1)
        resource = resource or collection.rsplit("/", 1)[1]
        kind, api = KINDS[resource]
        current = self._objects.get(path)
        self._revision += 1
        obj = copy.deepcopy(obj)
        obj.update(kind=kind, apiVersion=api)
        meta = obj.setdefault("metadata", {})
        meta.update(name=name, namespace=namespace or collection.split("/")[-2],
                    resourceVersion=str(self._revision))
        if current is None:
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=datetime.now(UTC).strftime(
                "%Y-%m-%dT%H:%M:%SZ"))
        else:
            for key in ("uid", "creationTimestamp"):
                meta[key] = current["metadata"][key]
        self._objects[path] = obj
        self._event("MODIFIED" if current else "ADDED", collection, obj)
        return obj

    def _remove(self, path: str) -> None:
        obj = self._objects.pop(path)
        self._revision += 1
        obj["metadata"]["resourceVersion"] = str(self._revision)
        self._event("DELETED", path.rsplit("/", 1)[0], obj)

    def _event(self, kind: str, collection: str, obj: dict[str, Any]) -> None:
        event = {"type": kind, "object": obj}
        self._history.append((self._revision, collection, event))
        for watcher in self._watchers:
            if watcher.collection == collection and watcher.name in (
                    None, obj["metadata"]["name"]):
                watcher.queue.put_nowait(event)

    def _end_watches(self) -> None:
        for watcher in self._watchers:
            watcher.queue.put_nowait(None)

    async def _watch(self, request: web.Request, collection: str) -> web.StreamResponse:
        name = None
        selector = request.query.get("fieldSelector", "")
        if selector.startswith("metadata.name="):
            name = selector.split("=", 1)[1]
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if self.close_watches:
            await response.write_eof()
            return response
        if self.gone_watches:
            await self._send(response, {"type": "ERROR", "object": {
                "kind": "Status", "status": "Failure", "code": 410, "reason": "Expired",
                "message": "too old resource version"}})
            await response.write_eof()
            return response
        watcher = _Watcher(collection, name)
        version = request.query.get("resourceVersion")
        if version:
            for rev, where, event in self._history:
                if rev > int(version) and where == collection and name in (
                        None, event["object"]["metadata"]["name"]):
                    watcher.queue.put_nowait(event)
        else:
            for path, obj in self._objects.items():
                if path.rsplit("/", 1)[0] == collection and name in (
                        None, obj["metadata"]["name"]):
                    watcher.queue.put_nowait({"type": "ADDED", "object": obj})
        self._watchers.append(watcher)
        ends = time.monotonic() + float(request.query.get("timeoutSeconds") or 1800)
        bookmarks = request.query.get("allowWatchBookmarks") == "true"
        try:
            while (left := ends - time.monotonic()) > 0:
                wait = left if self.bookmark_every is None or not bookmarks else min(
                    left, self.bookmark_every)
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    if bookmarks and self.bookmark_every is not None and not (
                            self.stall_watches):
                        await self._send(response, {"type": "BOOKMARK", "object": {
                            "kind": KINDS[collection.rsplit("/", 1)[1]][0],
                            "metadata": {"resourceVersion": str(self._revision)}}})
                    continue
                if event is None:
                    break
                if not self.stall_watches:
                    await self._send(response, event)
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.remove(watcher)
        return response

    async def _send(self, response: web.StreamResponse, event: dict[str, Any]) -> None:
        line = json.dumps(event).encode() + b"\n"
        if not self.piece_size:
            await response.write(line)
            return
        for start in range(0, len(line), self.piece_size):
            await response.write(line[start:start + self.piece_size])
            await asyncio.sleep(self.piece_delay)


async def _value(fn: Callable[[], T]) -> T:
    return fn()


def _status(code: int, reason: str, message: str,
            headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                              "code": code, "reason": reason, "message": message},
                             status=code, headers=headers)


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = value
    return target
