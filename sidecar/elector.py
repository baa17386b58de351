"""The election loop for one lease: acquire, renew, step down.

This loop carries out the safety model, whose one home is ``docs/design.md`` (the rules,
why each exists, and what the sidecar does not promise). Here, concretely:

- validity is counted from the *send* time of each successful acquire or renew
  (``grant.valid_for`` after it), and the state computes every claim from those facts
  when asked;
- a voluntary step-down unpublishes, waits until the last claim handed out has expired
  (``state.issued_until``, never past the validity), then releases;
- a new term's first claim waits ``max(claim_horizon, grant.claim_delay)`` from the
  acquire's *reply* — only ``grant.claim_delay`` when the backend proves the previous
  term was released after its claims had run out (``grant.previous_claims_ended``); a
  long ``claim_delay`` is slept in renew intervals with renews between, so the term
  never outlasts its validity while it waits;
- a lease lost without a step-down (a refused renew, a dropped session) stops the claims
  at once; the claims already handed out are bounded by the backend's own rules.

A backend that cannot be reached is retried with jittered exponential backoff (from the
renew interval up to the lease duration); one log line per change of reachability, not
one per retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Sequence

from sidecar.base.clock import first_of
from sidecar.base.errors import Forbidden
from sidecar.lease import Grant, Lease, successor_of
from sidecar.publish import Publisher
from sidecar.settings import RENEW_JITTER, Timing
from sidecar.state import LeaseState

log = logging.getLogger("sidecar.elector")

# Bound on how long a publisher may take to unpublish before we release anyway: a dead
# API server must not keep a lease that a standby could use (the label is advisory).
UNPUBLISH_TIMEOUT = 2.0
# Why a leader hands over on purpose: asked to (POST /handover, ``lease-sidecar
# handover``), its application has not been ready for LEASE_APP_UNREADY_AFTER, or it
# stops and named a successor (LEASE_SHUTDOWN_HANDOVER, sidecar.rollout).
HANDOVER_REASONS = ("request", "app-unready", "shutdown")
# Renew intervals a hand-over's hint outlives the release by: one retry interval with its
# jitter (see _name_successor).
HINT_AFTER_RELEASE = 1.25


def successor_choice_bound(timing: Timing) -> float:
    """How long a stopping leader waits for its successor chooser before it releases to
    whoever asks first: one renew interval, at least 1 s (it still leads meanwhile)."""
    return max(1.0, timing.renew_interval)


def jittered(seconds: float, spread: float = 0.2) -> float:
    return seconds * random.uniform(1 - spread, 1 + spread)


class Elector:
    def __init__(self, lease: Lease, state: LeaseState, timing: Timing, identity: str,
                 publishers: Sequence[Publisher] = (),
                 sits_out: Callable[[], str | None] | None = None,
                 shutdown_successor: Callable[[], Awaitable[str | None]] | None = None,
                 work_stopped: Callable[[], Awaitable[None]] | None = None) -> None:
        self.lease = lease
        # Returns once the work our claims started has stopped (``exec``'s command): a
        # release follows it, so a release record never speaks too early.
        self._work_stopped = work_stopped
        # Why this contender must not campaign now (LEASE_APP_READY_URL), None: it may.
        self._sits_out = sits_out
        # Who should lead after us when we stop (sidecar.rollout); None: nobody named.
        self._shutdown_successor = shutdown_successor
        self.state = state
        self.timing = timing
        self.identity = identity
        self.publishers = list(publishers)
        self._clock = state.clock
        self._wake = asyncio.Event()
        self._release_requested = False
        self._release_reason = "released on request"
        # A hand-over asked for with the release: (reason, named successor or None).
        self._handover: tuple[str, str | None] | None = None
        self._last_tick = self._clock.monotonic()
        self._failures = 0
        # The outage being reported: when it began (monotonic) and its first error.
        self._down_since = 0.0
        self._down_cause = ""
        self._stopping = False

    # -- control from outside ----------------------------------------------------------
    def request_release(self, reason: str = "released on request") -> bool:
        """Step down voluntarily (``POST /release``, the work watchdog): unpublish, wait
        out the claims handed out, release; then sit out one lease duration. ``reason``
        goes to the state (``/status``) and the log.

        Only a holder can: False (and nothing remembered) otherwise, since a remembered
        request would end the next term right after it began.
        """
        if not self.state.facts.holding:
            return False
        self._release_requested = True
        self._release_reason = reason
        # No claim from now on: the wait for the last one starts here, not when the
        # loop gets to the step-down (after a renew in flight, a commit on a busy disk).
        self.state.update(released=True, reason=reason)
        self._wake.set()
        return True

    def request_handover(self, to: str | None = None, why: str = "request") -> bool:
        """Hand the lease over on purpose: name ``to`` as the next holder where the
        backend keeps such a hint (:class:`~sidecar.lease.Successor`), then step down as
        :meth:`request_release` does. Without ``to`` (or on a backend without hints) the
        first standby to ask wins. ``why``: one of :data:`HANDOVER_REASONS`.
        """
        if to == self.identity:
            return False
        if self.state.facts.released:
            # A step-down is under way (another hand-over, a release): one at a time,
            # else its hint and its answer would name different successors.
            return False
        reason = f"handed over to {to}" if to else "handed over"
        if why != "request":
            reason += f" ({why})"
        if not self.request_release(reason):
            return False
        self._handover = (why, to)
        return True

    def stop(self) -> None:
        """Ask the loop to end; ``run`` then unpublishes and releases.

        A flag as well as the caller's ``cancel()``: on Python 3.11 an inner
        ``asyncio.wait_for`` can swallow a cancellation that races its completion (the
        chaos harness saw SIGTERMed sidecars keep leading), so the loop checks this too.
        """
        self._stopping = True
        self._wake.set()

    def alive(self, now: float) -> bool:
        """The loop has run recently (``/healthz``)."""
        bound = max(self.timing.lease_duration, self.timing.renew_interval * 3) + 5.0
        return now - self._last_tick < bound

    # -- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while not self._stopping:
                self._last_tick = self._clock.monotonic()
                if self.state.facts.holding:
                    await self._renew_once()
                else:
                    await self._acquire_once()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        """Unpublish and release; safe to call twice and from a cancelled task. With a
        successor chooser, name the one it picks first (a hand-over, reason shutdown)."""
        if self.state.facts.holding:
            await asyncio.shield(self._stop_leading())

    async def _stop_leading(self) -> None:
        reason = "shutdown"
        if self._shutdown_successor is not None and not self.state.facts.released:
            try:
                async with asyncio.timeout(successor_choice_bound(self.timing)):
                    to = await self._shutdown_successor()
            except Exception:
                to = None
            if to is not None and to != self.identity:
                self._handover = ("shutdown", to)
                reason = f"handed over to {to} (shutdown)"
        await self._step_down(reason, release=True)

    async def _acquire_once(self) -> None:
        why_not = self._sits_out() if self._sits_out is not None else None
        if why_not is not None:
            # A wait queued in the server before the application turned not ready (the
            # advisory lock's) can be granted while we sit out, and nothing else gives
            # it back: nobody could lead for as long as the application stays not ready.
            await self._give_back(why_not)
            changed = self.state.facts.sitting_out != why_not
            self.state.update(reason=why_not, sitting_out=why_not)
            if changed:
                await self._notify()  # the pod annotation: no hand-over to us meanwhile
            await self._sleep_or_wake(self._retry_delay(), watch_lease=False)
            return
        if self.state.facts.sitting_out is not None:
            self.state.update(sitting_out=None)
            await self._notify()
        other = await self._successor_named()
        if other is not None:
            # A leader handed the lease to another standby: stay out of the race while
            # the hint lives (at most one lease duration), so the named one wins.
            self.state.update(reason=f"standing aside: the lease is being handed to {other}")
            await self._sleep_or_wake(self._retry_delay(), watch_lease=False)
            return
        sent = self._clock.monotonic()
        grant = await self._call("acquire", self.lease.try_acquire())
        if grant is not None and grant.held:
            replied = self._clock.monotonic()
            try:
                other = await self._named_other()
            except Exception:
                # The check failed after the grant, and it may have given the grant back
                # on the way (the advisory lock gives a grant to a named standby, and a
                # lost reply or this bound can cut that off): only a renew tells whether
                # the grant still stands. Led on unchecked, a grant given back ran beside
                # the named standby's (found by the simulator).
                other = None
                sent = self._clock.monotonic()
                grant = await self._call("renew", self.lease.try_renew())
                replied = self._clock.monotonic()
                if grant is None or not grant.held:
                    # Not ours to use, yet the backend may still count it as ours (the
                    # renew failed: no answer either way). Give it back: a shard's lease
                    # stays in its group's renews until released, and its elector stops
                    # once the shard is another member's, so nobody could take it
                    # (found by the simulator).
                    why = "the acquire's grant did not stand"
                    await self._give_back(why)
                    self.state.update(reason=why)
                    await self._sleep_or_wake(self._retry_delay(), watch_lease=True)
                    return
            if other is not None:
                await self._stand_aside(other)
                return
            await self._became_holder(sent, grant, replied)
            return
        if grant is not None:
            self.state.update(holder=grant.holder, reason=grant.reason or "standby")
            await self._sleep_or_wake(self._retry_delay(), watch_lease=True)
            return
        # A failed call: back off, but not past a change the backend's wake-up channel
        # (a Kubernetes watch) shows once it is back. The wait for a change starts now,
        # so a change during the first renew interval counts too; that interval is slept
        # in full, so a backend whose wait returns at once while it is down cannot spin.
        delay = self._retry_delay()
        floor = min(delay, self.timing.renew_interval)
        change = asyncio.ensure_future(self.lease.wait_for_change(delay))
        try:
            await self._sleep_or_wake(floor, watch_lease=False)
            if delay > floor and not self._wake.is_set() and not change.done():
                await first_of(self._wake.wait(), change, timeout=delay - floor)
        finally:
            change.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await change

    async def _stand_aside(self, other: str) -> None:
        """The acquire won while a hand-over names another standby: a wait queued in the
        server (the advisory lock) can be granted at the leader's release, after this
        standby last looked for a hint. Give the lease back before any claim, so the
        named one gets it."""
        why = f"standing aside: the lease is being handed to {other}"
        await self._give_back(why)
        self.state.update(reason=why)
        await self._sleep_or_wake(self._retry_delay(), watch_lease=False)

    async def _give_back(self, why: str) -> None:
        """Release whatever the backend granted this contender that it will not use (no
        claim of it was ever handed out, so no release record). Nothing to do, and no
        round trip, where nothing was granted. Bounded: a release that fails or hangs
        frees itself (the session drops, the row's TTL runs out)."""
        try:
            async with asyncio.timeout(max(1.0, self.timing.renew_interval)):
                await self.lease.release()
        except Exception as exc:
            log.warning("could not give back a lease this contender will not use", extra={
                "lease": self.state.lease, "identity": self.identity, "why": why,
                "error": str(exc) or type(exc).__name__})

    async def _became_holder(self, sent: float, grant: Grant, replied: float) -> None:
        # Validity counts from the send time (the earliest the grant can have been
        # decided); the first claim waits one horizon from the *reply* (the latest it can
        # have been decided), since an acquire may wait in the server for the release.
        # No horizon where the backend's release record shows the previous holder waited
        # out its own claims before it released (our step-down below does).
        horizon = 0.0 if grant.previous_claims_ended else self.timing.claim_horizon
        delay = max(horizon, grant.claim_delay)
        self._release_requested = False  # asked of an earlier term, which has ended
        self._handover = None
        self.state.update(
            "acquired", holding=True, released=False, claim_from=replied + delay,
            valid_until=sent + grant.valid_for, fencing_token=grant.fencing_token,
            holder=self.identity, reason="holding")
        log.info("acquired lease", extra={
            **self._fields(grant.fencing_token), "claim_delay_ms": round(delay * 1000, 1),
            "previous_claims_ended": grant.previous_claims_ended})
        # Unless recorded as over, the previous holder's last claims may still run for
        # up to one horizon (longer after a server restart or promotion). The timing
        # rules fit one horizon and a renew interval into the validity; a longer backend
        # delay is slept in renew intervals with a renew after each, so the term does not
        # run out of validity before its first claim.
        first_claim = replied + delay
        while (left := first_claim - self._clock.monotonic()) > 0:
            if left <= max(self.timing.renew_interval, self.timing.claim_horizon):
                await self._sleep_or_wake(left, watch_lease=False, watch_loss=True)
                break
            await self._sleep_or_wake(jittered(self.timing.renew_interval, RENEW_JITTER),
                                      watch_lease=False, watch_loss=True)
            if self._stopping or self._release_requested:
                return  # the loop steps down; the publishers were never told of the term
            await self._renew_now()
            if not self.state.facts.holding:
                return
        await self._notify()

    async def _renew_once(self) -> None:
        # A request that came during the previous renew is acted on now: the sleep would
        # clear its wake-up and hold it back one renew interval.
        if not self._release_requested:
            await self._sleep_or_wake(jittered(self.timing.renew_interval, RENEW_JITTER),
                                      watch_lease=False, watch_loss=True)
        if self._release_requested:
            self._release_requested = False
            await self._step_down(self._release_reason, release=True)
            await self._sleep_or_wake(self.timing.lease_duration, watch_lease=False)
            return
        await self._renew_now()

    async def _renew_now(self) -> None:
        """One renew round trip; steps down when refused or when validity ran out."""
        facts = self.state.facts
        remaining = facts.valid_until - self._clock.monotonic()
        if remaining <= 0:
            await self._step_down("lease validity ran out before a renew succeeded",
                                  release=True)
            return
        sent = self._clock.monotonic()
        try:
            async with asyncio.timeout(remaining):
                grant = await self._call("renew", self.lease.try_renew())
        except TimeoutError:
            self.state.observe_call("renew", self._clock.monotonic() - sent, "timeout")
            grant = None
        if grant is not None and grant.held:
            token = facts.fencing_token if grant.fencing_token is None else grant.fencing_token
            self.state.update(valid_until=sent + grant.valid_for, fencing_token=token)
            return
        if grant is not None and grant.release:
            await self._step_down(f"end of term: {grant.reason}", release=True)
        elif grant is not None:
            await self._step_down(f"lost lease: {grant.reason or 'renew refused'}",
                                  release=False)
        elif facts.valid_until <= self._clock.monotonic():
            await self._step_down("lease validity ran out before a renew succeeded",
                                  release=True)
        # Else: a failed renew with time left; the loop tries again.

    async def _step_down(self, reason: str, release: bool) -> None:
        token = self.state.facts.fencing_token
        self.state.update(released=True, reason=reason)
        # No claim is handed out from here on; the latest one handed out so far may
        # still run (at most one horizon, never past the lease's validity).
        outstanding = self.state.issued_until
        # A hand-over's hint is written while the publishers are told and the last
        # claim runs out, not before: the named standby then leads one claim horizon
        # after the request, plus the release's and its acquire's round trips, where the
        # backend records the release (else one horizon more: its own wait). The hint's
        # own round trips, and the advisory lock's queue, cost nothing more. Only a
        # release hands over: the hint is dropped on a loss.
        naming = asyncio.ensure_future(self._name_successor(named=release))
        waited = 0.0
        try:
            await self._notify()
            if release:
                waited = await self._claims_expired(outstanding)
            if release and self._work_stopped is not None:
                await self._work_stopped()
        finally:
            # Before the release, so that standbys see the hint before the free lease.
            await asyncio.shield(naming)
        if release:
            # A term given back before its first claim (a stop during its wait) cannot
            # vouch for the claims of the term before it: no release record then.
            record = self._clock.monotonic() >= self.state.facts.claim_from
            try:
                async with asyncio.timeout(max(1.0, self.timing.renew_interval)):
                    await self.lease.release(record=record)
            except Exception as exc:
                log.warning("release failed; the lease frees itself after its TTL",
                            extra={**self._fields(token), "error": str(exc)})
        self.state.update("lost" if not release else "released", holding=False,
                          fencing_token=None, holder=None, reason=reason)
        log.info("stepped down", extra={**self._fields(token), "reason": reason,
                                        "waited_for_claims_ms": round(waited * 1000, 1)})

    async def _name_successor(self, named: bool = True) -> None:
        """In a hand-over's step-down, before the release: count it, and leave the hint
        that names the successor (bounded; a failure only costs the preference, never
        safety). ``named`` False: the term ended otherwise; forget the hand-over."""
        handover, self._handover = self._handover, None
        if handover is None or not named:
            return
        why, to = handover
        self.state.handovers[why] = self.state.handovers.get(why, 0) + 1
        successor = successor_of(self.lease)
        if to is None or successor is None:
            return
        # The hint lives until the release (the last claim runs out), then one retry
        # interval more (a renew interval, +20 % jitter): the named standby acquires at
        # the release (woken by it) or at its next retry. One that does not come (dead,
        # sitting out, a name nobody has) holds the others back that long, not for a
        # lease duration.
        claims_left = max(0.0, self.state.issued_until - self._clock.monotonic())
        bound = min(self.timing.lease_duration,
                    claims_left + HINT_AFTER_RELEASE * self.timing.renew_interval)
        try:
            async with asyncio.timeout(max(1.0, self.timing.renew_interval * 2)):
                await successor.hand_to(to, bound)
        except Exception as exc:
            log.warning("could not name the next holder; releasing without it", extra={
                **self._fields(self.state.facts.fencing_token), "successor": to,
                "error": str(exc) or type(exc).__name__})

    async def _successor_named(self) -> str | None:
        """Before an acquire: the standby another leader handed the lease to, if not us
        (None: none, or the backend keeps no hints, or it cannot be read now). A read that
        fails counts as that acquire's failure (logged once per outage): it is the first
        call of the attempt, and a backend that blocks it (a locked SQLite file) would
        otherwise hide the outage behind its timeout."""
        started = self._clock.monotonic()
        try:
            return await self._named_other()
        except Exception as exc:
            self._failed("acquire", started, exc)
            return None

    async def _named_other(self) -> str | None:
        """What a live hand-over hint names, unless it names us (None also where the
        backend keeps no hints); raises when it cannot be read in time."""
        successor = successor_of(self.lease)
        if successor is None:
            return None
        async with asyncio.timeout(max(1.0, self.timing.renew_interval)):
            return await successor.handing_to_other()

    async def _claims_expired(self, until: float) -> float:
        """Sleep until monotonic ``until``; returns the seconds slept.

        Re-checks the clock after every sleep: a timer may fire early by the loop's
        clock resolution, and the unit tests move a fake clock while we sleep.
        """
        started = self._clock.monotonic()
        while (left := until - self._clock.monotonic()) > 0:
            await asyncio.sleep(left)
        return max(0.0, self._clock.monotonic() - started)

    async def _notify(self) -> None:
        for publisher in self.publishers:
            try:
                async with asyncio.timeout(UNPUBLISH_TIMEOUT):
                    await publisher.changed(self.state)
            except Exception as exc:
                log.warning("publisher failed", extra={
                    "lease": self.state.lease, "publisher": type(publisher).__name__,
                    "error": str(exc) or type(exc).__name__})

    async def _call(self, what: str, call: Awaitable[Grant]) -> Grant | None:
        """Run a backend call (``what``: "acquire" or "renew"); map failures to ``None``
        and log reachability changes.

        Each call that ends is timed into the state for the metrics (``sidecar.base.stats``).

        When the sidecar stops meanwhile (the runtime cancels this task), the call ends
        first, within a renew interval (at least 1 s), before the cancellation goes on.
        A write cut off in flight may still have committed, and the lease would not
        know: a renew's new version of the row (or Lease object) makes the step-down's
        release, which names the version it knows so that it never ends another term,
        match nothing; an acquire that won holds the lease for nobody. Either way nobody,
        this sidecar's successor included, could lead until the lease ran out. Run to its
        end, the renew's version is the lease's, and an acquire that won is given back
        (no claim of it was handed out). Other cancellations (the renew's own timeout)
        cut the call off at once.
        """
        started = self._clock.monotonic()
        attempt = asyncio.ensure_future(call)
        try:
            result = await asyncio.shield(attempt)
        except asyncio.CancelledError:
            if self._stopping and not attempt.done():
                # A timeout, or the call's own failure: the lease then knows what it
                # would have known anyway.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(max(1.0, self.timing.renew_interval)):
                        await attempt
            # Cut off, the call unwinds before we go on, as it did when awaited
            # directly: a release must not overtake the renew it follows.
            attempt.cancel()  # no-op once it has ended
            await asyncio.wait([attempt])
            if not attempt.cancelled() and attempt.exception() is None \
                    and what == "acquire" and attempt.result().held:
                await self._give_back("stopping")
            raise
        except Exception as exc:
            self._failed(what, started, exc)
            return None
        self.state.observe_call(what, self._clock.monotonic() - started,
                                "held" if result.held else "refused")
        if result.duplicate_identity:
            self.state.duplicate_identity += 1
        if not self.state.facts.backend_ok:
            if self._failures:
                log.info("backend reachable again", extra={
                    "lease": self.state.lease, "identity": self.identity,
                    "unreachable_for_s": round(self._clock.monotonic() - self._down_since, 1),
                    "cause": self._down_cause})
            self.state.update(backend_ok=True)
        self._failures = 0
        return result

    def _failed(self, what: str, started: float, exc: Exception) -> None:
        """A backend call failed: time it, count it, and log when reachability changes."""
        self.state.observe_call(what, self._clock.monotonic() - started, "error")
        self._failures += 1
        if self.state.facts.backend_ok or self._failures == 1:
            self._down_since = self._clock.monotonic()
            self._down_cause = str(exc) or type(exc).__name__
            # Refused is not unreachable: the fix is a permission, not the network.
            cause = "backend forbidden" if isinstance(exc, Forbidden) else \
                "backend unreachable"
            log.warning(cause, extra={
                "lease": self.state.lease, "identity": self.identity,
                "operation": what, "error": self._down_cause})
            self.state.update(backend_ok=False, reason=f"{cause}: {exc}")

    def _retry_delay(self) -> float:
        base = self.timing.renew_interval
        if self._failures:
            base = min(base * 2 ** min(self._failures - 1, 10), self.timing.lease_duration)
        return jittered(base)

    async def _sleep_or_wake(self, seconds: float, watch_lease: bool,
                             watch_loss: bool = False) -> None:
        """Sleep, but wake for a release request, (standby) a lease change, or (holder)
        the backend's word that the lease is gone (the optional ``lost`` event)."""
        self._wake.clear()
        waits: list[Awaitable[object]] = [self._wake.wait()]
        if watch_lease:
            waits.append(self.lease.wait_for_change(seconds))
        if watch_loss and self.lease.lost is not None:
            waits.append(self.lease.lost.wait())
        await first_of(*waits, timeout=seconds)

    def _fields(self, token: int | None) -> dict[str, object]:
        return {"lease": self.state.lease, "identity": self.identity,
                "fencing_token": token}
