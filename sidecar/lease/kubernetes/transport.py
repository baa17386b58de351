"""Talking to the apiserver about Lease objects without blocking the event loop.

The official ``kubernetes`` client is synchronous; every call runs in a worker thread with
a request timeout, so the event loop never blocks and a hung apiserver fails a call
instead of parking it. A watch runs in a daemon thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from sidecar.errors import BackendError, Forbidden
from sidecar.kube import REQUEST_TIMEOUT, KubeAccess, connect, one_line, request
from sidecar.lease.kubernetes.record import Record
from sidecar.settings import Settings

log = logging.getLogger("sidecar.lease.kubernetes")

T = TypeVar("T")

# A watch request ends after this many seconds and is re-opened; re-opening without a
# resourceVersion replays the current object, so a missed event heals within one period.
WATCH_SECONDS = 60
WATCH_RETRY_MAX = 5.0


class Conflict(Exception):
    """A write found the object other than we based it on: 409 (somebody else wrote
    first, or it already exists) or 404 (it was deleted)."""


class LeaseWatch:
    """A daemon thread that watches one Lease and hands every record to ``deliver``."""

    def __init__(self, access: KubeAccess, name: str,
                 deliver: Callable[[Record | None], None]) -> None:
        self._api = client.CoordinationV1Api(access.api)
        self._namespace = access.namespace
        self._name = name
        self._deliver = deliver
        self._stopped = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"lease-watch-{name}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            with contextlib.suppress(Exception):
                self._watch.stop()

    def _run(self) -> None:
        delay = 0.2
        while not self._stopped.is_set():
            self._watch = watch.Watch()
            try:
                for event in self._watch.stream(
                        self._api.list_namespaced_lease, self._namespace,
                        field_selector=f"metadata.name={self._name}",
                        timeout_seconds=WATCH_SECONDS, deserialize=False,
                        _request_timeout=(REQUEST_TIMEOUT[0], WATCH_SECONDS + 10)):
                    if self._stopped.is_set():
                        return
                    kind = event.get("type")
                    if kind in ("ADDED", "MODIFIED"):
                        self._deliver(Record.from_object(event["object"]))
                    elif kind == "DELETED":
                        self._deliver(None)
                delay = 0.2
            except Exception as exc:
                # The elector's own reads report unreachability; here we only retry.
                log.debug("lease watch failed", extra={"lease": self._name,
                                                       "error": one_line(exc)})
                self._stopped.wait(delay)
                delay = min(delay * 2, WATCH_RETRY_MAX)


class LeaseApi:
    """The Lease calls of one namespace, each run in a worker thread and mapped to our
    errors: ``Conflict`` for a lost race, ``BackendError`` for anything else."""

    def __init__(self, access: KubeAccess, pool: ThreadPoolExecutor) -> None:
        self.access = access
        self.namespace = access.namespace
        self._pool = pool
        self._base = f"/apis/coordination.k8s.io/v1/namespaces/{access.namespace}/leases"

    async def _run(self, verb: str, name: str, call: Callable[[], T]) -> T:
        """Run ``call`` in a worker thread; ``verb`` and ``name`` (the Lease, or "" for
        all of them) say what it does, as RBAC names it, for the error message."""
        resource = f"leases/{name}" if name else "leases"
        where = f"{resource} in namespace {self.namespace}"

        def guarded() -> T:
            try:
                return call()
            except ApiException as exc:
                if exc.status in (404, 409):  # reads map 404 to None before this
                    raise Conflict(one_line(exc)) from None
                if exc.status == 403:
                    raise Forbidden(f"kubernetes: forbidden to {verb} {where}: "
                                    f"{one_line(exc)}") from None
                raise BackendError(f"kubernetes: {verb} {where}: {one_line(exc)}") from None
            except Exception as exc:
                raise BackendError(f"kubernetes: {verb} {where}: {one_line(exc)}") from None

        return await asyncio.get_running_loop().run_in_executor(self._pool, guarded)

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        return request(self.access.api, method, path, body)

    async def get(self, name: str) -> Record | None:
        def call() -> Record | None:
            try:
                return Record.from_object(self._call("GET", f"{self._base}/{name}"))
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        return await self._run("get", name, call)

    async def create(self, name: str, record: Record) -> Record:
        return await self._run("create", name, lambda: Record.from_object(
            self._call("POST", self._base, record.body(name))))

    async def replace(self, name: str, record: Record) -> Record:
        return await self._run("update", name, lambda: Record.from_object(
            self._call("PUT", f"{self._base}/{name}", record.body(name))))

    async def list(self) -> list[dict[str, Any]]:
        return await self._run("list", "", lambda: self._call("GET", self._base)["items"])

    def watch(self, name: str, deliver: Callable[[Record | None], None]) -> LeaseWatch:
        """A started watch of Lease ``name``; ``deliver`` runs in the watch's thread."""
        lease_watch = LeaseWatch(self.access, name, deliver)
        lease_watch.start()
        return lease_watch


class Connection:
    """Connects on first use, once, so a bad kubeconfig is a backend error (reported on
    ``/readyz`` and in the log) rather than a crash; owns the worker threads."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._api: LeaseApi | None = None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kube-lease")
        self._connecting = asyncio.Lock()

    async def api(self) -> LeaseApi:
        async with self._connecting:  # several leases start at once; connect only once
            if self._api is None:
                loop = asyncio.get_running_loop()
                access = await loop.run_in_executor(self._pool, connect, self._settings)
                self._api = LeaseApi(access, self._pool)
                log.info("kubernetes backend connected", extra={
                    "namespace": access.namespace, "credentials": access.source})
            return self._api

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._api is not None:
            self._api.access.api.close()
