"""Checkpoints and moves: take a sandbox's checkpoint now, list them, move a live
checkpointed sandbox to another edge, restore a lost one by hand, drain an edge
(docs/fault-tolerance.md)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from dsec.control.apiserver.core import Apiserver
from dsec.control.iam import current_principal
from dsec.control.mover import Mover
from dsec.shared.errors import InvalidRequest, NotFound
from dsec.shared.wire.fleet import CheckpointInfo, CheckpointRequest, DrainReport
from dsec.shared.wire.models import SandboxInfo, SandboxState, parse_sandbox_id

DRAIN_TIMEOUT_S = 900.0  # moves run MOVES_AT_ONCE at a time, each bounded: the whole drain is too


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()

    def mover() -> Mover:
        if api.mover is None:
            raise InvalidRequest("moving sandboxes between edges needs a cluster (edges sharing its database: "
                                 "`dsec cluster up`)", field="edge")
        return api.mover

    def actor() -> str:
        return current_principal.get().token_id

    @router.post("/v1/sandboxes/{sandbox_id}/checkpoint", status_code=201)
    async def checkpoint(sandbox_id: str, req: CheckpointRequest | None = None) -> CheckpointInfo:
        """Take a checkpoint now: after a freeze of milliseconds, what changed in its writable layer since
        the last one (or all of it, ``full``), with its command log and record, to the shared store."""
        return await api.edge_for(sandbox_id).checkpoint(sandbox_id, full=bool(req and req.full))

    @router.get("/v1/sandboxes/{sandbox_id}/checkpoints")
    async def checkpoints(sandbox_id: str) -> list[CheckpointInfo]:
        try:
            parse_sandbox_id(sandbox_id)
        except ValueError as e:
            raise InvalidRequest(str(e), field="sandbox_id") from None
        rows = await asyncio.to_thread(api.checkpoints.list, sandbox_id)
        return [CheckpointInfo(**r.model_dump(include=set(CheckpointInfo.model_fields))) for r in rows]

    @router.post("/v1/sandboxes/{sandbox_id}/move")
    async def move(sandbox_id: str) -> SandboxInfo:
        """Move a running or paused checkpointed sandbox to another edge (placement's choice): paused
        where it is, checkpointed, restored there under its own id, evicted here."""
        info = await api.edge_for(sandbox_id).get(sandbox_id)
        if info.state not in (SandboxState.running, SandboxState.paused):
            raise InvalidRequest(f"sandbox {sandbox_id} is {info.state.value}; only a running or paused one "
                                 "moves (a lost one is restored: POST .../restore)", field="sandbox_id")
        return await mover().move(sandbox_id, info.edge, "moved by an operator", actor())

    @router.post("/v1/sandboxes/{sandbox_id}/restore")
    async def restore(sandbox_id: str) -> SandboxInfo:
        """Bring back a sandbox whose node was lost, from its newest checkpoint, on another edge (the
        controller does this by itself; this is for one whose automatic restore failed)."""
        info = await api.edge_for(sandbox_id).get(sandbox_id)
        if info.state != SandboxState.failed or api.index is None:
            raise InvalidRequest(f"sandbox {sandbox_id} is {info.state.value}: only a sandbox of a lost edge is "
                                 "restored", field="sandbox_id")
        if await asyncio.to_thread(api.checkpoints.latest, sandbox_id) is None:
            raise NotFound(f"sandbox {sandbox_id} has no checkpoint", field="sandbox_id")
        return await mover().restore_lost(sandbox_id, info.edge, actor())

    @router.post("/v1/nodes/{name}/drain")
    async def drain(name: str) -> DrainReport:
        """Move every checkpointed sandbox off the edge (cordon it first, or new ones land there); the
        others are listed as left. Bounded: at most DRAIN_TIMEOUT_S."""
        if name not in api.edges:
            raise NotFound(f"no edge {name!r} in this cluster", field="name")
        return await asyncio.wait_for(mover().drain(name, actor()), DRAIN_TIMEOUT_S)

    return router
