"""lease-sidecar next to the reference implementation: client-go's own leader election.

A sidecar and a client-go elector (LeaseLock, ReleaseOnCancel; the client-go release that
matches the test bed's kube-apiserver) contend for one Lease on the real apiserver, both
as the ServiceAccount of deploy/rbac.yaml. The holder is SIGTERMed or SIGKILLed in a
bounded loop and replaced, so takeovers alternate sidecar → client-go → sidecar; see
testkit/clientgo_support.py for how each side's claims are measured.

Before the release rule (a holder waits out the claims it handed out before it releases),
this test failed: client-go started leading up to one claim horizon before the
sidecar's last ``valid_until``.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from testkit.clientgo_support import OBJECT, Contest
from testkit.kube_support import install_rbac, lease_spec
from testkit.testbed.kube import ControlPlane

pytestmark = [pytest.mark.kube, pytest.mark.slow]

# Holders alternate kinds, starting with the sidecar: four SIGTERM handovers each way,
# then one SIGKILL takeover each way.
ROUNDS = (signal.SIGTERM,) * 8 + (signal.SIGKILL,) * 2


def test_sidecars_and_clientgo_electors_never_lead_at_once(
    control_plane: ControlPlane, kube_namespace: str, clientgo_elector: Path, tmp_path: Path
) -> None:
    kubeconfig = install_rbac(control_plane, kube_namespace, (OBJECT,))
    # Someone else's metadata on the Lease: both kinds of contender must keep it.
    control_plane.kubectl("-n", kube_namespace, "apply", "-f", "-", input=json.dumps({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": OBJECT, "labels": {"team": "payments"},
                     "annotations": {"example.com/owner": "interop-test"}},
        "spec": {}}))
    contest = Contest(tmp_path, kube_namespace, kubeconfig, clientgo_elector)
    started = time.monotonic()
    try:
        contest.start()
        for sig in ROUNDS:
            contest.round(sig)
        time.sleep(0.5)
    finally:
        contest.stop()
    took = time.monotonic() - started

    report = "\n".join(f"  {t.signal} {t.direction}: {t.old} -> {t.new} led after "
                       f"{t.seconds * 1000:.0f} ms" for t in contest.takeovers)
    print(f"\ntakeovers ({took:.0f}s):\n{report}")  # shown with -s
    # Every holder's claims were seen, or "no overlap" would prove nothing.
    claims = contest.claims()
    for takeover in contest.takeovers:
        assert claims.get(takeover.old) and claims.get(takeover.new), (takeover, claims)
    overlaps = contest.overlaps()
    assert not overlaps, "claims overlapped:\n" + "\n".join(
        f"  {a} and {b}: {seconds * 1000:.1f} ms" for a, b, seconds in overlaps) + \
        f"\ntakeovers:\n{report}"

    directions = Counter((t.signal, t.direction) for t in contest.takeovers)
    for sig in ("SIGTERM", "SIGKILL"):
        for direction in ("sidecar->client-go", "client-go->sidecar"):
            assert directions[(sig, direction)] >= 1, f"no {sig} {direction}:\n{report}"

    # SIGTERM means a clean exit on both sides (sidecar: unpublish, wait, release).
    for takeover in contest.takeovers:
        if takeover.signal == "SIGTERM":
            assert contest.exit_codes[takeover.old] == 0, (takeover, contest.exit_codes)

    # The fencing token only grows, whoever holds the lease (client-go's terms counted as
    # a sidecar counts them: the acquiring write's resourceVersion).
    terms = contest.tokens_by_term()
    tokens = [token for _, _, token in terms]
    assert len(terms) >= len(ROUNDS) + 1
    assert tokens == sorted(set(tokens)), terms

    obj = json.loads(control_plane.kubectl("-n", kube_namespace, "get", "lease", OBJECT,
                                           "-o", "json").stdout)
    assert obj["metadata"]["labels"]["team"] == "payments"
    assert obj["metadata"]["annotations"]["example.com/owner"] == "interop-test"
    assert lease_spec(control_plane, kube_namespace, "interop")["leaseTransitions"] >= len(terms)
    assert took < 110, f"the interop run took {took:.0f}s"
