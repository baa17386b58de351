"""The pod annotation ``lease-sidecar/shards``: how many shards of its shard set this
pod holds, so the spread shows next to the pods::

    kubectl get pods -o \
      custom-columns='POD:.metadata.name,SHARDS:.metadata.annotations.lease-sidecar/shards'

Advisory, like the ``lease-role`` label (:mod:`.pod_label`): it counts the shards the
backend grants this pod (as ``lease_sidecar_shards_owned``), not claims, and the
application never reads it. It is written in a task of its own, at most once a second
and only when the count changed, so the shards' electors never wait for the apiserver;
a failed write is retried with the label's backoff. The electors tell it of every
transition but the last step of a release (the lease given back), so it also counts
again every :data:`RECOUNT` seconds. The pod-patch policy lets the
sidecar change this annotation of its own pod only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sidecar.base.clock import first_of
from sidecar.kubeapi import KubeClient, KubeError
from sidecar.publish.own_pod import OwnPod
from sidecar.publish.pod_label import RETRY_FIRST, RETRY_MAX
from sidecar.settings import Settings
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.publish.shard_count")

ANNOTATION = "lease-sidecar/shards"
# The most often the annotation is written, in seconds (a rebalance moves shards one by
# one: one write per second, not one per shard).
MIN_PERIOD = 1.0
RECOUNT = 5.0
# How long a stopping sidecar tries to write its last count.
STOP_TIMEOUT = 2.0


class ShardCountPublisher:
    def __init__(self, settings: Settings, states: list[LeaseState]) -> None:
        self._own = OwnPod.of(settings, "the shard count annotation needs")
        self._states = states
        self._client: KubeClient | None = None
        self._applied: int | None = None
        self._wake = asyncio.Event()
        self._keeper: asyncio.Task[None] | None = None

    def count(self) -> int:
        return sum(1 for state in self._states if state.facts.holding)

    async def start(self) -> None:
        try:
            self._client = KubeClient.connect(self._own.namespace)
        except KubeError as exc:
            log.warning("shard count annotation off: no apiserver credentials",
                        extra={"error": str(exc)})
            return
        self._keeper = asyncio.create_task(self._keep(), name="shard-count")
        self._wake.set()

    async def changed(self, state: LeaseState) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Once the shards are handed over: the last count (0), written once, bounded."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        if self._client is not None:
            with contextlib.suppress(KubeError, TimeoutError):
                async with asyncio.timeout(STOP_TIMEOUT):
                    await self._write(self._client)
            await self._client.close()

    async def _write(self, client: KubeClient) -> None:
        count = self.count()
        if count != self._applied:
            await client.patch(self._own.pods_path(self._own.name), {
                "metadata": {"annotations": {ANNOTATION: str(count)}}})
            self._applied = count

    async def _keep(self) -> None:
        assert self._client is not None
        delay = RETRY_FIRST
        failing = False
        while True:
            await first_of(self._wake.wait(), timeout=RECOUNT)
            self._wake.clear()
            if self.count() == self._applied:
                continue
            try:
                await self._write(self._client)
            except KubeError as exc:
                if not failing:
                    log.warning("shard count annotation write failed; retrying",
                                extra={"pod": self._own.name, "error": str(exc)})
                failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX)
                self._wake.set()
                continue
            failing, delay = False, RETRY_FIRST
            await asyncio.sleep(MIN_PERIOD)
