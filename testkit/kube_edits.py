"""Foreign writes to a held Lease, as an operator makes them: one trial each, for
tests/integration/test_kubernetes_foreign_writes.py (2 trials) and
bench/bench_kubernetes_foreign.py (10 trials, figures).

A trial finds the one leader among running sidecars, starts a :class:`ClaimRecorder`
(every sidecar's ``/leader`` polled about every 10-20 ms), makes the write with
``kubectl`` as admin, and watches until leadership has settled. It reports what a test
asserts and a bench prints: the overlapping claims (must be none), the token order, how
long the old holder kept claiming in its term after the write (``stepped_down_s``; a
holder that won the next term itself, as any contender may after a deletion, still
stepped down), and when the next leader's first claim came (``next_leader_s``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from testkit.kube_support import leaders
from testkit.support import ClaimRecorder, SidecarProcess, get_json, wait_until
from testkit.testbed.kube import ControlPlane

OBJECT = "lease-sidecar.jobs"


@dataclass
class Trial:
    edit: str
    holder: str
    overlaps: int
    token_regressions: int
    tokens_before: list[int]
    token_after: int | None
    stepped_down_s: float | None  # None: the holder kept leading (as it should for some)
    next_leader: str | None
    next_leader_s: float | None
    notes: list[str] = field(default_factory=list)


def patch(cp: ControlPlane, namespace: str, spec: dict[str, object]) -> None:
    cp.kubectl("-n", namespace, "patch", "lease", OBJECT, "--type", "merge",
               "-p", json.dumps({"spec": spec}))


def published_token(proc: SidecarProcess) -> int:
    return int(get_json(proc.url + "/leader")[1]["fencing_token"])


# edit name -> (what it does to the Lease, given the holder and a standby)
Edit = Callable[[ControlPlane, str, SidecarProcess, SidecarProcess], None]
EDITS: dict[str, Edit] = {
    "holder-cleared": lambda cp, ns, holder, standby: patch(cp, ns, {"holderIdentity": None}),
    # Looks like a release (as client-go's and ours), but carries no release record.
    "released-by-hand": lambda cp, ns, holder, standby: patch(
        cp, ns, {"holderIdentity": None, "leaseDurationSeconds": 1}),
    "holder-to-standby": lambda cp, ns, holder, standby: patch(
        cp, ns, {"holderIdentity": standby.identity}),
    "duration-1s": lambda cp, ns, holder, standby: patch(cp, ns, {"leaseDurationSeconds": 1}),
    "deleted": lambda cp, ns, holder, standby: cp.kubectl(
        "-n", ns, "delete", "lease", OBJECT),
}


def run_trial(cp: ControlPlane, namespace: str, procs: list[SidecarProcess], edit: str,
              settle: float = 5.0,
              after_edit: Callable[[], SidecarProcess | None] | None = None) -> Trial:
    """One foreign write against a settled trio; ``after_edit`` may start a newcomer
    (returned, to be polled too). Ends when one sidecar has led for a while again, at
    most ``settle`` seconds after the write plus 2 s."""
    holder = wait_until(lambda: (found := leaders(procs)) and len(found) == 1 and found[0],
                        timeout=15)
    standby = next(p for p in procs if p is not holder)
    polled = [p for p in procs if p.proc is not None and p.proc.poll() is None]
    recorder = ClaimRecorder(polled)
    with recorder:
        time.sleep(0.3)  # a few claims before the write
        before = [t for _, _, t in recorder.tokens]
        written = time.time()
        EDITS[edit](cp, namespace, holder, standby)
        newcomer = after_edit() if after_edit is not None else None
        if newcomer is not None:
            newcomer.wait_http()
            recorder.add(newcomer)
        deadline = written + settle + 2.0
        # Settled: somebody leads, and has for half a second.
        while time.time() < deadline:
            now = time.time()
            recent = [c for c in recorder.claims if c[1] > now - 0.5]
            if (now - written > 1.0 and recent and len({c[0] for c in recent}) == 1
                    and min(c[1] for c in recent) < now - 0.4):
                break
            time.sleep(0.05)
        time.sleep(0.3)
    claims = sorted(recorder.claims, key=lambda c: c[1])
    after = [c for c in claims if c[1] > written]
    held_on = [c for c in after if c[0] == holder.identity]
    others = [c for c in after if c[0] != holder.identity]
    # The old holder's last claim before anyone else's first: how long it kept claiming.
    first_other = others[0][1] if others else None
    last_own = max((c[1] for c in held_on if first_other is None or c[1] < first_other),
                   default=None)
    kept_leading = bool(held_on) and held_on[-1][1] > time.time() - 1.5 and not others
    # The next leader's token (the holder's own, if it kept leading).
    tokens_after = [t for at, who, t in sorted(recorder.tokens) if at > written
                    and (who != holder.identity or kept_leading)]
    # The holder may win the next term itself (a deleted object anyone may re-create):
    # it leads at the end, but with a new term's token. Its term still ended: when its
    # last claim with a token from before the write did.
    own_next_term = kept_leading and bool(tokens_after) and tokens_after[-1] not in before
    if own_next_term:
        last_own = max((at for at, who, t in recorder.tokens
                        if who == holder.identity and at > written and t in before),
                       default=None)
    return Trial(
        edit=edit, holder=holder.identity, overlaps=len(recorder.overlaps()),
        token_regressions=len(recorder.token_regressions()), tokens_before=sorted(set(before)),
        token_after=tokens_after[-1] if tokens_after else None,
        stepped_down_s=None if kept_leading and not own_next_term else (
            0.0 if last_own is None else round(last_own - written, 3)),
        next_leader=others[0][0] if others else (holder.identity if kept_leading else None),
        next_leader_s=round(first_other - written, 3) if first_other else None)
