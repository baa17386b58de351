"""Runs N real sidecar processes for one lease, injects seeded faults, records, checks.

The run:
1. provision the backend environment; start N ``python -m sidecar run`` processes
   (identities ``chaos-0`` …) and the recorder; wait for the first leader;
2. until ``duration`` (or ``max_faults``): pick a fault from the seeded schedule, inject
   it, pause, then wait for a leader before the next one — pacing, so every gap has a
   cause and takeover latency is measurable per fault. Recoveries run on their own: a
   SIGSTOPped sidecar gets SIGCONT after its stop time, a killed or terminated one is
   restarted with the same identity (same port, same state dir) after a random delay;
3. a quiet tail (no new faults, every recovery done, the last fault's bound elapsed),
   so a system that never recovers is caught;
4. stop the recorder, then everything else, and judge the recording.

At most ``max_down`` sidecars are dead or frozen at once, so a majority can always
take over; a fault whose target set is empty is not drawn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit.chaos.backends import LEASE_NAME, BackendEnv, ChaosTiming
from testkit.chaos.checker import Verdict, check
from testkit.chaos.faults import BACKEND_FAULTS, NETWORK_FAULTS, PROCESS_FAULTS, Fault, Schedule
from testkit.chaos.recorder import Recorder, Target
from testkit.support import SidecarProcess

FIRST_LEADER_TIMEOUT = 60.0
EXIT_TIMEOUT = 10.0
OBSERVER_NICE = 5


@dataclass
class Member:
    """One contender across restarts: same identity, port and state dir."""

    index: int
    process: SidecarProcess
    status: str = "up"  # up | stopped | dead
    disturbed_until: float = 0.0  # a network fault on its path is active until then
    restarts: int = 0
    exit_codes: list[int | None] = field(default_factory=list)

    @property
    def identity(self) -> str:
        return self.process.identity


@dataclass
class Config:
    backend: str
    seed: int
    duration: float
    faults: tuple[str, ...]
    sidecars: int = 5
    max_faults: int | None = None
    max_down: int = 2
    leader_bias: float = 0.5
    timing: ChaosTiming = field(default_factory=ChaosTiming)
    workdir: Path | None = None


@dataclass
class Result:
    config: Config
    verdict: Verdict
    faults: list[Fault]
    recorder: Recorder
    begin: float
    end: float
    members: list[Member]
    notes: list[str]
    workdir: Path


def _raise_priority() -> int:
    """Let the recorder sample on time under load (root only); returns the old nice."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, base - OBSERVER_NICE)
    return base


class Harness:
    def __init__(self, config: Config, env: BackendEnv) -> None:
        unsupported = set(config.faults) - set(env.faults)
        if unsupported:
            raise ValueError(f"{env.name} does not support faults: {sorted(unsupported)}")
        self.config = config
        self.env = env
        self.schedule = Schedule(config.seed, config.faults, config.timing.lease_duration,
                                 config.leader_bias)
        self.workdir = config.workdir or Path(tempfile.mkdtemp(prefix=f"chaos-{env.name}-"))
        self.members: list[Member] = []
        self.faults: list[Fault] = []
        self.notes: list[str] = []
        self._recoveries: set[asyncio.Task[None]] = set()
        self._base_nice = 0

    # -- the run -----------------------------------------------------------------------
    async def run(self) -> Result:
        cfg = self.config
        await self.env.setup(self.workdir, cfg.sidecars)
        recorder: Recorder | None = None
        try:
            self._base_nice = _raise_priority()
            for i in range(cfg.sidecars):
                process = self._spawn(SidecarProcess(self.workdir, f"chaos-{i}",
                                                     args=self._args(),
                                                     env=self.env.sidecar_env(i)))
                self.members.append(Member(i, process))
            recorder = Recorder([Target(m.identity, m.process.url,
                                        m.process.state_dir / "leader")
                                 for m in self.members], cfg.timing.claim_horizon)
            await recorder.start()
            if not await self._wait_leader(recorder, FIRST_LEADER_TIMEOUT):
                raise RuntimeError(f"no leader within {FIRST_LEADER_TIMEOUT}s; logs in "
                                   f"{self.workdir}")
            begin = time.time()
            while time.time() < begin + cfg.duration and (
                    cfg.max_faults is None or len(self.faults) < cfg.max_faults):
                fault = await self._inject_next(recorder)
                if fault is None:  # nothing may be hit now; let recoveries catch up
                    await asyncio.sleep(0.05)
                    continue
                await asyncio.sleep(max(self.schedule.pause(),
                                        2 * cfg.timing.claim_horizon))
                if not await self._wait_leader(recorder, fault.bound + 5.0):
                    self.notes.append(f"no leader within bound after fault #{fault.index}")
            end = await self._quiet_tail()
            await recorder.stop()
            self._save_trace(recorder)
            verdict = check(recorder.spans, self.faults, begin, end, recorder.file_reads,
                            ambient=cfg.timing.lease_duration)
            return Result(cfg, verdict, self.faults, recorder, begin, end, self.members,
                          self.notes + recorder.anomalies, self.workdir)
        finally:
            if recorder is not None:
                await recorder.stop()
            await self._shutdown()
            await self.env.teardown()

    def _save_trace(self, recorder: Recorder) -> None:
        """Every observed claim, for digging into a violation after the run."""
        with open(self.workdir / "claims.jsonl", "w") as out:
            for span in recorder.spans:
                out.write(json.dumps(vars(span)) + "\n")

    def _spawn(self, process: SidecarProcess) -> SidecarProcess:
        process.start()
        assert process.proc is not None
        with contextlib.suppress(OSError):  # children compete as equals, not as observers
            os.setpriority(os.PRIO_PROCESS, process.proc.pid, self._base_nice)
        return process

    def _args(self) -> list[str]:
        return ["--name", LEASE_NAME, "--log-level", "info", *self.config.timing.args()]

    async def _wait_leader(self, recorder: Recorder, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if recorder.leader_now() is not None:
                return True
            await asyncio.sleep(0.01)
        return False

    async def _quiet_tail(self) -> float:
        """No more faults; wait for every recovery and the last fault's bound."""
        if self._recoveries:
            await asyncio.wait(self._recoveries, timeout=60.0)
        last = max((f.at + f.bound for f in self.faults), default=time.time())
        await asyncio.sleep(max(1.0, last - time.time() + 1.0))
        return time.time()

    # -- faults ------------------------------------------------------------------------
    def _candidates(self, kind: str) -> list[Member]:
        now = time.time()
        up = [m for m in self.members if m.status == "up"]
        if kind in PROCESS_FAULTS:
            down = len(self.members) - len(up)
            return up if down < self.config.max_down else []
        if kind in NETWORK_FAULTS:
            return [m for m in up if m.disturbed_until <= now]
        return []

    async def _inject_next(self, recorder: Recorder) -> Fault | None:
        allowed = tuple(k for k in self.config.faults
                        if k in BACKEND_FAULTS or self._candidates(k))
        if not allowed:
            return None
        kind = self.schedule.kind(allowed)
        leader = recorder.leader_now()
        params: dict[str, Any] = self.schedule.params(kind)
        if kind == "backend-restart":
            fault = Fault(len(self.faults), kind, time.time(), "backend", leader, params)
            await self.env.restart(params["down_for"])
            fault.ended = time.time()
        elif kind == "foreign-write":
            others = sorted(m.identity for m in self.members if m.identity != leader)
            params["standby"] = self.schedule.rng.choice(others) if others else ""
            fault = Fault(len(self.faults), kind, time.time(), "backend", leader, params)
            await self.env.foreign_write(params["edit"], params["standby"])
            fault.ended = time.time()
        elif kind == "failover":
            # On the promoted server first: a leader of the old primary that still claims
            # (its path went silent) is no handover to make during the next lag.
            await self._settle_after_failover(recorder)
            leader = recorder.leader_now()
            fault = Fault(len(self.faults), kind, time.time(), "backend", leader, params)
            await self.env.lag()
            params["handed_over"] = await self._hand_over(recorder, params["handovers"])
            params["killed_at"] = time.time()
            params["timeline"] = await self.env.fail_over(params["promote_after"])
            fault.ended = params["promoted_at"] = time.time()
        else:
            by_name = {m.identity: m for m in self._candidates(kind)}
            target = by_name[self.schedule.target(sorted(by_name), leader)]
            fault = Fault(len(self.faults), kind, time.time(), target.identity, leader, params)
            self._hit(target, fault)
        fault.bound = self.env.bound(fault)
        fault.overlap_bound = self.env.overlap_bound(fault)
        self.faults.append(fault)
        return fault

    def _hit(self, member: Member, fault: Fault) -> None:
        p = fault.params
        if fault.kind == "sigkill":
            member.process.signal(signal.SIGKILL)
            member.status = "dead"
            self._recover(self._restart(member, p["restart_after"], expect=None))
        elif fault.kind == "sigterm":
            member.process.signal(signal.SIGTERM)
            member.status = "dead"
            self._recover(self._restart(member, p["restart_after"], expect=0))
        elif fault.kind == "sigstop":
            member.process.signal(signal.SIGSTOP)
            member.status = "stopped"
            self._recover(self._cont(member, p["stopped_for"]))
        else:
            proxy = self.env.proxy(member.index)
            assert proxy is not None
            if fault.kind == "cut":
                p["connections"] = proxy.cut(p["refuse_for"])
                member.disturbed_until = fault.at + p["refuse_for"]
            elif fault.kind == "latency":
                proxy.add_latency(p["delay"], p["for"])
                member.disturbed_until = fault.at + p["for"]
            elif fault.kind == "partition":
                proxy.partition(p["for"])
                member.disturbed_until = fault.at + p["for"]

    async def _settle_after_failover(self, recorder: Recorder) -> None:
        """Until every claim of the last failover's old primary has run out and a leader
        claims (bounded: a leaderless system shows as a gap anyway)."""
        t = self.config.timing
        last = max((f.ended or f.at for f in self.faults if f.kind == "failover"),
                   default=0.0)
        await asyncio.sleep(max(0.0, last + t.lease_duration + t.renew_deadline - time.time()))
        await self._wait_leader(recorder, 2 * t.lease_duration + 5.0)

    async def _hand_over(self, recorder: Recorder, times: int) -> int:
        """``POST /release`` to the leader, then wait for another one; how many handovers
        happened (each bounded in time)."""
        done = 0
        by_name = {m.identity: m for m in self.members}
        bound = 2 * self.config.timing.lease_duration + 3.0
        for _ in range(times):
            await self._wait_leader(recorder, bound)
            leader = recorder.leader_now()
            if leader is None or by_name[leader].status != "up":
                break
            await asyncio.to_thread(by_name[leader].process.release)
            deadline = time.monotonic() + bound
            while time.monotonic() < deadline:
                now = recorder.leader_now()
                if now is not None and now != leader:
                    done += 1
                    break
                await asyncio.sleep(0.01)
        return done

    def _recover(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    async def _cont(self, member: Member, after: float) -> None:
        await asyncio.sleep(after)
        member.process.signal(signal.SIGCONT)
        member.status = "up"

    async def _restart(self, member: Member, after: float, expect: int | None) -> None:
        old = member.process
        code = await self._reap(old)
        member.exit_codes.append(code)
        if expect is not None and code != expect:
            self.notes.append(f"{old.identity} exited {code} on SIGTERM (expected {expect})")
        await asyncio.sleep(after)
        member.process = self._spawn(SidecarProcess(self.workdir, old.identity, args=old.args,
                                                    env=old.env, port=old.port))
        member.restarts += 1
        # Up (a fault target again) once it serves HTTP: a SIGTERM before Python has
        # installed its handler would only test the interpreter's default action.
        try:
            await asyncio.to_thread(member.process.wait_http, 30.0)
        except (RuntimeError, TimeoutError) as exc:
            self.notes.append(f"{old.identity} did not come back: {str(exc)[:200]}")
            return
        member.status = "up"

    async def _reap(self, process: SidecarProcess) -> int | None:
        """Wait for the process to exit (SIGKILL it if SIGTERM did not end it in time)."""
        assert process.proc is not None
        try:
            code = await asyncio.wait_for(asyncio.to_thread(process.proc.wait), EXIT_TIMEOUT)
        except TimeoutError:
            dump = await asyncio.to_thread(self._stack_dump, process)
            self.notes.append(f"{process.identity} ignored SIGTERM for {EXIT_TIMEOUT}s"
                              f"{f' (stacks: {dump})' if dump else ''}")
            process.proc.kill()
            code = await asyncio.to_thread(process.proc.wait)
        process.stop()  # closes its log file
        return code

    def _stack_dump(self, process: SidecarProcess) -> Path | None:
        """Where a hung sidecar is stuck, if py-spy is installed (diagnostics only)."""
        assert process.proc is not None
        if shutil.which("py-spy") is None:
            return None
        path = self.workdir / f"{process.identity}-hang-{process.proc.pid}.txt"
        with open(path, "w") as out:
            subprocess.run(["py-spy", "dump", "--locals", "--pid", str(process.proc.pid)],
                           stdout=out, stderr=subprocess.STDOUT, timeout=30, check=False)
        return path

    async def _shutdown(self) -> None:
        for task in list(self._recoveries):
            task.cancel()
        for task in list(self._recoveries):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await asyncio.gather(*(asyncio.to_thread(m.process.stop) for m in self.members),
                             return_exceptions=True)
