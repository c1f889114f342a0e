"""Sandbox lifecycle and records: create, list, get, stop, pause, resume, the same for a
whole job, usage, events, audit, protected paths, network rules, access lists."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import TypeAdapter

from dsec.control.apiserver.core import (
    UNREACHABLE_HEADER,
    Apiserver,
    all_edges_answered,
    check_host_rules,
    parse_labels,
    unreachable,
)
from dsec.shared.errors import (
    InvalidRequest,
    SandboxBusy,
)
from dsec.shared.wire.models import (
    AuditRecord,
    CreateRequest,
    NetworkInfo,
    NetworkRulesRequest,
    ProtectRequest,
    SandboxEvent,
    SandboxInfo,
    SandboxUsage,
)


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    @router.post("/v1/sandboxes", status_code=201)
    async def create(req: CreateRequest) -> SandboxInfo:
        return await api.create(req)

    @router.get("/v1/sandboxes", response_model=list[SandboxInfo])
    async def list_sandboxes(job: str | None = None, label: list[str] = Query(default=[]),
                             usage: bool = False) -> Response:
        """``usage=true`` adds each sandbox's CPU, memory (anon, file, swap), pids, disk and OOM kills.
        Edges that did not answer are named in the ``X-Dsec-Unreachable-Edges`` header (their
        sandboxes are missing from the list)."""
        items = await api.list(job, parse_labels(label), usage)
        body = TypeAdapter(list[SandboxInfo]).dump_json(items)
        missing = unreachable.get()
        return Response(body, media_type="application/json",
                        headers={UNREACHABLE_HEADER: ",".join(missing)} if missing else None)

    @router.get("/v1/sandboxes/{sandbox_id}/usage")
    async def usage(sandbox_id: str) -> SandboxUsage:
        return await api.edge_for(sandbox_id).usage(sandbox_id)

    @router.delete("/v1/sandboxes")
    async def stop_many(job: str | None = None, label: list[str] = Query(default=[])) -> list[SandboxInfo]:
        """Stop every running or paused sandbox of a job (and/or with these labels), on every edge."""
        labels = parse_labels(label)
        if job is None and not labels:
            raise InvalidRequest("give a job or at least one label; stopping everything is not offered",
                                 field="job")
        targets = [i for i in await api.list(job, labels) if i.state in ("running", "paused")]
        done = await api.stop_all(i.sandbox_id for i in targets)
        all_edges_answered("stopped")
        return done

    @router.post("/v1/sandboxes/pause")
    async def pause_many(job: str | None = None, label: list[str] = Query(default=[])) -> list[SandboxInfo]:
        """Pause every running sandbox of a job (and/or with these labels), on every edge; the ones that
        have requests in flight are left running (they appear unchanged in the answer)."""
        return await _each(job, label, "running", "pause", api.pause)

    @router.post("/v1/sandboxes/resume")
    async def resume_many(job: str | None = None, label: list[str] = Query(default=[])) -> list[SandboxInfo]:
        return await _each(job, label, "paused", "resume", api.resume)

    async def _each(job: str | None, label: list[str], state: str, what: str,
                    op: Callable[[str], Awaitable[SandboxInfo]]) -> list[SandboxInfo]:
        labels = parse_labels(label)
        if job is None and not labels:
            raise InvalidRequest(f"give a job or at least one label; {what} of everything is not offered",
                                 field="job")
        targets = [i for i in await api.list(job, labels) if i.state == state]

        async def one(i: SandboxInfo) -> SandboxInfo:
            try:
                return await op(i.sandbox_id)  # the project's CPU follows (docs/iam.md)
            except SandboxBusy:
                return i
        done = list(await asyncio.gather(*(one(i) for i in targets)))
        all_edges_answered(what + "d")
        return done

    @router.get("/v1/sandboxes/{sandbox_id}")
    async def get(sandbox_id: str) -> SandboxInfo:
        return await api.edge_for(sandbox_id).get(sandbox_id)

    @router.delete("/v1/sandboxes/{sandbox_id}")
    async def stop(sandbox_id: str) -> SandboxInfo:
        return await api.stop(sandbox_id)

    @router.post("/v1/sandboxes/{sandbox_id}/pause")
    async def pause(sandbox_id: str) -> SandboxInfo:
        """VM: RAM and devices to a snapshot file and QEMU ends; container: frozen. Any later request resumes."""
        return await api.pause(sandbox_id)

    @router.post("/v1/sandboxes/{sandbox_id}/network")
    async def set_network_rules(sandbox_id: str, req: NetworkRulesRequest) -> NetworkInfo:
        """Change a container's egress rules while it runs; keys not named keep their setting."""
        check_host_rules(req.rules, "rules")
        return await api.edge_for(sandbox_id).set_network_rules(sandbox_id, req.rules)

    @router.post("/v1/sandboxes/{sandbox_id}/resume")
    async def resume(sandbox_id: str) -> SandboxInfo:
        return await api.resume(sandbox_id)

    @router.get("/v1/sandboxes/{sandbox_id}/events")
    async def events(sandbox_id: str) -> list[SandboxEvent]:
        """What happened to a sandbox that its owner should know (creation, prefetch, storage errors, ...)."""
        return await api.edge_for(sandbox_id).events(sandbox_id)

    @router.get("/v1/sandboxes/{sandbox_id}/audit")
    async def audit(sandbox_id: str, kind: str | None = None, flagged: bool = False,
                    limit: int = Query(default=1000, ge=1, le=20000)) -> list[AuditRecord]:
        """Processes executed, platform requests, egress denials and detector flags, oldest first
        (the last ``limit``); kept after the sandbox ends."""
        return await api.edge_for(sandbox_id).audit_log(sandbox_id, kind, flagged, limit)

    @router.post("/v1/sandboxes/{sandbox_id}/protect")
    async def protect(sandbox_id: str, req: ProtectRequest) -> dict[str, int]:
        """Fingerprint the files under these paths now; any later change is flagged in the audit log."""
        return {"files": await api.edge_for(sandbox_id).protect(sandbox_id, req.paths)}

    @router.post("/v1/sandboxes/{sandbox_id}/access_list")
    async def save_access_list(sandbox_id: str) -> dict[str, int]:
        """Save what a record_access sandbox has read so far as its layers' access lists (data blob -> chunks)."""
        return await api.edge_for(sandbox_id).save_access_lists(sandbox_id)
    return router
