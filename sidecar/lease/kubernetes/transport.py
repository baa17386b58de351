"""Talking to the apiserver about Lease objects: :mod:`sidecar.kubeapi` (aiohttp, on the
event loop; no worker threads and no ``kubernetes`` package in the sidecar).

Every call has a connect and a read timeout, so a hung apiserver fails a call instead of
parking it. The watch is a task that follows one Lease by name and says whether it is up
(:attr:`LeaseWatch.up`): while it is, a standby believes what it delivers and reads the
Lease no more; while it is down, the elector's retries read it (GET), as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from sidecar.base.errors import BackendError, Forbidden
from sidecar.kubeapi import Gone, KubeClient, KubeError
from sidecar.lease.kubernetes.record import Record
from sidecar.settings import Settings

log = logging.getLogger("sidecar.lease.kubernetes")

# A watch request ends after this many seconds and is re-opened from the last version it
# delivered, so nothing is replayed; after 410 Gone (that version is too old) it is
# re-opened from scratch, and the apiserver replays the current object.
WATCH_SECONDS = 300
WATCH_RETRY_MAX = 5.0


class Conflict(Exception):
    """A write found the object other than we based it on: 409 (somebody else wrote
    first, or it already exists) or 404 (it was deleted)."""


class LeaseWatch:
    """A task that watches one Lease and hands every record (None: deleted) to
    ``deliver``, on the event loop."""

    def __init__(self, client: KubeClient, path: str, name: str,
                 deliver: Callable[[Record | None], None]) -> None:
        self._client = client
        self._path = path
        self._name = name
        self._deliver = deliver
        # True while a watch request is open: what it delivers is the Lease as it is.
        self.up = False
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name=f"lease-watch-{name}")

    def stop(self) -> None:
        self.up = False
        self._task.cancel()

    def _opened(self) -> None:
        self.up = True

    async def _run(self) -> None:
        delay, version = 0.2, None
        while True:
            try:
                async for kind, obj in self._client.watch(
                        self._path, version, timeout_seconds=WATCH_SECONDS,
                        opened=self._opened, fieldSelector=f"metadata.name={self._name}"):
                    version = (obj.get("metadata") or {}).get("resourceVersion") or version
                    if kind in ("ADDED", "MODIFIED"):
                        self._deliver(Record.from_object(obj))
                    elif kind == "DELETED":
                        self._deliver(None)
                delay = 0.2  # ended by its timeout: re-open from ``version`` at once
            except Gone:
                self.up, version = False, None
            except KubeError as exc:
                # The elector's own reads report unreachability; here we only retry.
                self.up = False
                log.debug("lease watch failed", extra={"lease": self._name, "error": str(exc)})
                await asyncio.sleep(delay)
                delay = min(delay * 2, WATCH_RETRY_MAX)


class LeaseApi:
    """The Lease calls of one namespace, mapped to our errors: ``Conflict`` for a lost
    race, ``Forbidden`` for a 403, ``BackendError`` for anything else."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client
        self.namespace = client.namespace
        self._base = f"/apis/coordination.k8s.io/v1/namespaces/{quote(client.namespace)}/leases"

    async def _run(self, verb: str, name: str, call: Any) -> Any:
        """Await ``call``; ``verb`` and ``name`` (the Lease, or "" for all of them) say
        what it does, as RBAC names it, for the error message."""
        resource = f"leases/{name}" if name else "leases"
        where = f"{resource} in namespace {self.namespace}"
        try:
            return await call
        except KubeError as exc:
            if exc.status in (404, 409):  # reads map 404 to None before this
                raise Conflict(str(exc)) from None
            if exc.status == 403:
                raise Forbidden(f"kubernetes: forbidden to {verb} {where}") from None
            raise BackendError(f"kubernetes: {verb} {where}: {exc}") from None

    async def get(self, name: str) -> Record | None:
        found = await self._run("get", name, self.client.get_or_none(f"{self._base}/{name}"))
        return None if found is None else Record.from_object(found)

    async def create(self, name: str, record: Record) -> Record:
        return Record.from_object(await self._run(
            "create", name, self.client.post(self._base, record.body(name))))

    async def replace(self, name: str, record: Record) -> Record:
        return Record.from_object(await self._run(
            "update", name, self.client.put(f"{self._base}/{name}", record.body(name))))

    async def list(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = (
            await self._run("list", "", self.client.list(self._base)))["items"]
        return items

    def watch(self, name: str, deliver: Callable[[Record | None], None]) -> LeaseWatch:
        """A started watch of Lease ``name``; ``deliver`` runs on the event loop."""
        return LeaseWatch(self.client, self._base, name, deliver)


class Connection:
    """Connects on first use, once, so missing credentials are a backend error (reported
    on ``/readyz`` and in the log) rather than a crash."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._api: LeaseApi | None = None

    async def api(self) -> LeaseApi:
        if self._api is None:
            try:
                client = KubeClient.connect(self._settings.pod_namespace)
            except KubeError as exc:
                raise BackendError(str(exc)) from None
            self._api = LeaseApi(client)
            log.info("kubernetes backend connected", extra={
                "namespace": client.namespace, "credentials": client.credentials.source})
            if client.credentials.insecure:
                log.warning("the kubeconfig sets insecure-skip-tls-verify: the apiserver's "
                            "certificate is not verified", extra={"server":
                                                                 client.credentials.server})
        return self._api

    async def close(self) -> None:
        if self._api is not None:
            with contextlib.suppress(Exception):
                await self._api.client.close()
