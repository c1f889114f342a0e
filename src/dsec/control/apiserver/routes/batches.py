"""Batch creates: ``POST /v1/batches`` accepts up to 10,000 sandboxes of one args at once
(202) and the apiserver's queue makes them a bounded number at a time per edge
(dsec.control.batches.runner); progress paged by item, streamed as JSON lines, and cancel."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from dsec.control.apiserver.core import Apiserver
from dsec.control.iam import PROJECT_LABEL, current_principal
from dsec.control.iam.quota import in_subtree
from dsec.shared.errors import NotFound
from dsec.shared.meta.batches_schema import batches
from dsec.shared.wire.batches import BatchAdmission, BatchInfo, BatchRequest
from dsec.shared.wire.models import CreateRequest

POLL_S = 0.2


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    runner = api.batches

    def _mine(info: BatchInfo) -> BatchInfo:
        p = current_principal.get()
        if not p.covers(info.project):  # another project's batch does not exist for it
            raise NotFound(f"no batch {info.id!r}", field="batch_id")
        return info

    @router.post("/v1/batches", status_code=202)
    async def create_batch(req: BatchRequest) -> BatchInfo:
        """Accepted at once; its items are made in the background. Each item's outcome (a sandbox,
        or the reason it was not made: a job's quota is checked per item) is in GET /v1/batches/{id}."""
        args = api._own(CreateRequest(args=req.args)).args
        await api.check_visible(args)  # its items are made in the admin's context, which sees every layer
        return await runner.submit(req.model_copy(update={"args": args}), args.labels.get(PROJECT_LABEL, "default"))

    @router.get("/v1/batches")
    async def list_batches(job: str | None = None, limit: int = Query(default=20, ge=1, le=200)) -> list[BatchInfo]:
        """The newest batches of the caller's projects (counts and failure reasons, no items)."""
        p = current_principal.get()
        where = None if p.all_projects else (in_subtree(batches.c.project, p.project) if p.role == "admin"
                                             else batches.c.project == p.project)
        out = []
        for batch_id in await asyncio.to_thread(runner.store.recent, where, job, limit):
            info = await runner.get(batch_id, 0, 0)
            if info.counts.failed:
                info.failure_reasons = await asyncio.to_thread(runner.store.failure_reasons, batch_id)
            out.append(info)
        return out

    @router.get("/v1/batches/admission")
    async def admission() -> BatchAdmission:
        """Creates starting per edge now and the most so far, the per-edge bound, items queued
        (of the caller's projects: a project's token counts only its own subtree's)."""
        return runner.admission(current_principal.get().covers)

    @router.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, offset: int = Query(default=0, ge=0),
                        limit: int = Query(default=1000, ge=0, le=10_000)) -> BatchInfo:
        """Counts by item state, and the items offset..offset+limit (``next_offset`` pages on)."""
        return _mine(await runner.get(batch_id, offset, limit))

    @router.get("/v1/batches/{batch_id}/events")
    async def batch_events(batch_id: str) -> StreamingResponse:
        """The batch (counts only) as JSON lines: now, then each time its counts change, until it ends."""
        first = _mine(await runner.get(batch_id, 0, 0))

        async def lines() -> AsyncIterator[bytes]:
            info, last = first, None
            while True:
                if info.counts != last:
                    last = info.counts
                    yield info.model_dump_json().encode() + b"\n"
                if info.state != "running" and info.finished_at is not None:
                    return
                if info.state != "running" and runner.owns(batch_id) is None:
                    return  # cancelled on a replica that does not run it
                await asyncio.sleep(POLL_S)
                info = await runner.get(batch_id, 0, 0)
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @router.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, stop: bool = False) -> BatchInfo:
        """Queued items are cancelled; made ones stay unless ``stop=true``."""
        _mine(await runner.get(batch_id, 0, 0))
        return await runner.cancel(batch_id, stop)
    return router
