"""Following one API object by name with watch requests, the way client-go's reflector
follows a collection: the Lease watch of the ``kubernetes`` backend
(:mod:`sidecar.lease.kubernetes.transport`) and the own-pod watch of
``LEASE_APP_READY_CONTAINERS`` (:mod:`sidecar.appready`).

What it takes from the reflector (``tools/cache/reflector.go``), and why:

- **A watch that ends within a second is a failure** ("very short watch"), whatever it
  delivered, and so is one that fails: the next one waits a jittered, doubling backoff
  (0.8 s, then up to 30 s, the delay drawn from ``[d, 2d)``; back to 0.8 s after two
  minutes without a failure). An apiserver that closes every watch at once gets about
  one request a second from us, then fewer, not thousands.
- **Resume, do not relist.** Each watch starts from the last ``resourceVersion``
  delivered, bookmarks included (``allowWatchBookmarks``), so an idle watch that the
  apiserver ends resumes without replaying anything. ``410 Gone`` starts over from the
  current state (at once the first time, after the backoff if that too is gone).
- **``429`` and ``Retry-After``**: the next watch waits at least as long as asked.
- **Any exception restarts the watch**, not only the client's errors: an object that
  cannot be read, or a bug, is logged once with its traceback and retried with the
  backoff. Until a watch works again, :attr:`Follower.problem` says what failed, and
  :func:`problems` lists it for ``/healthz``.

And one thing of its own, for a watch that is open but silent: nothing at all arrives
on a *stalled* watch (a stuck apiserver, a proxy that stopped forwarding, a connection
half-open in a way TCP keepalive cannot see), yet it looks exactly like an idle one.
So once a watch has delivered nothing for ``quiet`` seconds, one cheap GET of the
object's metadata compares its ``resourceVersion`` with the last one delivered: newer
means the watch missed a change, and it is replaced (from the current state, and not
counted as up until that arrives); equal means idle, and nothing more is sent until it
has been quiet that long again. A Lease whose holder renews is never quiet that long, so
this costs a group nothing while it has a leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import weakref
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from sidecar.kubeapi import Gone, KubeClient, KubeError, one_line

log = logging.getLogger("sidecar.kubewatch")

BACKOFF_FIRST = 0.8  # seconds: client-go's reflector backoff
BACKOFF_MAX = 30.0
BACKOFF_RESET = 120.0  # seconds without a failure that reset the backoff
SHORT_WATCH = 1.0  # seconds: a watch that ends sooner failed
WATCH_SECONDS = 300  # timeoutSeconds of one watch request, drawn from [1, 1.2) times this

# (kind, object) for ADDED, MODIFIED and DELETED; never BOOKMARK.
Deliver = Callable[[str, dict[str, Any]], None]

_FOLLOWERS: weakref.WeakSet[Follower] = weakref.WeakSet()


def problems() -> list[str]:
    """What failed in each running watch that is restarting after an unexpected error
    (not an apiserver outage: ``/readyz`` reports that); empty when all is well."""
    return sorted(f.problem for f in _FOLLOWERS if f.problem is not None)


def later(version: str, than: str | None) -> bool:
    """Whether ``version`` comes after ``than`` (resourceVersions are opaque, but etcd
    revisions in practice; anything else that differs counts as later)."""
    if than is None:
        return True
    if version.isdigit() and than.isdigit():
        return int(version) > int(than)
    return version != than


class Backoff:
    """client-go's reflector backoff: doubling from :data:`BACKOFF_FIRST` to
    :data:`BACKOFF_MAX`, each delay drawn from ``[d, 2d)``, reset after
    :data:`BACKOFF_RESET` seconds without a failure."""

    def __init__(self, clock: Callable[[], float],
                 rand: Callable[[], float] = random.random) -> None:
        self._clock = clock
        self._rand = rand
        self._next = BACKOFF_FIRST
        self._last: float | None = None

    def delay(self) -> float:
        now = self._clock()
        if self._last is not None and now - self._last >= BACKOFF_RESET:
            self._next = BACKOFF_FIRST
        self._last = now
        base, self._next = self._next, min(self._next * 2, BACKOFF_MAX)
        return base * (1 + self._rand())


class _Stalled(Exception):
    """The watch missed a change (or the look at the object failed)."""

    def __init__(self, message: str, exists: bool = True) -> None:
        super().__init__(message)
        # Whether the object is there: a new watch from the current state then sends it
        # at once, and is not up until it did.
        self.exists = exists


class Follower:
    """A task that follows object ``name`` of collection ``path`` and hands each change
    to ``deliver``, on the event loop. ``what`` names it in logs and problems;
    ``quiet``: seconds of silence before a look at the object (see the module doc)."""

    def __init__(self, client: KubeClient, path: str, name: str, deliver: Deliver, *,
                 quiet: float, what: str, watch_seconds: int = WATCH_SECONDS) -> None:
        self._client = client
        self._path = path
        self._name = name
        self._deliver = deliver
        self._quiet = quiet
        self.what = what
        self._watch_seconds = watch_seconds
        loop = asyncio.get_running_loop()
        self._time = loop.time
        self._backoff = Backoff(loop.time)
        self._version: str | None = None  # the last resourceVersion delivered
        self._exists: bool | None = None  # what the watch last said (None: nothing yet)
        self._heard = 0.0  # loop time of the last sign of life (open, event, bookmark)
        self._wait_for_event = False  # up only once the first event arrived
        # True while a watch is open and believed current: what it delivered is the
        # object as it is.
        self.up = False
        self.error = ""  # the last failure, one line ("" before any)
        self.down_since: float | None = self._time()  # loop time it went down, None: up
        self.problem: str | None = None  # an unexpected error, until a watch works again
        self.watches = 0  # watch requests sent
        _FOLLOWERS.add(self)
        self._task = loop.create_task(self._run(), name=f"watch-{what}")

    def stop(self) -> None:
        self._set_up(False)
        self._task.cancel()
        _FOLLOWERS.discard(self)

    def down_for(self) -> float:
        """Seconds since the watch was last up (0 while it is)."""
        return 0.0 if self.down_since is None else self._time() - self.down_since

    def _set_up(self, up: bool) -> None:
        if up and not self.up:
            self.down_since = None
        elif not up and self.up:
            self.down_since = self._time()
        self.up = up

    async def _run(self) -> None:
        while True:
            started = self._time()
            delay = 0.0
            try:
                await self._watch_once()
                if self._time() - started < SHORT_WATCH:
                    self.error = "the apiserver ended the watch at once"
                    delay = self._backoff.delay()
                else:
                    self.problem = None
            except Gone as exc:
                self.error = str(exc)
                if self._version is None:  # gone from the current state: broken server
                    delay = self._backoff.delay()
                self._version = None
                self.problem = None
            except _Stalled as exc:
                self.error = str(exc)
                log.info("watch stalled; opening a new one", extra={
                    "watch": self.what, "error": self.error})
                self._version, self._wait_for_event = None, exc.exists
                delay = self._backoff.delay() if self._time() - started < 2 * self._quiet \
                    else 0.0
            except KubeError as exc:
                # An outage, a refusal: the callers' own reads report those.
                self.error = str(exc)
                log.debug("watch failed", extra={"watch": self.what, "error": self.error})
                delay = max(self._backoff.delay(), exc.retry_after or 0.0)
                self.problem = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Never the end of the watch (a standby would stay deaf until a restart).
                self.error = one_line(f"{type(exc).__name__}: {exc}")
                if self.problem is None:
                    log.exception("watch failed unexpectedly; restarting it",
                                  extra={"watch": self.what})
                self.problem = f"{self.what} restarting after an error: {self.error}"
                delay = self._backoff.delay()
            self._set_up(False)
            if delay:
                await asyncio.sleep(delay)

    async def _watch_once(self) -> None:
        """One watch request, until it ends, fails, or turns out stalled."""
        self.watches += 1
        self._heard = self._time()
        stream = self._client.watch(
            self._path, self._version,
            timeout_seconds=int(self._watch_seconds * random.uniform(1.0, 1.2)),
            opened=self._opened, fieldSelector=f"metadata.name={self._name}")
        consume = asyncio.ensure_future(self._consume(stream))
        check = asyncio.ensure_future(self._check())
        try:
            await asyncio.wait({consume, check}, return_when=asyncio.FIRST_COMPLETED)
            if consume.done():
                consume.result()  # its error, if it failed
                return
            check.result()  # the check returns only with an error
        finally:
            for task in (consume, check):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _opened(self) -> None:
        self._heard = self._time()
        if not self._wait_for_event:
            self._set_up(True)

    async def _consume(self, stream: Any) -> None:
        async for kind, obj in stream:
            self._heard = self._time()
            version = (obj.get("metadata") or {}).get("resourceVersion")
            if kind == "BOOKMARK":
                self._version = str(version) if version else self._version
                continue
            if kind not in ("ADDED", "MODIFIED", "DELETED"):
                continue
            self._deliver(kind, obj)
            self._version = str(version) if version else self._version
            self._exists = kind != "DELETED"
            self._wait_for_event = False
            self._set_up(True)
            self.problem = None  # delivered: whatever failed before works again

    async def _check(self) -> None:
        """Look at the object once the watch has been quiet for ``quiet`` seconds;
        raise :class:`_Stalled` when it missed a change."""
        while True:
            await asyncio.sleep(max(0.0, self._heard + self._quiet - self._time()))
            if self._time() - self._heard < self._quiet:
                continue
            try:
                version = await self._client.version_of(
                    f"{self._path}/{quote(self._name, safe='')}")
            except KubeError as exc:
                raise _Stalled(f"cannot look at {self.what} while its watch is quiet: "
                               f"{exc}") from None
            if self._missed(version):
                # An event on its way as we looked is no stall: give it a moment.
                await asyncio.sleep(min(1.0, self._quiet / 2))
                if self._missed(version):
                    quiet = self._time() - self._heard
                    if version is None:  # it missed the deletion: say it now
                        self._deliver("DELETED", {"metadata": {"name": self._name}})
                        self._exists = False
                    raise _Stalled(f"{self.what}: the watch missed a change (quiet for "
                                   f"{quiet:.1f}s)", exists=version is not None)
            self._heard = self._time()

    def _missed(self, version: str | None) -> bool:
        """Whether the object at ``version`` (None: no such object) is news to us."""
        if version is None:
            return self._exists is True
        return self._exists is not True or later(version, self._version)
