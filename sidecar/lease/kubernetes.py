"""``kubernetes``: a ``coordination.k8s.io/v1`` Lease, the way client-go's leader election
uses one — no database at all.

The Lease object is named ``{key_prefix}.{name}`` (it must be a DNS subdomain) and lives
in ``POD_NAMESPACE`` (else the kubeconfig's namespace, else ``default``). We own five
fields of its spec and write them as client-go v0.37's ``leaderelection`` does:

- ``holderIdentity``: the holder, ``""`` once released;
- ``leaseDurationSeconds``: how long others must wait after they last saw it change
  (1 once released);
- ``acquireTime`` / ``renewTime``: MicroTime, informative only (see below); a new term
  sets both, a renew only ``renewTime``, a release sets both to the release time;
- ``leaseTransitions``: the fencing token. 0 when the object is created, +1 with every
  new term: whenever the holder changes (as client-go counts) and also when the same
  identity starts a new term (a restarted process must not share its predecessor's
  token; client-go would keep the count there). A renew or a release keeps it. Since
  client-go also adds 1 on every takeover and keeps the count on renew and release, the
  count only grows however sidecars and client-go electors alternate, for as long as the
  object exists. The sidecar never deletes the object (its Role has no ``delete``);
  deleting it by hand resets the count.

Every other field is someone else's and survives every write of ours: each write is the
object as last read (or as the apiserver returned our previous write) with only those
five fields changed — labels, annotations, ownerReferences, ``spec.preferredHolder``,
``spec.strategy`` and fields this code has never heard of. (client-go keeps the metadata
but rebuilds the spec, so its own writes drop ``preferredHolder`` and ``strategy``
outside coordinated leader election.)

Every write carries the ``resourceVersion`` it was based on, so two contenders cannot both
win: the apiserver answers ``409 Conflict`` to the slower one, which means "lost the
race", not an error.

Expiry follows client-go's skew-tolerant rule and never compares wall clocks: a contender
notes, on its *own monotonic clock*, when it last saw the record change (any new
``resourceVersion``), and may take the lease over only once ``leaseDurationSeconds`` have
passed since then without a change. The holder's claim ends ``lease_duration -
safety_margin`` after it *sent* its last successful write. A standby can only have seen
that write after it was sent, so its wait starts later and lasts longer than the holder's
claim: the two never overlap as long as the two clocks' *rates* differ by less than
``safety_margin / lease_duration`` — their offsets do not matter at all.

client-go's standbys see less: they compare the record with ``renewTime`` cut to whole
seconds (``metav1.Time`` in JSON), so two renews within one wall-clock second look like
one, and they may date our last renew up to one second too early and take over up to 1 s
before our lease's nominal end. A safety margin of at least one second covers that.

After a release the lease passes at once; the elector keeps the claims apart (the old
holder unpublishes and waits out the claims it handed out before it releases, and a new
term waits one claim horizon before its first claim).

Standbys watch the Lease, so a release (``holderIdentity`` cleared and
``leaseDurationSeconds`` set to 1, like client-go's ``ReleaseOnCancel``) is taken over at
once, and a holder that died is taken over the moment its lease runs out on the standby's
clock — not at the next retry.

The official ``kubernetes`` client is synchronous; every call runs in a worker thread with
a request timeout, so the event loop never blocks and a hung apiserver fails a call
instead of parking it. The watch runs in its own daemon thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from sidecar.clock import Clock, SystemClock
from sidecar.errors import BackendError, ConfigError
from sidecar.kube import REQUEST_TIMEOUT, KubeAccess, connect, one_line, request
from sidecar.lease import BackendEntry, Grant, Holder, LeaseInfo
from sidecar.names import object_name_problem, prefixed
from sidecar.settings import Settings

log = logging.getLogger("sidecar.lease.kubernetes")

T = TypeVar("T")

# A watch request ends after this many seconds and is re-opened; re-opening without a
# resourceVersion replays the current object, so a missed event heals within one period.
WATCH_SECONDS = 60
WATCH_RETRY_MAX = 5.0


def object_name(settings: Settings, name: str) -> str:
    """The Lease object's name; ``ConfigError`` (exit 2) unless it is a DNS subdomain."""
    problem = object_name_problem(settings.store.key_prefix, name)
    if problem:
        raise ConfigError(f"LEASE_NAME / --name: {problem}")
    return settings.store.key(name)


def micro_time(wall: float) -> str:
    """RFC 3339 with exactly six fractional digits: the apiserver's MicroTime format.

    (The generated client's ``datetime.isoformat()`` drops the fraction when it is zero,
    which MicroTime then rejects, so we send strings we formatted ourselves.)
    """
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class Record:
    """The parts of a Lease object the election reads, and the object they came from."""

    holder: str  # "" when released
    duration: int  # leaseDurationSeconds
    transitions: int  # leaseTransitions: the fencing token
    version: str  # metadata.resourceVersion
    acquire_time: str | None = None
    renew_time: str | None = None
    # The whole object as the apiserver sent it: a write starts from it, so every field
    # we do not own goes back unchanged. Empty for an object we are about to create.
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> Record:
        spec = obj.get("spec") or {}
        return cls(holder=spec.get("holderIdentity") or "",
                   duration=int(spec.get("leaseDurationSeconds") or 0),
                   transitions=int(spec.get("leaseTransitions") or 0),
                   version=str(obj["metadata"]["resourceVersion"]),
                   acquire_time=spec.get("acquireTime"), renew_time=spec.get("renewTime"),
                   source=obj)

    def body(self, name: str) -> dict[str, Any]:
        """The object to write: the one we read with our five spec fields set.

        ``version`` makes the apiserver refuse a write based on a stale read.
        """
        obj = copy.deepcopy(self.source)
        obj["apiVersion"] = "coordination.k8s.io/v1"
        obj["kind"] = "Lease"
        metadata = obj.setdefault("metadata", {})
        metadata["name"] = name
        # The resourceVersion alone guards the write. With the uid too, a renew based on
        # an object someone deleted by hand would fail (a UID precondition) and the next
        # holder would create a new object with the count back at 0; without it the
        # apiserver re-creates the object (Leases allow create-on-update) with our count.
        metadata.pop("uid", None)
        if self.version:
            metadata["resourceVersion"] = self.version
        else:
            metadata.pop("resourceVersion", None)
        spec = obj.get("spec") or {}
        obj["spec"] = spec
        spec.update(holderIdentity=self.holder, leaseDurationSeconds=self.duration,
                    leaseTransitions=self.transitions, acquireTime=self.acquire_time,
                    renewTime=self.renew_time)
        return obj

    def expires_at(self) -> datetime | None:
        """The holder's own idea of its expiry (wall clock): for ``status`` only."""
        if not self.holder or not self.renew_time:
            return None
        renewed = datetime.fromisoformat(self.renew_time.replace("Z", "+00:00"))
        return renewed + timedelta(seconds=self.duration)


def _newer(version: str, than: str) -> bool:
    """Whether ``version`` is a later write than ``than``.

    resourceVersions are opaque, but they are etcd revisions in practice; comparing them
    numerically lets a lagging watch event (older than what a GET already showed) be
    ignored instead of restarting the wait. Non-numeric versions: any difference counts.
    """
    if version.isdigit() and than.isdigit():
        return int(version) > int(than)
    return version != than


class Observer:
    """client-go's skew-tolerant expiry rule, on an injectable monotonic clock.

    Remembers the last record seen and *when this contender saw it change*; the lease is
    free for us once ``leaseDurationSeconds`` have passed since then on our own clock —
    whatever ``renewTime`` says, so a wrong wall clock anywhere cannot shorten the wait.

    A Lease object that disappears while someone holds it (deleted by hand) is not free
    at once either: its holder may still be claiming, so we wait out that holder's
    duration from when we saw it go.
    """

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self.seen = False  # nothing observed yet: the caller must look first
        self.record: Record | None = None
        self.changed_at = 0.0
        self._vanished_wait = 0  # the duration of a holder whose object was deleted

    def observe(self, record: Record | None) -> bool:
        """Note what we read (``None``: no Lease object); True if it changed."""
        if self.seen:
            if record is None and self.record is None:
                return False
            if (record is not None and self.record is not None
                    and not _newer(record.version, self.record.version)):
                return False
        if record is None and self.record is not None and self.record.holder:
            self._vanished_wait = self.record.duration
        elif record is not None:
            self._vanished_wait = 0
        self.seen = True
        self.record = record
        self.changed_at = self._monotonic()
        return True

    def free_in(self, identity: str) -> float:
        """Seconds until ``identity`` may take the lease; 0 when it may now."""
        record = self.record
        if record is None:
            wait = self._vanished_wait
        elif not record.holder or record.holder == identity:
            wait = 0
        else:
            wait = record.duration
        if not self.seen or not wait:
            return 0.0
        return max(0.0, self.changed_at + wait - self._monotonic())


class Conflict(Exception):
    """A write found the object other than we based it on: 409 (somebody else wrote
    first, or it already exists) or 404 (it was deleted)."""


class LeaseApi:
    """The Lease calls, each run in a worker thread and mapped to our errors."""

    def __init__(self, access: KubeAccess, pool: ThreadPoolExecutor) -> None:
        self.access = access
        self.namespace = access.namespace
        self._pool = pool
        self._base = f"/apis/coordination.k8s.io/v1/namespaces/{access.namespace}/leases"

    async def _run(self, what: str, call: Callable[[], T]) -> T:
        def guarded() -> T:
            try:
                return call()
            except ApiException as exc:
                if exc.status in (404, 409):  # reads map 404 to None before this
                    raise Conflict(one_line(exc)) from None
                raise BackendError(f"kubernetes: {what}: {one_line(exc)}") from None
            except Exception as exc:
                raise BackendError(f"kubernetes: {what}: {one_line(exc)}") from None

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

        return await self._run(f"get lease {self.namespace}/{name}", call)

    async def create(self, name: str, record: Record) -> Record:
        return await self._run(f"create lease {self.namespace}/{name}", lambda: Record.from_object(
            self._call("POST", self._base, record.body(name))))

    async def replace(self, name: str, record: Record) -> Record:
        return await self._run(f"update lease {self.namespace}/{name}", lambda: Record.from_object(
            self._call("PUT", f"{self._base}/{name}", record.body(name))))

    async def list(self) -> list[dict[str, Any]]:
        return await self._run(f"list leases in {self.namespace}",
                               lambda: self._call("GET", self._base)["items"])


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


class KubeLease:
    """One Lease object as seen by one contender."""

    # A Lease object is lost only when a renew is refused.
    lost: asyncio.Event | None = None

    def __init__(self, backend: KubeBackend, name: str, object_name: str) -> None:
        settings = backend.settings
        self.name = name
        self._backend = backend
        self._object = object_name
        self._identity = settings.identity
        self._clock = backend.clock
        # Whole seconds on the wire; rounding up only makes others wait longer.
        self._duration = max(1, math.ceil(settings.timing.lease_duration))
        self._valid_for = settings.timing.lease_duration - settings.timing.safety_margin
        self._observer = Observer(self._clock.monotonic)
        self._mine: Record | None = None  # our last successful write in this term
        self._changed = asyncio.Event()
        self._watch: LeaseWatch | None = None

    # -- the Lease protocol ------------------------------------------------------------
    async def try_acquire(self) -> Grant:
        api = await self._backend.api()
        watched = self._observer.record
        if (self._watch is not None and watched is not None
                and self._observer.free_in(self._identity) == 0):
            # The watch just showed the lease free (a release, or it ran out): skip the
            # GET, saving a round trip on every handover. A stale view costs nothing but
            # a 409, because the write is guarded by the version we saw.
            current: Record | None = watched
        else:
            current = await self._read(api)
        wait = self._observer.free_in(self._identity)
        if wait > 0:
            if current is None:
                return Grant(held=False, reason=f"lease object deleted while held; free in "
                                                f"{wait:.1f}s")
            return Grant(held=False, holder=current.holder,
                         reason=f"held by {current.holder} (free in {wait:.1f}s unless "
                                "renewed)")
        # A new term every time — also when the record names us (a restarted process
        # with the same identity): the token must change with every acquisition. A new
        # object starts at 0, as client-go's does.
        now = micro_time(self._clock.wall())
        if current is None:
            wanted = Record(holder=self._identity, duration=self._duration, transitions=0,
                            version="", acquire_time=now, renew_time=now)
        else:
            wanted = replace(current, holder=self._identity, duration=self._duration,
                             transitions=current.transitions + 1, acquire_time=now,
                             renew_time=now)
        try:
            if current is None:
                written = await api.create(self._object, wanted)
            else:
                written = await api.replace(self._object, wanted)
        except Conflict:
            # Lost the race: read the winner's record so our wait counts from it.
            winner = await self._read(api)
            holder = winner.holder if winner else None
            return Grant(held=False, holder=holder or None,
                         reason=f"lost the race to {holder or 'another contender'}")
        return self._holding(written)

    async def try_renew(self) -> Grant:
        mine = self._mine
        if mine is None:
            return Grant(held=False, reason="not holding")
        api = await self._backend.api()
        try:
            written = await api.replace(self._object, self._renewed(mine))
        except Conflict:
            # Something else wrote the object; it is still ours only if it still names
            # us in the same term.
            current = await self._read(api)
            if not self._is_ours(current, mine):
                self._mine = None
                holder = current.holder if current else None
                return Grant(held=False, holder=holder or None,
                             reason=f"taken over by {holder}" if holder else "lease released "
                             "or deleted by someone else")
            assert current is not None
            try:
                written = await api.replace(self._object, self._renewed(current))
            except Conflict:
                self._mine = None
                return Grant(held=False, reason="lost the race while renewing")
        return self._holding(written)

    async def release(self) -> None:
        """Give the lease back as client-go's ``ReleaseOnCancel`` does: holder ``""``,
        ``leaseDurationSeconds`` 1, ``acquireTime`` = ``renewTime`` = now, the count
        kept; standbys of either kind take over at once."""
        mine, self._mine = self._mine, None
        if mine is None:
            return
        api = await self._backend.api()
        for _ in range(2):
            now = micro_time(self._clock.wall())
            released = replace(mine, holder="", duration=1, acquire_time=now,
                               renew_time=now)
            try:
                self._observer.observe(await api.replace(self._object, released))
                return
            except Conflict:
                current = await self._read(api)
                if not self._is_ours(current, mine):
                    return  # already someone else's: nothing of ours to give back
                assert current is not None
                mine = current

    async def describe(self) -> Holder:
        record = await self._read(await self._backend.api())
        if record is None:
            return Holder(holder=None)
        return Holder(holder=record.holder or None, fencing_token=record.transitions,
                      expires_at=record.expires_at())

    async def wait_for_change(self, timeout: float) -> None:
        """Return when the lease may be ours: released, gone, or run out on our clock."""
        self._ensure_watch()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            free_in = self._observer.free_in(self._identity)
            if left <= 0 or free_in <= 0:
                return
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, free_in))

    # -- internals ---------------------------------------------------------------------
    async def _read(self, api: LeaseApi) -> Record | None:
        record = await api.get(self._object)
        self._observe(record)
        return record

    def _observe(self, record: Record | None) -> None:
        if self._observer.observe(record):
            self._changed.set()
            self._changed = asyncio.Event()

    def _holding(self, written: Record) -> Grant:
        self._observe(written)
        self._mine = written
        return Grant(held=True, valid_for=self._valid_for, fencing_token=written.transitions,
                     holder=self._identity)

    def _renewed(self, base: Record) -> Record:
        return replace(base, holder=self._identity, duration=self._duration,
                       renew_time=micro_time(self._clock.wall()))

    def _is_ours(self, current: Record | None, mine: Record) -> bool:
        return (current is not None and current.holder == self._identity
                and current.transitions == mine.transitions)

    def _ensure_watch(self) -> None:
        if self._watch is not None or self._backend.access is None:
            return
        loop = asyncio.get_running_loop()

        def deliver(record: Record | None) -> None:
            # Runs in the watch thread; the observer belongs to the event loop.
            with contextlib.suppress(RuntimeError):  # the loop is closing
                loop.call_soon_threadsafe(self._observe, record)

        self._watch = LeaseWatch(self._backend.access, self._object, deliver)
        self._watch.start()

    def stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()


class KubeBackend:
    """Lease objects in one namespace; connects lazily so a bad config is a backend error
    (reported on ``/readyz`` and in the log) rather than a crash."""

    # Nothing found once connected can make this backend unsafe.
    misconfigured: asyncio.Event | None = None
    misconfiguration: str | None = None

    def __init__(self, settings: Settings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self.access: KubeAccess | None = None
        self._api: LeaseApi | None = None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kube-lease")
        self._leases: list[KubeLease] = []
        self._connecting = asyncio.Lock()
        # Validate every name up front: a bad name is a settings error (exit 2).
        self._objects = {name: object_name(settings, name) for name in settings.names}

    async def api(self) -> LeaseApi:
        async with self._connecting:  # several leases start at once; connect only once
            if self._api is None:
                loop = asyncio.get_running_loop()
                access = await loop.run_in_executor(self._pool, connect, self.settings)
                self.access = access
                self._api = LeaseApi(access, self._pool)
                log.info("kubernetes backend connected", extra={
                    "namespace": access.namespace, "credentials": access.source})
            return self._api

    def lease(self, name: str) -> KubeLease:
        lease = KubeLease(self, name, self._objects.get(name) or object_name(self.settings,
                                                                             name))
        self._leases.append(lease)
        return lease

    async def close(self) -> None:
        for lease in self._leases:
            lease.stop_watch()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.access is not None:
            self.access.api.close()


def create(settings: Settings, clock: Clock) -> KubeBackend:
    return KubeBackend(settings, clock)


async def list_leases(settings: Settings, names: tuple[str, ...] | None) -> list[LeaseInfo]:
    """``lease-sidecar status``: the named Leases, each read with ``get`` (which the Role's
    ``resourceNames`` allow), or with no names every Lease of this key prefix in the
    namespace (``list``, which needs a Role without ``resourceNames``); never created. A
    Lease whose holder is empty or whose term ran out on this host's clock exists but is
    free."""
    backend = KubeBackend(settings, SystemClock())
    try:
        api = await backend.api()
        prefix = f"{settings.store.key_prefix}." if settings.store.key_prefix else ""
        now = datetime.now(UTC)
        if names:
            found = [(name, await api.get(prefixed(settings.store.key_prefix, name)))
                     for name in names]
            records = [(name, record) for name, record in found if record is not None]
        else:
            records = [(obj["metadata"]["name"][len(prefix):], Record.from_object(obj))
                       for obj in await api.list()
                       if obj["metadata"]["name"].startswith(prefix)]
        rows = []
        for name, record in records:
            expires = record.expires_at()
            live = bool(record.holder) and expires is not None and expires > now
            rows.append(LeaseInfo(lease=name,
                                  holder=record.holder if live else None,
                                  fencing_token=record.transitions, expires_at=expires,
                                  details={"object": f"{api.namespace}/{prefix}{name}"}))
        return rows
    finally:
        await backend.close()


def _validate(settings: Settings) -> None:
    for name in settings.names:
        object_name(settings, name)


ENTRY = BackendEntry(
    create=create, validate=_validate, list_leases=list_leases,
    min_safety_margin=(1.0, "client-go electors on the same Lease observe its changes at "
                            "one-second granularity and may take over up to 1s before its "
                            "nominal expiry"))
