"""A model of the apiserver's Lease objects, reached through a fake ``KubeClient``: the seam
the ``kubernetes`` backend talks through (:mod:`sidecar.lease.kubernetes.transport`).

What the model keeps, as the apiserver (with etcd) does:

- a ``resourceVersion`` for every write, from one counter that only grows (etcd's
  revision), ``uid`` and ``creationTimestamp`` (whole seconds, the server's wall clock)
  per object, create-on-update, and the preconditions a write carries (its
  ``resourceVersion`` and ``uid``: ``409`` when either is stale, ``404`` when the object
  is gone);
- the validation a hand edit must pass (``leaseDurationSeconds`` > 0,
  ``leaseTransitions`` ≥ 0, MicroTimes that parse), and ``spec.preferredHolder`` dropped
  as a server without the CoordinatedLeaderElection gate drops it;
- watches by name: the current object first (no ``resourceVersion``) or the events after
  one, bookmarks, the end after ``timeoutSeconds``, ``410 Gone`` for a version older than
  the compacted history; and the ways they go wrong: a watch that stalls (open, silent),
  lags, or breaks;
- writes by anyone: a person (``kubectl edit``, ``apply`` of a saved manifest,
  ``delete``, a tool that re-creates the object with an empty spec) writes any field a
  person can write, and a write the validation refuses does not happen.

It leaves out authentication (the real client's own tests cover it), other kinds of
object, and field managers.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sidecar.kubeapi import Gone, KubeError
from testkit.sim.world import Endpoint, Host, Reply, World

# The real client's bounds on one call (sidecar.kubeapi): a read that hears nothing this
# long fails.
READ_TIMEOUT = 5.0
BOOKMARK_EVERY = 60.0  # seconds between bookmarks on an idle watch (about the apiserver's)
HISTORY = 200  # events kept for watches; older versions answer 410 Gone

Event = tuple[str, dict[str, Any]]


class Refused(Exception):
    """The apiserver's answer other than 2xx: ``status`` and a message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Watch:
    name: str
    endpoint: Endpoint | None
    queue: asyncio.Queue[Event | None]
    ends_at: float
    stalled: bool = False
    lag: float = 0.0
    closed: bool = False
    held: list[Event] = field(default_factory=list)  # events a stall holds back


class ApiServer:
    def __init__(self, world: World, namespace: str = "sim") -> None:
        self.world = world
        self.namespace = namespace
        self.host = Host("apiserver", offset=world.rng.uniform(-2.0, 2.0))
        self.revision = world.rng.randrange(10_000, 1_000_000)
        self.objects: dict[str, dict[str, Any]] = {}
        self.history: deque[tuple[int, Event]] = deque(maxlen=HISTORY)
        self.watches: list[Watch] = []
        self.up = True
        self._uids = 0

    # -- time ---------------------------------------------------------------------------
    def stamp(self) -> str:
        """``creationTimestamp``: RFC 3339, whole seconds, the server's clock."""
        wall = math.floor(self.host.wall(self.world.now()))
        return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    # -- the API ------------------------------------------------------------------------
    def get(self, name: str) -> dict[str, Any]:
        obj = self.objects.get(name)
        if obj is None:
            raise Refused(404, f'leases.coordination.k8s.io "{name}" not found')
        return _copy(obj)

    def create(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if name in self.objects:
            raise Refused(409, f'leases.coordination.k8s.io "{name}" already exists')
        obj = _copy(body)
        metadata = obj.setdefault("metadata", {})
        self._uids += 1
        metadata.update(name=name, namespace=self.namespace, uid=f"uid-{self._uids}",
                        creationTimestamp=self.stamp())
        metadata.pop("resourceVersion", None)
        return self._store(name, obj, "ADDED")

    def update(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        current = self.objects.get(name)
        metadata = body.get("metadata") or {}
        if current is None:
            if metadata.get("resourceVersion") or metadata.get("uid"):
                raise Refused(404, f'leases.coordination.k8s.io "{name}" not found')
            return self.create(name, body)  # Leases allow create-on-update
        wanted = metadata.get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            raise Refused(409, "the object has been modified; please apply your changes to "
                               "the latest version and try again")
        uid = metadata.get("uid")
        if uid and uid != current["metadata"]["uid"]:
            raise Refused(409, "Precondition failed: UID in precondition does not match")
        obj = _copy(body)
        for kept in ("uid", "creationTimestamp", "namespace", "name"):
            obj["metadata"][kept] = current["metadata"][kept]
        return self._store(name, obj, "MODIFIED")

    def delete(self, name: str) -> None:
        obj = self.objects.pop(name, None)
        if obj is None:
            return
        self.revision += 1
        gone = _copy(obj)
        gone["metadata"]["resourceVersion"] = str(self.revision)
        self._emit(name, ("DELETED", gone))

    def _store(self, name: str, obj: dict[str, Any], kind: str) -> dict[str, Any]:
        _validate(obj)
        spec = obj.get("spec") or {}
        # Without the CoordinatedLeaderElection gate the server drops the field.
        spec.pop("preferredHolder", None)
        spec.pop("strategy", None)
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        self.objects[name] = obj
        self._emit(name, (kind, _copy(obj)))
        return _copy(obj)

    # -- watches ------------------------------------------------------------------------
    def _emit(self, name: str, event: Event) -> None:
        self.history.append((self.revision, event))
        for watch in list(self.watches):
            if watch.name == name:
                self._send(watch, event)

    def _send(self, watch: Watch, event: Event) -> None:
        if watch.closed:
            return
        if watch.stalled:
            watch.held.append(event)
            return
        endpoint = watch.endpoint
        if endpoint is not None and endpoint.dead:
            return
        if endpoint is not None and endpoint.partitioned:
            # TCP holds the stream's bytes while the network is cut and delivers them
            # once it is back.
            if not watch.held:
                self.world.later(0.5, self._flush, watch)
            watch.held.append(event)
            return
        self.world.later(self.world.latency(endpoint) + watch.lag, _put, watch, event)

    def _flush(self, watch: Watch) -> None:
        endpoint = watch.endpoint
        if watch.closed or watch.stalled:
            return
        if endpoint is not None and endpoint.partitioned:
            self.world.later(0.5, self._flush, watch)
            return
        held, watch.held = watch.held, []
        for event in held:
            self._send(watch, event)

    def open_watch(self, name: str, since: str | None, endpoint: Endpoint | None,
                   seconds: float) -> Watch:
        if since is not None and since.isdigit():
            oldest = self.history[0][0] if self.history else self.revision
            if int(since) < oldest - 1 and int(since) < self.revision:
                raise Refused(410, "too old resource version")
        watch = Watch(name, endpoint, asyncio.Queue(), self.world.now() + seconds)
        self.watches.append(watch)
        if since is None:
            obj = self.objects.get(name)
            if obj is not None:
                self._send(watch, ("ADDED", _copy(obj)))
        else:
            for revision, event in self.history:
                if revision > int(since) and event[1]["metadata"]["name"] == name:
                    self._send(watch, event)
        self.world.later(seconds, self.end_watch, watch)
        self._bookmark_later(watch)
        return watch

    def _bookmark_later(self, watch: Watch) -> None:
        def bookmark() -> None:
            if watch.closed:
                return
            self._send(watch, ("BOOKMARK", {"metadata": {"resourceVersion": str(self.revision)}}))
            self._bookmark_later(watch)
        self.world.later(BOOKMARK_EVERY * self.world.rng.uniform(0.5, 1.0), bookmark)

    def end_watch(self, watch: Watch) -> None:
        if watch.closed:
            return
        watch.closed = True
        if watch in self.watches:
            self.watches.remove(watch)
        self.world.later(self.world.latency(watch.endpoint), _put, watch, None)

    # -- faults -------------------------------------------------------------------------
    def stall(self, watch: Watch, seconds: float) -> None:
        watch.stalled = True

        def resume() -> None:
            watch.stalled = False
            self._flush(watch)
        self.world.later(seconds, resume)

    def compact(self) -> None:
        """etcd compacts its history: every version before now is gone (410)."""
        self.history.clear()

    # -- what a person does ----------------------------------------------------------
    def edit(self, name: str, change: Callable[[dict[str, Any]], None]) -> bool:
        """``kubectl edit``: apply ``change`` to the current object; False if the object
        is missing or the apiserver refused the result."""
        current = self.objects.get(name)
        if current is None:
            return False
        obj = _copy(current)
        change(obj)
        try:
            self.update(name, obj)
        except Refused:
            return False
        return True

    def client_gone(self, endpoint: Endpoint) -> None:
        for watch in list(self.watches):
            if watch.endpoint is endpoint:
                watch.closed = True
                self.watches.remove(watch)

    def cut(self, endpoint: Endpoint) -> None:
        pass  # the watch's events are dropped while cut (``_send``); requests too


def _put(watch: Watch, event: Event | None) -> None:
    watch.queue.put_nowait(event)


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(obj))


def _validate(obj: dict[str, Any]) -> None:
    spec = obj.get("spec") or {}
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not isinstance(duration, int) or duration <= 0):
        raise Refused(422, "spec.leaseDurationSeconds: must be greater than 0")
    transitions = spec.get("leaseTransitions")
    if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
        raise Refused(422, "spec.leaseTransitions: must be greater than or equal to 0")
    for key in ("acquireTime", "renewTime"):
        stamp = spec.get(key)
        if stamp is not None:
            try:
                parsed = datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
            except ValueError:
                raise Refused(422, f"spec.{key}: not a MicroTime") from None
            if parsed.tzinfo is None:
                raise Refused(422, f"spec.{key}: not a MicroTime")
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    if not all(isinstance(v, str) for v in annotations.values()):
        raise Refused(422, "metadata.annotations: values must be strings")


# -- the fake client ------------------------------------------------------------------------
@dataclass
class _Credentials:
    source: str = "simulation"
    insecure: bool = False
    server: str = "https://apiserver.sim"


class FakeKubeClient:
    """What :mod:`sidecar.lease.kubernetes.transport` uses of ``sidecar.kubeapi.KubeClient``,
    over the simulated network to :class:`ApiServer`."""

    def __init__(self, server: ApiServer, endpoint: Endpoint | None) -> None:
        self._server = server
        self._world = server.world
        self._endpoint = endpoint
        self.namespace = server.namespace
        self.credentials = _Credentials()

    def _name(self, path: str) -> str:
        return path.rstrip("/").rsplit("/", 1)[-1]

    async def _call(self, what: str, action: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        server = self._server

        def at_server(reply: Reply) -> None:
            if not server.up:
                reply(None, KubeError(f"{what}: Cannot connect to host apiserver.sim "
                                      "[Connection refused]"))
                return
            try:
                value = action()
            except Refused as exc:
                error = Gone if exc.status == 410 else KubeError
                reply(None, error(f"{what}: HTTP {exc.status}: {exc}", exc.status))
                return
            reply(value, None)

        self._world.deliver(self._endpoint, at_server, future)
        try:
            async with asyncio.timeout(READ_TIMEOUT):
                return await future
        except TimeoutError:
            raise KubeError(f"{what}: TimeoutError") from None

    async def get_or_none(self, path: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await self._call(
                "get leases", lambda: self._server.get(self._name(path)))
            return result
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def version_of(self, path: str) -> str | None:
        found = await self.get_or_none(path)
        return None if found is None else str(found["metadata"]["resourceVersion"])

    async def post(self, path: str, body: Any) -> dict[str, Any]:
        name = body["metadata"]["name"]
        result: dict[str, Any] = await self._call(
            "create leases", lambda: self._server.create(name, _copy(body)))
        return result

    async def put(self, path: str, body: Any) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "update leases", lambda: self._server.update(self._name(path), _copy(body)))
        return result

    async def list(self, path: str, **params: str) -> dict[str, Any]:
        # labelSelector: the equality form (key=value, comma-separated), the one used.
        wanted = dict(term.split("=", 1) for term in
                      params.get("labelSelector", "").split(",") if term)

        def matching() -> dict[str, Any]:
            return {"items": [_copy(o) for o in self._server.objects.values()
                              if all((o["metadata"].get("labels") or {}).get(k) == v
                                     for k, v in wanted.items())]}
        result: dict[str, Any] = await self._call("list leases", matching)
        return result

    async def watch(self, path: str, resource_version: str | None = None,
                    timeout_seconds: int = 60, opened: Callable[[], None] | None = None,
                    **params: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        name = params.get("fieldSelector", "").removeprefix("metadata.name=")
        server = self._server
        endpoint = self._endpoint
        watch: Watch = await self._call(
            "watch leases", lambda: server.open_watch(name, resource_version, endpoint,
                                                      timeout_seconds))
        if opened is not None:
            opened()
        try:
            while True:
                event = await watch.queue.get()
                if event is None:
                    return
                yield event[0], _copy(event[1])
        finally:
            server.end_watch(watch)

    async def close(self) -> None:
        return None


def fake_client_class(server: ApiServer,
                      endpoint_of: Callable[[], Endpoint | None]) -> Any:
    """A stand-in for ``KubeClient`` in the transport module: ``connect`` reaches the
    model."""

    class Client(FakeKubeClient):
        @classmethod
        def connect(cls, namespace: str | None = None) -> FakeKubeClient:
            return FakeKubeClient(server, endpoint_of())

    return Client


__all__ = ["ApiServer", "FakeKubeClient", "Gone", "copy", "fake_client_class"]
