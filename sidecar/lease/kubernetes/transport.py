"""Talking to the apiserver about Lease objects: :mod:`sidecar.kubeapi` (aiohttp, on the
event loop; no worker threads and no ``kubernetes`` package in the sidecar).

Every call has a connect and a read timeout, so a hung apiserver fails a call instead of
parking it. The watch is a task that follows one Lease by name (:mod:`sidecar.kubewatch`)
and says whether it is up (:attr:`LeaseWatch.up`): while it is, a standby believes what
it delivers and reads the Lease no more; while it is down (failed, in its backoff, or
found stalled), the elector's retries read it (GET). One sidecar may hold many Leases:
each has its watch on a connection of its own (the client has no pool limit).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from sidecar.base.errors import BackendError, Forbidden
from sidecar.kubeapi import KubeClient, KubeError
from sidecar.kubewatch import Follower
from sidecar.lease.kubernetes.record import Record
from sidecar.settings import Settings

log = logging.getLogger("sidecar.lease.kubernetes")


class Conflict(Exception):
    """A write found the object other than we based it on: 409 (somebody else wrote
    first, or it already exists) or 404 (it was deleted)."""


class LeaseWatch:
    """A task that follows one Lease (:class:`sidecar.kubewatch.Follower`: backoff,
    bookmarks, stall checks, restarted on any error) and hands every record (None:
    deleted) to ``deliver``, on the event loop. ``quiet``: the seconds of silence after
    which it looks at the Lease to tell an idle watch from a stalled one."""

    def __init__(self, client: KubeClient, path: str, name: str,
                 deliver: Callable[[Record | None], None], quiet: float) -> None:
        self._deliver = deliver
        self._follower = Follower(client, path, name, self._changed, quiet=quiet,
                                  what=f"the watch of Lease {name}")

    @property
    def up(self) -> bool:
        """True while a watch request is open and current: what it delivered is the
        Lease as it is."""
        return self._follower.up

    def stop(self) -> None:
        self._follower.stop()

    def _changed(self, kind: str, obj: dict[str, Any]) -> None:
        self._deliver(None if kind == "DELETED" else Record.from_object(obj))


class LeaseApi:
    """The Lease calls of one namespace, mapped to our errors: ``Conflict`` for a lost
    race, ``Forbidden`` for a 403, ``BackendError`` for anything else."""

    def __init__(self, client: KubeClient, quiet: float) -> None:
        self.client = client
        self._quiet = quiet
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
        return LeaseWatch(self.client, self._base, name, deliver, self._quiet)


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
            # A holder renews every renew interval (give or take its jitter), so a
            # watch of a held Lease that is quiet for two of ours may have stalled.
            self._api = LeaseApi(client, quiet=2 * self._settings.timing.renew_interval)
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
