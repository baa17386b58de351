"""lease-sidecar and client-go's own leader election contending for one Lease.

Used by ``tests/integration/test_clientgo_interop.py`` (a short run in CI) and
``bench/bench_clientgo_interop.py`` (more rounds, figures for docs/benchmarks.md).

One sidecar (``--backend kubernetes``) and one client-go elector
(``testkit/interop/clientgo-elector``: ``k8s.io/client-go/tools/leaderelection`` with
``resourcelock.LeaseLock`` and ``ReleaseOnCancel``, the client-go release matching the
test bed's kube-apiserver) contend for one Lease. Each round signals the holder (SIGTERM or
SIGKILL), waits for the other one to lead, and replaces the signalled process with a fresh
one of the same kind — so every takeover crosses kinds, alternating sidecar → client-go
and client-go → sidecar.

Claims are compared on one clock (wall time; every process runs on this host):

- a sidecar's: every ``200`` from ``GET /leader`` and every read of its leader file that
  says leader, each as [moment asked, ``valid_until``], sampled every ~10 ms;
- a client-go elector's: [``OnStartedLeading``, ``OnStoppedLeading``] (client-go calls the
  latter after its release on cancel has been written); a SIGKILLed holder never calls it
  and counts as leading until the lease it last wrote runs out by client-go's own rules:
  its ``renewTime`` + ``leaseDurationSeconds``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sidecar.lease.kubernetes.record import fencing_token
from testkit.kube_support import sidecar
from testkit.support import SidecarProcess, get_json, unix_time, wait_until

LEASE = "interop"  # lease-sidecar's name; the Lease object is lease-sidecar.interop
OBJECT = f"lease-sidecar.{LEASE}"
# Both sides use a 3 s lease. The sidecar keeps its defaults for everything the issue is
# about (safety margin 1 s, claim horizon 250 ms) and renews every 500 ms, more often than
# client-go's one-second view of the record can tell apart. client-go retries every
# 100 ms (its standbys poll; they do not watch), so it takes a released lease over within
# one claim horizon most of the time: the case that overlapped before the release rule.
SIDECAR_ARGS = ["--pod-label", "off"]
CLIENTGO_ARGS = ["-lease-duration", "3s", "-renew-deadline", "2s", "-retry-period", "100ms"]


@dataclass
class GoElector:
    """One clientgo-elector process; its JSON lines go to a file."""

    binary: Path
    workdir: Path
    identity: str
    namespace: str
    kubeconfig: Path
    extra_args: tuple[str, ...] = ()  # e.g. ("-coordinated",)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def out_path(self) -> Path:
        return self.workdir / f"{self.identity}.jsonl"

    def start(self) -> GoElector:
        with self.out_path.open("wb") as out, \
                (self.workdir / f"{self.identity}.log").open("wb") as err:
            self.proc = subprocess.Popen(
                [str(self.binary), "-kubeconfig", str(self.kubeconfig),
                 "-namespace", self.namespace, "-lease", OBJECT, "-identity", self.identity,
                 *CLIENTGO_ARGS, *self.extra_args], stdout=out, stderr=err)
        return self

    def events(self) -> list[dict[str, Any]]:
        if not self.out_path.exists():
            return []
        found = []
        for line in self.out_path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written right now
                found.append(json.loads(line))
        return found

    def first(self, event: str) -> dict[str, Any] | None:
        return next((e for e in self.events() if e["event"] == event), None)

    def leading(self) -> bool:
        return self.first("started") is not None and self.first("stopped") is None

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def claim(self) -> tuple[float, float] | None:
        """[started, stopped], or until its last written lease ran out if it never
        stopped (SIGKILL); None if it never led."""
        events = self.events()
        started = next((e["at"] for e in events if e["event"] == "started"), None)
        if started is None:
            return None
        stopped = next((e["at"] for e in events if e["event"] == "stopped"), None)
        if stopped is not None:
            return started, stopped
        wrote = [e for e in events if e["event"] == "wrote"]
        assert wrote, f"{self.identity} led without a write of its own"
        return started, wrote[-1]["renew_time"] + wrote[-1]["lease_seconds"]

    def token(self) -> int | None:
        """Its term's token as lease-sidecar counts them: 2**52 + the resourceVersion of
        its acquiring write (sidecar.lease.kubernetes.record.fencing_token)."""
        wrote = self.first("wrote")
        return None if wrote is None else fencing_token(str(wrote["resource_version"]))


@dataclass
class ClaimSampler:
    """Asks every registered sidecar for its claim every ~10 ms, over HTTP and its file."""

    claims: list[tuple[str, float, float]] = field(default_factory=list)
    # (identity, fencing token) -> when a claim with that token was first seen
    terms: dict[tuple[str, int], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def add(self, proc: SidecarProcess) -> None:
        thread = threading.Thread(target=self._poll, args=(proc,), daemon=True)
        self._threads.append(thread)
        thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)

    def _keep(self, proc: SidecarProcess, asked: float, body: dict[str, Any]) -> None:
        with self._lock:
            self.claims.append((proc.identity, asked, unix_time(body["valid_until"])))
            self.terms.setdefault((proc.identity, int(body["fencing_token"])), asked)

    def _poll(self, proc: SidecarProcess) -> None:
        leader_file = proc.state_dir / "leader"
        while not self._stop.is_set() and (proc.proc is None or proc.proc.poll() is None):
            asked = time.time()
            status, body, _ = get_json(proc.url + "/leader", timeout=0.5)
            if status == 200:
                self._keep(proc, asked, body)
            asked = time.time()
            try:
                body = json.loads(leader_file.read_text())
            except (OSError, ValueError):
                body = None
            if body and body.get("leader"):
                self._keep(proc, asked, body)
            time.sleep(0.01)

    def first_claim(self, identity: str, after: float = 0.0) -> float | None:
        with self._lock:
            times = [asked for who, asked, _ in self.claims if who == identity and asked >= after]
        return min(times) if times else None

    def intervals(self) -> dict[str, list[tuple[float, float]]]:
        """Per sidecar: its sampled claims, those that touch merged into one interval."""
        merged: dict[str, list[tuple[float, float]]] = {}
        with self._lock:
            samples = sorted(self.claims, key=lambda claim: claim[1])
        for who, asked, until in samples:
            spans = merged.setdefault(who, [])
            if spans and asked <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], until))
            else:
                spans.append((asked, until))
        return merged


@dataclass
class Takeover:
    signal: str
    direction: str  # "sidecar->client-go" or "client-go->sidecar"
    old: str
    new: str
    seconds: float  # signal -> the new holder's first claim (sampled) or OnStartedLeading


@dataclass
class Contest:
    """One sidecar and one client-go elector at a time on one Lease; see the module doc."""

    workdir: Path
    namespace: str
    kubeconfig: Path
    elector_binary: Path
    sampler: ClaimSampler = field(default_factory=ClaimSampler)
    sidecars: list[SidecarProcess] = field(default_factory=list)
    electors: list[GoElector] = field(default_factory=list)
    takeovers: list[Takeover] = field(default_factory=list)
    exit_codes: dict[str, int | None] = field(default_factory=dict)

    def new_sidecar(self) -> SidecarProcess:
        proc = sidecar(self.workdir, f"sidecar-{len(self.sidecars)}", self.namespace,
                       self.kubeconfig, *SIDECAR_ARGS, lease=LEASE).start()
        self.sidecars.append(proc)
        proc.wait_http()
        self.sampler.add(proc)
        return proc

    def new_elector(self) -> GoElector:
        proc = GoElector(self.elector_binary, self.workdir, f"client-go-{len(self.electors)}",
                         self.namespace, self.kubeconfig).start()
        self.electors.append(proc)
        return proc

    def start(self) -> None:
        """The sidecar first, so it leads; then the client-go standby."""
        leader = self.new_sidecar()
        wait_until(lambda: self.sampler.first_claim(leader.identity), timeout=20)
        self.new_elector()

    def holder(self) -> SidecarProcess | GoElector:
        sidecar_, elector = self.sidecars[-1], self.electors[-1]
        if elector.leading():
            return elector
        assert sidecar_.leader() == 200, "nobody leads"
        return sidecar_

    def round(self, sig: signal.Signals, settle: float = 0.5, timeout: float = 15.0) -> None:
        """Signal the holder; wait for the other one to lead; replace the signalled one."""
        old = self.holder()
        time.sleep(settle)  # the standby has watched / polled the lease for a while
        signalled = time.time()
        old.signal(sig)
        if isinstance(old, GoElector):
            new: SidecarProcess | GoElector = self.sidecars[-1]
            led = wait_until(lambda: self.sampler.first_claim(new.identity, signalled),
                             timeout=timeout, interval=0.005)
            direction = "client-go->sidecar"
        else:
            new = self.electors[-1]
            led = wait_until(lambda: (self.electors[-1].first("started") or {}).get("at"),
                             timeout=timeout, interval=0.005)
            direction = "sidecar->client-go"
        self.takeovers.append(Takeover(sig.name, direction, old.identity, new.identity,
                                       led - signalled))
        assert old.proc is not None
        self.exit_codes[old.identity] = old.proc.wait(15)
        if isinstance(old, GoElector):
            self.new_elector()
        else:
            self.new_sidecar()

    def stop(self) -> None:
        for proc in [*self.sidecars, *self.electors]:
            code = proc.stop()
            self.exit_codes.setdefault(proc.identity, code)
        self.sampler.stop()

    # -- what the run showed -----------------------------------------------------------
    def claims(self) -> dict[str, list[tuple[float, float]]]:
        spans = self.sampler.intervals()
        for elector in self.electors:
            span = elector.claim()
            if span is not None:
                spans[elector.identity] = [span]
        return spans

    def overlaps(self) -> list[tuple[str, str, float]]:
        """Every pair of claims of two contenders that overlap, with the overlap (s)."""
        flat = sorted(((start, end, who) for who, spans in self.claims().items()
                       for start, end in spans))
        found = []
        for i, (_, end1, first) in enumerate(flat):
            for start2, end2, second in flat[i + 1:]:
                if start2 >= end1:
                    break
                if second != first:
                    found.append((first, second, min(end1, end2) - start2))
        return found

    def tokens_by_term(self) -> list[tuple[float, str, int]]:
        """(term start, contender, token), in the order the terms began: a sidecar's as it
        published it, client-go's as a sidecar would count it (its acquiring write's
        resourceVersion above 2**52)."""
        terms = [(at, who, token) for (who, token), at in self.sampler.terms.items()]
        for elector in self.electors:
            span, token = elector.claim(), elector.token()
            if span is not None and token is not None:
                terms.append((span[0], elector.identity, token))
        return sorted(terms)
