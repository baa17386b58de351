"""A hard kube-apiserver restart on the test bed's control plane, for the chaos harness.

``tests/testbed/kube.py`` starts and stops the whole control plane but has no restart of
one component, and the harness may not edit it; this module does the restart from the
outside, using the ``ControlPlane``'s own pieces: the running process in ``_procs``, the
command line from ``_apiserver_args()`` (same port, same etcd, same PKI and
ServiceAccount signing key, so every issued token and kubeconfig stays valid) and its
``_wait_http`` readiness check. Relying on those private members is the price of not
touching the test bed; a ``restart_apiserver()`` there would replace this file.
"""

from __future__ import annotations

import subprocess
import time

from tests.testbed.kube import ControlPlane, ControlPlaneError

APISERVER = "kube-apiserver"
# Go sets SO_REUSEADDR, so the port is free again at once; anything else that grabbed it
# in between shows up as "address already in use" and is retried a few times.
BIND_ATTEMPTS = 5


def kill(cp: ControlPlane) -> None:
    """SIGKILL kube-apiserver (no graceful shutdown, like a crashed node); etcd stays."""
    for entry in list(cp._procs):
        name, proc = entry
        if name == APISERVER:
            proc.kill()
            proc.wait(timeout=10)
            cp._procs.remove(entry)


def start(cp: ControlPlane) -> None:
    """Start kube-apiserver again on the same port and wait until /readyz answers."""
    for attempt in range(BIND_ATTEMPTS):
        log = cp.workdir / f"{APISERVER}.log"
        # Append: the log keeps every incarnation (ControlPlane._spawn would truncate it).
        with log.open("ab") as fh:
            fh.write(f"\n--- chaos restart at {time.time():.3f} ---\n".encode())
            fh.flush()
            # No parent-death signal here: PR_SET_PDEATHSIG fires when the *thread* that
            # spawned the child exits, and the harness restarts from a worker thread, so
            # the restarted apiserver died with that thread (CI saw every later kube test
            # refused). ControlPlane.stop() still ends it through ``_procs``.
            proc = subprocess.Popen(cp._apiserver_args(), stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=cp.workdir)
        cp._procs.append((APISERVER, proc))  # so ControlPlane.stop() ends it
        try:
            cp._wait_http(APISERVER, proc, f"{cp.server}/readyz", ssl_ctx=cp.admin_ssl_context())
            return
        except ControlPlaneError as exc:
            kill(cp)
            if "address already in use" not in str(exc) or attempt == BIND_ATTEMPTS - 1:
                raise
            time.sleep(0.5)


def restart(cp: ControlPlane, down_for: float) -> None:
    kill(cp)
    time.sleep(down_for)
    start(cp)
