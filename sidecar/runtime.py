"""Wires one sidecar together: backend → electors → states → publishers.

Used by ``lease-sidecar run`` and ``exec`` and usable as a library::

    sidecar = Sidecar(config.load())
    await sidecar.start()
    ...
    await sidecar.stop()   # unpublish, release, close
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from sidecar import watchdog
from sidecar.appready import AppReadiness
from sidecar.base.clock import SystemClock
from sidecar.base.errors import ConfigError
from sidecar.base.redact import redact_tree
from sidecar.elector import Elector
from sidecar.lease import Backend, Lease, backend_entry, create_backend
from sidecar.publish import Publisher, claim_body
from sidecar.publish.file import FilePublisher
from sidecar.publish.http import (
    ControlToken,
    HandoverAnswer,
    HeartbeatAnswer,
    HttpServer,
    ReleaseOutcome,
    build_app,
)
from sidecar.publish.shards import SHARDS_FILE, ShardBoard
from sidecar.settings import Settings
from sidecar.shards.manager import ShardManager
from sidecar.state import LeaseState
from sidecar.statedir import resolve_state_dir
from sidecar.watchdog import WorkWatchdog

log = logging.getLogger("sidecar")
# While a sidecar lacks the credentials it needs, how often to look again (a kubeconfig
# from an optional Secret can appear later; a pod's missing token never does).
CREDENTIALS_RECHECK = 5.0


def pod_label_wanted(settings: Settings) -> bool:
    if settings.pod_label == "on":
        return True
    if settings.pod_label == "off":
        return False
    return bool(settings.pod_name and settings.pod_namespace)  # "auto": in a pod


class Sidecar:
    """One sidecar: its states, publishers, HTTP server and (once started) electors.

    ``takes_release`` lets a caller answer ``POST /release`` of a lease first: given the
    lease's name, it returns True when it took the request (``exec`` ends its command,
    then releases), False to let the elector step down at once. ``work_stopped`` (given
    the lease's name) returns once the work a claim started has stopped: every release
    waits for it, after the claims have run out (``exec``'s command may outlive its
    last claim by its grace).
    """

    def __init__(self, settings: Settings,
                 takes_release: Callable[[str], bool] | None = None,
                 work_stopped: Callable[[str], Awaitable[None]] | None = None) -> None:
        self.settings = settings
        self._takes_release = takes_release
        self._work_stopped = work_stopped
        self.clock = SystemClock()
        self.state_dir = resolve_state_dir(settings)
        self.states = [
            LeaseState(lease=name, identity=settings.identity, role=settings.role,
                       claim_horizon=settings.timing.claim_horizon, clock=self.clock)
            for name in settings.names
        ]
        # The shard set (LEASE_SHARDS): a state per shard, its files beside the leases'
        # ones; its electors run by the shard manager once started.
        self.shard_states = [
            LeaseState(lease=name, identity=settings.identity, role=settings.role,
                       claim_horizon=settings.timing.claim_horizon, clock=self.clock)
            for name in settings.shards
        ]
        self.shards: ShardManager | None = None
        files = FilePublisher(self.states + self.shard_states, self.state_dir)
        self.shard_board = ShardBoard(self.shard_states, settings.identity, self._shard_view,
                                      self.state_dir / SHARDS_FILE) if settings.shards else None
        self.shard_publishers: list[Publisher] = [files]
        if self.shard_board is not None:
            self.shard_publishers.append(self.shard_board)
        if settings.shards and pod_label_wanted(settings):
            from sidecar.publish.shard_count import ShardCountPublisher

            self.shard_publishers.append(ShardCountPublisher(settings, self.shard_states))
        self.publishers: list[Publisher] = [files]
        if pod_label_wanted(settings):
            from sidecar.publish import events, pod_label

            labels = pod_label.create(settings, self.states)
            self.publishers += [labels, events.create(settings, self.states, labels)]
        self.backend: Backend | None = None
        self.electors: dict[str, Elector] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._no_credentials: str | None = None
        self._credentials_checked = 0.0
        self._handing_over = asyncio.Lock()  # POST /handover, one at a time
        self.control_token = (ControlToken(settings.control_token_file)
                              if settings.control_token_file else None)
        app = build_app(self.states, status=self.status, alive=self.alive, ready=self.ready,
                        release=self.release, heartbeat=self.heartbeat,
                        handover=self.handover, cannot_lead=self.cannot_lead,
                        degraded=self.watch_problem, control_token=self.control_token,
                        shards=self.shard_board)
        self.http = HttpServer(app, *settings.http_addr)

    @property
    def contends(self) -> bool:
        return self.settings.role != "api"

    async def start(self) -> None:
        """Start publishing and contending; a start-up OSError becomes a ConfigError that
        names the setting behind it. Whatever fails, everything started so far is stopped
        first (the endpoint, which listens before the publishers start, included)."""
        try:
            await self._start()
        except Exception as exc:
            await self.stop()
            if isinstance(exc, OSError):
                raise start_error(self, exc) from None
            raise

    async def _start(self) -> None:
        if self.control_token is not None:
            # Before serving: no control request is taken without the token's file.
            try:
                self.control_token.ensure()
            except OSError as exc:
                raise ConfigError(f"LEASE_CONTROL_TOKEN_FILE / --control-token-file: "
                                  f"{self.control_token.path}: {exc.strerror or exc}"
                                  ) from None
        # Serving first: the publishers' tasks (the pod label's, the Events') then run
        # only once the endpoint listens, and their apiserver client loads beside it.
        await self.http.start()
        for publisher in self.publishers:
            await publisher.start()
        for publisher in self.shard_publishers[1:]:  # the file publisher has started
            await publisher.start()
        if not self.contends:
            for state in [*self.states, *self.shard_states]:
                state.update("api role", backend_ok=True, reason="role api never contends")
            log.info("running in api role; not contending",
                     extra={"identity": self.settings.identity})
            return
        self.backend = create_backend(self.settings, self.clock)
        self._check_credentials()
        readiness = self._app_readiness()
        successor = None
        if self.settings.shutdown_handover == "youngest-ready":
            from sidecar.rollout import GroupPods

            successor = GroupPods(self.settings).choose
        for state in self.states:
            elector = Elector(self.backend.lease(state.lease), state, self.settings.timing,
                              self.settings.identity, self.publishers,
                              sits_out=readiness.why_not if readiness else None,
                              shutdown_successor=successor,
                              work_stopped=functools.partial(self._work_stopped, state.lease)
                              if self._work_stopped is not None else None)
            self.electors[state.lease] = elector
            self._tasks.append(asyncio.create_task(elector.run(), name=f"elector-{state.lease}"))
            if self.settings.work_stall_after is not None:
                dog = WorkWatchdog(state, self.settings.work_stall_after,
                                   elector.request_release)
                self._tasks.append(asyncio.create_task(dog.run(),
                                                       name=f"watchdog-{state.lease}"))
        if self.settings.shards:
            await self._start_shards(readiness)
        if readiness is not None:
            self._tasks.append(asyncio.create_task(readiness.run(), name="app-readiness"))
        log.info("started", extra={"settings": self.settings.public(),
                                   "state_dir": str(self.state_dir),
                                   "http_port": self.http.bound_port})

    async def _start_shards(self, readiness: AppReadiness | None) -> None:
        """The shard group in the backend's store, and the manager that runs an elector
        for each shard this member campaigns for (:mod:`sidecar.shards`)."""
        settings = self.settings
        make_group = backend_entry(settings.store.backend).shard_group
        assert make_group is not None and self.backend is not None  # checked by config
        group = make_group(self.backend, settings, self.clock,
                           settings.store.key(settings.name))
        sits_out = readiness.why_not if readiness else None

        def elector(lease: Lease, state: LeaseState,
                    successor: Callable[[], Awaitable[str | None]]) -> Elector:
            return Elector(lease, state, settings.timing, settings.identity,
                           self.shard_publishers, sits_out=sits_out,
                           shutdown_successor=successor)

        self.shards = ShardManager(group, {s.lease: s for s in self.shard_states},
                                   settings.identity, settings.timing, self.clock, elector,
                                   ready=sits_out)
        await self.shards.start()

    def _shard_view(self) -> dict[str, Any]:
        """How the group looks to this member, for ``GET /shards`` and the metrics."""
        manager = self.shards
        if manager is None:
            return {"members": 0, "assigned": [], "ok": False, "round_trips": 0}
        return {"members": len(manager.view.members), "assigned": manager.assigned(),
                "ok": manager.view.ok,
                "round_trips": getattr(manager.group, "round_trips", 0)}

    def _app_readiness(self) -> AppReadiness | None:
        settings = self.settings
        pod = None
        if settings.app_ready_containers and settings.pod_name and settings.pod_namespace:
            pod = (settings.pod_namespace, settings.pod_name, settings.app_ready_containers)
            url = f"pod {settings.pod_name}:"
        elif settings.app_ready_url is not None:
            url = settings.app_ready_url
        else:
            return None

        def hand_over(name: str) -> bool:
            elector = self.electors.get(name)
            return elector is not None and elector.request_handover(why="app-unready")

        return AppReadiness(url, settings.app_unready_after, settings.timing.renew_interval,
                            self.states, hand_over, pod=pod,
                            outage_grace=settings.app_ready_outage_grace)

    async def stop(self) -> None:
        """Unpublish and release every lease, then close everything. The shards are
        handed to their next members meanwhile (:meth:`ShardManager.stop`)."""
        shards = asyncio.ensure_future(self.shards.stop()) if self.shards else None
        for elector in self.electors.values():
            elector.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if shards is not None:
            with contextlib.suppress(Exception):
                await shards
        for publisher in [*self.publishers, *self.shard_publishers[1:]]:
            with contextlib.suppress(Exception):
                await publisher.stop()
        await self.http.stop()
        if self.backend:
            with contextlib.suppress(Exception):
                await self.backend.close()

    async def wait_failed(self) -> None:
        """Returns only if an elector task died (a bug); lets ``run`` exit non-zero."""
        if self._tasks:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        else:
            await asyncio.Event().wait()

    async def wait_misconfigured(self) -> str:
        """Returns (with the backend's one-line message) only when the backend found a
        misconfiguration that shows only once connected: the ``postgres`` advisory lock
        behind a transaction pooler. The backend has already stopped claiming."""
        event = self.backend.misconfigured if self.backend else None
        await (event or asyncio.Event()).wait()  # a backend without the check: never
        return (self.backend.misconfiguration if self.backend else None) or "misconfigured backend"

    def alive(self) -> bool:
        now = self.clock.monotonic()
        return all(e.alive(now) for e in self.electors.values()) and all(
            not t.done() for t in self._tasks) and (self.shards is None or self.shards.alive())

    def ready(self) -> bool:
        return all(state.facts.backend_ok for state in self.states) and (
            self.shards is None or self.shards.view.ok)

    @staticmethod
    def watch_problem() -> str | None:
        """A watch (a Lease's, the own pod's) restarting after an unexpected error, for
        ``/healthz``; None when there is none. Only a sidecar that follows something has
        loaded :mod:`sidecar.kubewatch` (one that does not must not import it)."""
        kubewatch = sys.modules.get("sidecar.kubewatch")
        problems: list[str] = kubewatch.problems() if kubewatch is not None else []
        return "; ".join(problems) or None

    def cannot_lead(self) -> str | None:
        """Why this contender can never lead as configured, for ``/healthz`` and
        ``/readyz`` (``503`` with this reason); None if nothing stands in its way.

        Only missing credentials for the kubernetes backend: the sidecar runs, but no
        retry can ever reach its Lease. Not a liveness failure (``/livez``): a restart
        brings no token. Looked at again every few seconds, and logged once each way.
        """
        if self._no_credentials and (self.clock.monotonic() - self._credentials_checked
                                     >= CREDENTIALS_RECHECK):
            self._check_credentials()
        return self._no_credentials

    def _check_credentials(self) -> None:
        if self.settings.store.backend != "kubernetes":
            return
        from sidecar.kubeapi import CredentialsError, load_credentials

        self._credentials_checked = self.clock.monotonic()
        try:
            load_credentials()  # reads files only: says nothing about the apiserver
            problem = None
        except CredentialsError as exc:
            problem = str(exc)
        if problem and not self._no_credentials:
            self._no_credentials = f"cannot lead: {problem}"
            log.error("no kubernetes credentials: this sidecar can never lead until it has "
                      "some; /healthz and /readyz answer 503",
                      extra={"reason": self._no_credentials})
        elif not problem and self._no_credentials:
            self._no_credentials = None
            log.info("kubernetes credentials found")

    def release(self, name: str | None) -> ReleaseOutcome:
        """``POST /release``: only a holder can step down; a standby's refusal is final."""
        lease = name or self.settings.name
        if lease not in self.settings.names:
            return "no-such-lease"
        if self._takes_release is not None and self._takes_release(lease):
            return "released"
        elector = self.electors.get(lease)
        if elector is None or not elector.request_release():
            return "not-holding"
        return "released"

    async def handover(self, name: str | None, to: str | None) -> HandoverAnswer:
        """``POST /handover``: the leader steps down the safe way and names ``to`` (or
        nobody: the first standby to ask) the next holder. One request at a time, and
        ``to`` checked first where this sidecar can see its group's pods: a target that
        cannot lead is refused, since the others would stand aside for it."""
        lease = name or self.settings.name
        if lease not in self.settings.names:
            return "no-such-lease", {}
        async with self._handing_over:
            elector = self.electors.get(lease)
            facts = elector.state.facts if elector is not None else None
            if elector is None or facts is None or not facts.holding:
                return "refused", {"error": "this contender does not hold the lease"}
            if facts.released:
                return "refused", {"error": f"already stepping down: {facts.reason}"}
            if to == self.settings.identity:
                return "refused", {"error": f"{to} is this contender, the leader"}
            checked = "no successor named: the first standby to ask wins"
            if to is not None:
                why_not, checked = await self._can_lead(to)
                if why_not is not None:
                    return "refused", {"error": f"cannot hand over to {to}: {why_not}"}
            if not elector.request_handover(to):  # lost the lease while we looked
                return "refused", {"error": "this contender does not hold the lease"}
            return "handing-over", {"checked": checked}

    async def _can_lead(self, to: str) -> tuple[str | None, str]:
        """(why ``to`` cannot take the lease over, or None; what was checked)."""
        from sidecar.rollout import GroupPods

        if not GroupPods.applies(self.settings, pod_label_wanted(self.settings)):
            return None, ("not checked: this sidecar cannot see its group's pods (it needs "
                          "POD_NAME, POD_NAMESPACE, the pod label and the pod name as "
                          "identity); a successor that does not take the lease within a "
                          "retry interval of the release leaves it to the others")
        try:
            async with asyncio.timeout(max(1.0, self.settings.timing.renew_interval)):
                return await GroupPods(self.settings).refusal(to)
        except TimeoutError:
            return None, "not checked (the apiserver did not answer in time)"

    def heartbeat(self, name: str | None) -> HeartbeatAnswer:
        """``POST /heartbeat``: the application vouches for its work while we lead."""
        state = next((s for s in self.states if s.lease == (name or self.settings.name)), None)
        if state is None:
            return "no-such-lease", {}
        return watchdog.beat(state)

    def status(self) -> dict[str, Any]:
        leases = []
        for state in self.states:
            claim = state.claim()
            facts = state.facts
            leases.append({
                **claim_body(state, claim),
                "holding": facts.holding,
                "backend_ok": facts.backend_ok,
                "reason": facts.reason,
                "state_version": facts.version,
                "work": watchdog.status(state),
                "transitions": list(state.transitions),
            })
        # Reasons carry backend error text, which may echo a DSN.
        status: dict[str, Any] = redact_tree({
            "identity": self.settings.identity, "role": self.settings.role,
            "settings": self.settings.public(), "leases": leases,
            **({"shards": self._shard_status()} if self.settings.shards else {})})
        return status


    def _shard_status(self) -> dict[str, Any]:
        manager = self.shards
        view = manager.view if manager is not None else None
        return {"members": list(view.members) if view else [],
                "group_ok": bool(view and view.ok), "error": view.error if view else "",
                "assigned": manager.assigned() if manager else [],
                "owned": manager.owned() if manager else [],
                "campaigning": sorted(manager.electors) if manager else [],
                "led": self.shard_board.led() if self.shard_board else []}


def start_error(sidecar: Sidecar, exc: OSError) -> ConfigError:
    """Name the setting behind a start-up failure: a file error is about the state
    directory (a ``leader`` *directory* in it, say), a socket error about the address."""
    if exc.filename is not None:
        path = os.fsdecode(exc.filename)
        directory = os.fspath(sidecar.state_dir)
        if path == directory or path.startswith(directory.rstrip("/") + "/"):
            return ConfigError(f"LEASE_STATE_DIR / --state-dir: {path}: "
                               f"{exc.strerror or exc}")
        return ConfigError(f"cannot start: {path}: {exc.strerror or exc}")
    host, port = sidecar.settings.http_addr
    return ConfigError(f"LEASE_HTTP_ADDR / --http-addr: cannot listen on {host}:{port}: "
                       f"{exc.strerror or exc}")
