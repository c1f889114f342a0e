"""The rollout worker (``dsec rollout-worker``): a process that claims queued rollouts from
the platform and runs their agent loops, up to ``concurrency`` at once, independently of
any trainer. It is an SDK client like any other: run it next to the apiserver, on a CPU
node, anywhere the agents' code is importable.

Ownership: a claimed rollout is leased to this worker and the lease renewed by a heartbeat
every second; the heartbeat's answer says which rollouts the worker lost (cancelled, or
taken over after a late heartbeat: their agents are cancelled) and which must hold (their
job is paused: no new step starts until it is resumed). A worker that dies leaves its
leases to run out; the platform queues those rollouts again and the next worker replays
their journals (dsec.client.rollouts.context). A clean shutdown hands its rollouts back at once.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import os
import secrets
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from pydantic import BaseModel

from dsec.client.rollouts.context import LLM, Journal, RolloutContext
from dsec.client.sdk.client import AsyncClient, AsyncSandbox
from dsec.shared.errors import AdmissionRejected, DsecError, JobNotActive, NotFound, RolloutLost, SandboxNotRunning
from dsec.shared.wire.iam import PROJECT_LABEL
from dsec.shared.wire.models import ContainerArgs, ExecRequest, SandboxState
from dsec.shared.wire.rollouts import (
    ROLLOUT_LABEL,
    Claimed,
    ClaimRequest,
    ExecStepRequest,
    FinishRequest,
    HeartbeatRequest,
    HeartbeatResult,
    RolloutInfo,
    SandboxRecord,
    Step,
    StepRequest,
)

log = logging.getLogger("dsec.rollouts.worker")
HEARTBEAT_S = 1.0
CLAIM_WAIT_S = 5.0
MAX_CLAIM = 1000  # rollouts per claim call (the API's bound)
ADMISSION_RETRY_S = 2.0
LIVE = (SandboxState.creating, SandboxState.running, SandboxState.paused)
Agent = Callable[[RolloutContext], Awaitable[Any]]


class SandboxLost(DsecError):
    """The sandbox a rollout's journal describes is gone: the rollout starts over."""

    status = 503
    code = "sandbox_lost"


@dataclass
class _Run:
    claimed: Claimed
    task: asyncio.Task[None] | None = None
    unheld: asyncio.Event = field(default_factory=asyncio.Event)
    sandbox: AsyncSandbox | None = None
    lost_state: str | None = None  # set when the platform says this worker no longer holds it
    held_s: float = 0.0  # time spent holding for a paused job: not counted against timeout_s

    def __post_init__(self) -> None:
        self.unheld.set()


def _outcome(out: Any) -> tuple[float | None, Any]:
    """The agent's return: a number is the reward; a dict (or a pydantic model) is the
    result, its "reward" the reward."""
    if isinstance(out, BaseModel):
        out = out.model_dump(mode="json")
    if isinstance(out, bool):
        return float(out), out
    if isinstance(out, int | float):
        return (float(out) if math.isfinite(out) else None), out if math.isfinite(out) else None
    if isinstance(out, dict):
        r = out.get("reward")
        reward = float(r) if isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(r) else None
        return reward, out
    return None, out


class Worker:
    def __init__(self, client: AsyncClient, *, name: str | None = None, concurrency: int = 64,
                 lease_s: float = 30.0, project: str | None = None, paths: list[str] | None = None) -> None:
        self.client = client
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.concurrency = concurrency
        self.lease_s = lease_s
        self.project = project
        self.runs: dict[str, _Run] = {}
        self.finished = 0
        self._agents: dict[str, Agent] = {}
        self._http: aiohttp.ClientSession | None = None
        # when the platform last renewed this worker's leases: past lease_s without it, another
        # worker may hold a rollout by now, so no new step starts
        self._renewed = time.monotonic()
        for p in paths or []:
            if p not in sys.path:
                sys.path.insert(0, os.path.abspath(p))

    @property
    def _params(self) -> dict[str, str] | None:
        return {"project": self.project} if self.project else None

    async def _post(self, path: str, body: BaseModel, **kw: Any) -> Any:
        return await self.client._json("POST", path, json=body.model_dump(mode="json"), params=self._params, **kw)

    # --- the loop ---

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Claim and run rollouts until ``stop`` is set; then hand back what is running."""
        stop = stop or asyncio.Event()
        self._http = aiohttp.ClientSession()
        beat = asyncio.create_task(self._heartbeats(stop))
        stopping = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                free = self.concurrency - len(self.runs)
                if free <= 0:
                    tasks = [r.task for r in self.runs.values() if r.task is not None]
                    await asyncio.wait([*tasks, stopping], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    got = await self._post("/v1/rollouts/claim", ClaimRequest(
                        worker=self.name, n=min(free, MAX_CLAIM), lease_s=self.lease_s, wait_s=CLAIM_WAIT_S),
                        timeout=CLAIM_WAIT_S + 30)
                except DsecError as e:
                    log.warning("claim failed: %s", e)
                    await _sleep_or(stop, 1.0)
                    continue
                self._renewed = time.monotonic()
                for item in got:
                    c = Claimed.model_validate(item)
                    log.info("rollout %s claimed (attempt %d, %d steps journaled)", c.rollout.id, c.attempt,
                             len(c.steps))
                    old = self.runs.get(c.rollout.id)
                    if old is not None and old.task is not None:  # this worker's own earlier attempt, lost
                        old.lost_state = "requeued"
                        old.task.cancel()
                    run = _Run(c)
                    self.runs[c.rollout.id] = run
                    run.task = asyncio.create_task(self._run(run), name=f"rollout-{c.rollout.id}")
        finally:
            beat.cancel()
            stopping.cancel()
            await self._hand_back()
            await self._http.close()

    async def _hand_back(self) -> None:
        """Shutting down: each running rollout queued again at once, journal and sandbox kept."""
        runs = list(self.runs.values())
        for r in runs:
            if r.task is not None:
                r.task.cancel()
        await asyncio.gather(*(r.task for r in runs if r.task is not None), return_exceptions=True)
        for r in runs:
            try:
                await self._finish(r, FinishRequest(worker=self.name, attempt=r.claimed.attempt, state="failed",
                                                    failure="infra", error=f"worker {self.name} shut down",
                                                    release=True))
            except DsecError as e:
                log.info("rollout %s not handed back (%s): its lease runs out", r.claimed.rollout.id, e)

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await _sleep_or(stop, HEARTBEAT_S)
            ids = list(self.runs)
            if not ids:
                self._renewed = time.monotonic()
                continue
            try:
                sent = time.monotonic()
                res = HeartbeatResult.model_validate(await self._post(
                    "/v1/rollouts/heartbeat", HeartbeatRequest(worker=self.name, ids=ids, lease_s=self.lease_s)))
                self._renewed = sent
            except Exception as e:  # never let the heartbeat die: without it every lease runs out
                log.warning("heartbeat failed: %s", e)
                continue
            for h in res.rollouts:
                run = self.runs.get(h.id)
                if run is None:
                    continue
                if not h.owned:
                    log.info("rollout %s lost (it is %s)", h.id, h.state)
                    run.lost_state = h.state or "gone"
                    if run.task is not None:
                        run.task.cancel()
                elif h.hold:
                    run.unheld.clear()
                else:
                    run.unheld.set()

    # --- one rollout ---

    async def _run(self, run: _Run) -> None:
        c = run.claimed
        rid, spec = c.rollout.id, c.spec
        assert self._http is not None
        journal = Journal(c.steps, lambda step: self._record(run, step), lambda: self._hold(run), c.attempt)
        done: FinishRequest | None = None
        try:
            started = time.monotonic()
            if spec.wants_sandbox:
                run.sandbox = await self._sandbox(run)
            llm = LLM(spec.inference, journal, self._http) if spec.inference is not None else None
            ctx = RolloutContext(rollout_id=rid, attempt=c.attempt, task=spec.task, job=spec.job, client=self.client,
                                 journal=journal, sandbox=run.sandbox, llm=llm,
                                 run=lambda step, ex: self._run_command(run, step, ex))
            agent = self._agent(spec.agent)
            out = await self._within_timeout(run, agent(ctx), started)
            reward, result = _outcome(out)
            done = FinishRequest(worker=self.name, attempt=c.attempt, state="done", reward=reward,
                                 result=_jsonable(result))
            log.info("rollout %s done in %.1f s (%d steps, %d replayed)", rid, time.monotonic() - started,
                     journal.seq, journal.replayed)
        except asyncio.CancelledError:
            if run.lost_state is not None:  # the platform took it away: forget it
                self._forget(run)
                if run.lost_state == "cancelled" and run.sandbox is not None and not spec.keep_sandbox:
                    await _stop(run.sandbox)
            raise  # else shutting down: _hand_back hands it back
        except RolloutLost:
            self._forget(run)
            return  # another worker holds it now, with the sandbox
        except TimeoutError:
            done = FinishRequest(worker=self.name, attempt=c.attempt, state="failed", failure="workload",
                                 error=f"the agent ran past the rollout's timeout_s ({spec.timeout_s:g} s)")
        except DsecError as e:
            if e.infra:
                lost = isinstance(e, SandboxLost) or await self._sandbox_lost(run)
                done = FinishRequest(worker=self.name, attempt=c.attempt, state="failed", failure="infra",
                                     error=f"{type(e).__name__}: {e}", requeue=True, reset=lost)
            else:
                done = FinishRequest(worker=self.name, attempt=c.attempt, state="failed", failure="workload",
                                     error=_tail(e))
        except Exception as e:  # the agent's own bug: the rollout failed, the worker goes on
            done = FinishRequest(worker=self.name, attempt=c.attempt, state="failed", failure="workload",
                                 error=_tail(e))
        try:
            info = await self._finish(run, done)
        except DsecError as e:  # lost, or the apiserver is away: the lease runs out, another worker finishes it
            log.warning("rollout %s: outcome not recorded: %s", rid, e)
            return
        self.finished += 1
        ended = info.state in ("done", "failed", "cancelled")
        if run.sandbox is not None and not spec.keep_sandbox and (ended or done.reset):
            await _stop(run.sandbox)

    async def _within_timeout(self, run: _Run, agent: Awaitable[Any], started: float) -> Any:
        """The agent's outcome, if this attempt ends within the spec's ``timeout_s``, not counting
        the time it held for a paused job; else TimeoutError (the agent is cancelled)."""
        task = asyncio.ensure_future(agent)
        try:
            while True:
                left = run.claimed.spec.timeout_s + run.held_s - (time.monotonic() - started)
                if left <= 0:
                    raise TimeoutError
                done, _ = await asyncio.wait([task], timeout=left)
                if done:
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _forget(self, run: _Run) -> None:
        rid = run.claimed.rollout.id
        if self.runs.get(rid) is run:  # not a later attempt of the same rollout on this worker
            del self.runs[rid]

    async def _hold(self, run: _Run) -> None:
        """Before a step. Past ``lease_s`` without a renewal, another worker may hold the
        rollout by now: no step starts (the rollout is left to whoever holds it). While the
        job is paused, wait; a sandbox the job's pause skipped (it was busy with this
        rollout's last step) is paused here, so the job holds no CPU and its memory is
        reclaimed; the job's resume resumes it."""
        if time.monotonic() - self._renewed > self.lease_s:
            raise RolloutLost(f"worker {self.name}: no lease renewal for {self.lease_s:g} s", field="worker")
        if run.unheld.is_set():
            return
        t0 = time.monotonic()
        if run.sandbox is not None:
            try:
                await run.sandbox.pause()
            except DsecError as e:  # paused already, or gone: the next step finds out
                log.debug("rollout %s: sandbox not paused: %s", run.claimed.rollout.id, e)
        await run.unheld.wait()
        run.held_s += time.monotonic() - t0

    async def _finish(self, run: _Run, req: FinishRequest) -> RolloutInfo:
        rid = run.claimed.rollout.id
        try:
            return RolloutInfo.model_validate(await self._post(f"/v1/rollouts/{rid}/finish", req))
        finally:
            self._forget(run)

    async def _record(self, run: _Run, step: Step) -> Step:
        rid = run.claimed.rollout.id
        return Step.model_validate(await self._post(f"/v1/rollouts/{rid}/steps", StepRequest(
            worker=self.name, attempt=run.claimed.attempt, step=step)))

    async def _run_command(self, run: _Run, step: Step, ex: ExecRequest) -> Step:
        """A command in the rollout's sandbox, run and journaled by the platform in one call."""
        assert run.sandbox is not None
        rid = run.claimed.rollout.id
        return Step.model_validate(await self._post(f"/v1/rollouts/{rid}/exec", ExecStepRequest(
            worker=self.name, attempt=run.claimed.attempt, sandbox_id=run.sandbox.sandbox_id, step=step, exec=ex),
            timeout=ex.timeout_s + 30))

    async def _sandbox(self, run: _Run) -> AsyncSandbox:
        """The rollout's sandbox: the one an earlier attempt made (found by its label), else a
        new one. Waits while the job is paused or its quota is full."""
        c = run.claimed
        rid, spec = c.rollout.id, c.spec
        base = spec.args or ContainerArgs()
        found = [s for s in await self.client.list(labels={ROLLOUT_LABEL: rid}) if s.state in LIVE]
        if found:
            sb = AsyncSandbox(self.client, found[0])
        elif c.steps:
            raise SandboxLost(f"the sandbox of rollout {rid} is gone: it starts over", field="sandbox")
        else:
            labels = {**base.labels, ROLLOUT_LABEL: rid, PROJECT_LABEL: c.rollout.project}
            args = base.model_copy(update={"labels": labels, "job": spec.job or base.job})
            while True:
                await run.unheld.wait()
                try:
                    if spec.snapshot is not None:
                        (sb,) = await self.client.fork(spec.snapshot, 1, args)
                    else:
                        sb = await self.client.run_container(args)
                    break
                except JobNotActive:  # paused after the claim: hold until the heartbeat says resumed
                    run.unheld.clear()
                    t0 = time.monotonic()
                    await asyncio.sleep(ADMISSION_RETRY_S)
                    run.held_s += time.monotonic() - t0
                except AdmissionRejected as e:  # the job's quota or the fleet is full: wait for room
                    log.info("rollout %s waits for room: %s", rid, e)
                    await asyncio.sleep(ADMISSION_RETRY_S)
        try:
            await self._post(f"/v1/rollouts/{rid}/sandbox", SandboxRecord(
                worker=self.name, attempt=c.attempt, sandbox_id=sb.sandbox_id))
        except BaseException:
            if not found and not spec.keep_sandbox:  # made for an attempt that is over: nobody else stops it
                await asyncio.shield(_stop(sb))
            raise
        return sb

    async def _sandbox_lost(self, run: _Run) -> bool:
        if run.sandbox is None:
            return False
        try:
            info = await run.sandbox.refresh()
        except NotFound:
            return True
        except DsecError:
            return False  # cannot tell: keep it, the next attempt looks again
        return info.state not in LIVE

    def _agent(self, ref: str) -> Agent:
        fn = self._agents.get(ref)
        if fn is None:
            module, name = ref.split(":", 1)
            try:
                fn = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError) as e:
                raise AgentNotFound(f"agent {ref!r} is not importable by worker {self.name}: {e}",
                                    field="agent") from None
            if not callable(fn):
                raise AgentNotFound(f"agent {ref!r} is not a function", field="agent")
            self._agents[ref] = fn
        return fn


class AgentNotFound(DsecError):
    status = 400
    code = "agent_not_found"


async def _stop(sb: AsyncSandbox) -> None:
    try:
        await sb.stop()
    except (NotFound, SandboxNotRunning):
        pass
    except DsecError as e:
        log.warning("sandbox %s not stopped: %s", sb.sandbox_id, e)


async def _sleep_or(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


def _tail(e: BaseException) -> str:
    text = "".join(traceback.format_exception(e))
    return text[-8000:]


def _jsonable(v: Any) -> Any:
    import json
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return repr(v)[:16384]
