"""Rollouts (docs/rl.md, "Rollouts that outlive the trainer"): the trainer's side (submit by
key, list, counts, wait for finished ones, get a trajectory, ack, cancel) and the rollout
workers' side (claim with a lease, heartbeat, journal a step, record the sandbox, finish).
Everything is in the metadata database (dsec.control.rollouts.store), so any replica answers and a
rollout outlives its trainer, its worker and this process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from dsec.control.apiserver.core import Apiserver, parse_body, parse_labels, read_body
from dsec.control.iam import acting_project, current_principal, project_scope
from dsec.control.rollouts.store import RolloutStore
from dsec.shared.errors import InvalidRequest, NotFound, PayloadTooLarge
from dsec.shared.wire.models import ForkRequest
from dsec.shared.wire.rollouts import (
    FINISHED,
    MAX_JOURNALED_OUTPUT,
    MAX_STEP_BYTES,
    MAX_STEPS,
    ROLLOUT_LABEL,
    AckRequest,
    Claimed,
    ClaimRequest,
    ExecStepRequest,
    FinishRequest,
    HeartbeatRequest,
    HeartbeatResult,
    RolloutCounts,
    RolloutInfo,
    RolloutState,
    SandboxRecord,
    Step,
    StepRequest,
    SubmitRequest,
    SubmitResult,
)

POLL_S = 0.25
HEARTBEAT_IN_PLACE = 512  # leases renewed in place on SQLite at most (more: on a thread)
SWEEP_S = 1.0
MAX_WAIT_S = 60.0
# a step request's body, as RequestLimits caps /v1/rollouts: the step's own size is checked
# once parsed (a client's JSON may escape more than pydantic's does)
MAX_STEP_BODY = 16 << 20
log = logging.getLogger("dsec.rollouts")


class Wakeup:
    """Wakes whoever waits, at once; a waiter takes its ``waiter()`` before it looks, so a
    wake between its look and its wait is not lost."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    def waiter(self) -> Callable[[float], Coroutine[Any, Any, None]]:
        event = self._event

        async def wait(timeout: float) -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
        return wait


def _body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses its own."""
    return {"content": {"application/json": {"schema": model.model_json_schema()}}, "required": True}


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    store = RolloutStore(api.tokens.db)
    cleanups: set[asyncio.Task[None]] = set()
    swept: dict[str | None, float] = {}  # project scope -> when this replica last swept it
    queued = Wakeup()  # rollouts were queued here: claims waiting for work look again
    finished = Wakeup()  # rollouts finished here: trainers waiting for them look again

    async def _get(rollout_id: str, steps: bool = False, spec: bool = False) -> RolloutInfo:
        # a trajectory may be long: read on a thread; the row alone in place (SQLite)
        get = asyncio.to_thread if steps else store.run
        info = await get(store.get, rollout_id, steps=steps, spec=spec)
        p = current_principal.get()
        if info is None or not p.covers(info.project):
            raise NotFound(f"no rollout {rollout_id!r}", field="rollout_id")
        return info

    async def _stop_sandboxes(rollout_ids: list[str]) -> None:
        """The sandboxes a worker made for rollouts that ended without it (cancelled, or failed
        after their worker was lost): nobody else stops them."""
        for rid in rollout_ids:
            try:
                for sb in await api.list(None, {ROLLOUT_LABEL: rid}):
                    if sb.state.value in ("creating", "running", "paused"):
                        await api.stop(sb.sandbox_id)
            except Exception as e:  # an edge down: its sandboxes expire there by their own timeouts
                log.warning("sandbox of rollout %s not stopped: %s", rid, e)

    @router.post("/v1/rollouts", status_code=201)
    async def submit(req: SubmitRequest, project: str | None = None) -> SubmitResult:
        """Queued for the rollout workers. A spec whose ``key`` the project used before answers
        that rollout (``created`` counts the new ones): a restarted trainer resubmits safely."""
        project = acting_project(project)
        # the worker makes the sandboxes with its own token (maybe the cluster admin's): the
        # layers must be the submitter's to see, checked here (once per distinct stack)
        for snapshot in {r.snapshot for r in req.rollouts if r.snapshot is not None}:
            await api.check_visible(ForkRequest(snapshot=snapshot))
        for image, layers in {(r.args.image, tuple(r.args.layers)) for r in req.rollouts
                              if r.args is not None and r.snapshot is None}:
            await api.check_refs(image, list(layers))
        items, created = await store.on_thread(store.submit, project, req.rollouts)
        if created:
            queued.wake()
        return SubmitResult(rollouts=items, created=created)

    @router.get("/v1/rollouts")
    async def list_rollouts(job: str | None = None, state: list[RolloutState] = Query(default=[]),
                            consumed: bool | None = None, label: list[str] = Query(default=[]),
                            after: str | None = None, limit: int = Query(default=1000, ge=1, le=10_000),
                            project: str | None = None) -> list[RolloutInfo]:
        """In creation order, ``limit`` at a time; ``after`` (the last id seen) pages on."""
        return await asyncio.to_thread(store.list, project_scope(project), job=job, states=state, consumed=consumed,
                                       labels=parse_labels(label), after=after, limit=limit)

    @router.get("/v1/rollouts/counts")
    async def counts(job: str | None = None, project: str | None = None) -> RolloutCounts:
        return await asyncio.to_thread(store.counts, project_scope(project), job)

    @router.get("/v1/rollouts/wait")
    async def wait(job: str | None = None, limit: int = Query(default=100, ge=1, le=10_000),
                   timeout: float = Query(default=30.0, ge=0, le=MAX_WAIT_S), since: float = 0.0,
                   project: str | None = None) -> list[RolloutInfo]:
        """Finished rollouts not yet acknowledged that finished at ``since`` or later, in the
        order they finished, as soon as there is one (at most ``timeout`` seconds; an empty list
        then). Unacknowledged ones come again to a new reader: ack what you used."""
        scope = project_scope(project)
        deadline = time.monotonic() + timeout
        while True:
            woken = finished.waiter()
            items = await asyncio.to_thread(store.list, scope, job=job, states=FINISHED, consumed=False, limit=limit,
                                            finished_since=since)
            if items or time.monotonic() >= deadline:
                return items
            # at once for a rollout finished on this replica; another replica's within POLL_S
            await woken(min(POLL_S, max(0.0, deadline - time.monotonic())))

    @router.post("/v1/rollouts/ack")
    async def ack(req: AckRequest, project: str | None = None) -> dict[str, int]:
        """Finished rollouts marked consumed: ``wait`` no longer answers them."""
        return {"acked": await store.on_thread(store.ack, project_scope(project), req.ids)}

    @router.post("/v1/rollouts/claim")
    async def claim(req: ClaimRequest, request: Request, project: str | None = None) -> list[Claimed]:
        """Up to ``n`` queued rollouts for this worker, leased for ``lease_s`` (renewed by its
        heartbeats). Expired leases are collected first: their rollouts are queued again."""
        scope = project_scope(project)
        deadline = time.monotonic() + req.wait_s
        while True:
            if await request.is_disconnected():  # a worker that died while it waited claims nothing
                return []
            now = time.time()
            # the sweeps take this worker's project only: the sandboxes it then stops are ones its
            # token sees (an admin worker sweeps, and sees, every project); once a second per scope
            # and replica, however many workers poll
            if now - swept.get(scope, 0.0) >= SWEEP_S:
                swept[scope] = now
                failed = await store.on_thread(store.expire, scope, now)
                cancelled = await store.on_thread(store.cancel_stopped_jobs, scope, now)
                if failed or cancelled:  # in the background: a claim answers within the worker's timeout
                    _background(_stop_sandboxes([f.id for f in failed] + cancelled))
            woken = queued.waiter()
            got = await store.on_thread(store.claim, scope, req.worker, req.n, req.lease_s, now)
            if got or req.n == 0 or time.monotonic() >= deadline:
                return got
            # at once for a submit to this replica; another replica's, or a lease run out, within POLL_S * 4
            await woken(min(POLL_S * 4, max(0.0, deadline - time.monotonic())))

    @router.post("/v1/rollouts/heartbeat")
    async def heartbeat(req: HeartbeatRequest) -> HeartbeatResult:
        """Renews the leases this worker still holds; says which it lost and which must hold
        (their job is paused)."""
        # a worker's usual few hundred leases in place; a long list (up to 10,000) on a thread
        run = store.run if len(req.ids) <= HEARTBEAT_IN_PLACE else store.on_thread
        return HeartbeatResult(rollouts=await run(
            store.heartbeat, project_scope(None), req.worker, req.ids, req.lease_s, time.time()))

    @router.get("/v1/rollouts/{rollout_id}")
    async def get(rollout_id: str, steps: bool = False, spec: bool = False) -> RolloutInfo:
        """Its state and outcome; ``steps=true`` adds the trajectory (the journal), ``spec=true`` the spec."""
        return await _get(rollout_id, steps, spec)

    def _background(coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        cleanups.add(task)  # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(cleanups.discard)

    @router.post("/v1/rollouts/{rollout_id}/cancel")
    async def cancel(rollout_id: str) -> RolloutInfo:
        """A queued or running rollout is cancelled and its sandbox stopped; a finished one stays as it is."""
        await _get(rollout_id)
        info = await store.on_thread(store.cancel, rollout_id, "cancelled")
        assert info is not None
        if info.state == "cancelled":
            await _stop_sandboxes([rollout_id])
        return info

    def _checked(step: Step) -> Step:
        if step.seq < 0 or step.seq >= MAX_STEPS:
            raise PayloadTooLarge(f"a rollout has at most {MAX_STEPS} steps", field="step.seq")
        if len(step.model_dump_json()) > MAX_STEP_BYTES:
            raise PayloadTooLarge(f"a step is at most {MAX_STEP_BYTES} bytes of JSON", field="step")
        return step

    async def _journal(rollout_id: str, worker: str, attempt: int, step: Step) -> Response:
        stored = await store.run(store.add_step, rollout_id, worker, attempt, _checked(step),
                                 current_principal.get().covers)
        return Response(stored.model_dump_json(), media_type="application/json")

    # a step per command or model call of every rollout: these bodies are parsed by
    # pydantic-core directly, and the lookup, the check and the write are one transaction
    @router.post("/v1/rollouts/{rollout_id}/steps", response_model=Step,
                 openapi_extra={"requestBody": _body(StepRequest)})
    async def add_step(rollout_id: str, request: Request) -> Response:
        """Journal one step (the worker's); the step already at that seq, if any, is answered."""
        req = parse_body(StepRequest, await read_body(request, MAX_STEP_BODY, "body"))
        return await _journal(rollout_id, req.worker, req.attempt, req.step)

    @router.post("/v1/rollouts/{rollout_id}/exec", response_model=Step,
                 openapi_extra={"requestBody": _body(ExecStepRequest)})
    async def exec_step(rollout_id: str, request: Request) -> Response:
        """Run a keyed command in the rollout's sandbox and journal its result as the step's
        response, in one call; answers the step journaled (the first write wins)."""
        req = parse_body(ExecStepRequest, await read_body(request, MAX_STEP_BODY, "body"))
        if req.exec.key is None:
            raise InvalidRequest("exec.key: a journaled command carries its command-log key", field="exec.key")
        # its output must fit its step, or it could run and then not be journaled
        if "max_output_bytes" not in req.exec.model_fields_set:
            req.exec.max_output_bytes = MAX_JOURNALED_OUTPUT
        elif req.exec.max_output_bytes > MAX_JOURNALED_OUTPUT:
            raise InvalidRequest(f"exec.max_output_bytes: at most {MAX_JOURNALED_OUTPUT} for a journaled command "
                                 f"(a step is at most {MAX_STEP_BYTES} bytes of JSON)", field="exec.max_output_bytes")
        # refused before anything runs: a bad step, a rollout this worker no longer holds, a
        # sandbox the caller cannot reach (the journal write checks the holder again)
        _checked(req.step)
        await store.run(store.check_held, rollout_id, req.worker, req.attempt, current_principal.get().covers)
        edge = await api.in_reach(req.sandbox_id)
        res = await edge.exec(req.sandbox_id, req.exec)
        step = req.step.model_copy(update={"response": res.model_dump(mode="json")})
        return await _journal(rollout_id, req.worker, req.attempt, step)

    @router.post("/v1/rollouts/{rollout_id}/sandbox")
    async def set_sandbox(rollout_id: str, req: SandboxRecord) -> dict[str, str]:
        """The sandbox the worker made for it (shown in its info)."""
        await store.run(store.set_sandbox, rollout_id, req.worker, req.attempt, req.sandbox_id,
                        current_principal.get().covers)
        return {"sandbox_id": req.sandbox_id}

    @router.post("/v1/rollouts/{rollout_id}/finish")
    async def finish(rollout_id: str, req: FinishRequest) -> RolloutInfo:
        """The worker's outcome (409 ``rollout_lost`` if it no longer holds the rollout)."""
        info = await store.run(store.finish, rollout_id, req, current_principal.get().covers)
        (finished if info.state in FINISHED else queued).wake()
        return info
    return router

