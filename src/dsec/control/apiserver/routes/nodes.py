"""The fleet's nodes and their health (docs/fault-tolerance.md): every edge with its load,
the detector's verdict and evidence, an operator's cordon and uncordon, and the fleet's
event log. Reads need the ``read`` permission like the rest of the cluster's
information (the event log, which names operators and sandboxes, ``cluster``); cordon
and uncordon need ``cluster``, the cluster's admin's."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query

from dsec.control.apiserver.core import Apiserver
from dsec.control.health.fleet import FleetHealth
from dsec.control.iam import current_principal
from dsec.shared.errors import NotFound
from dsec.shared.meta.registry import EdgeRow
from dsec.shared.wire.fleet import FleetEvent
from dsec.shared.wire.models import NodeStats
from dsec.shared.wire.nodes import CordonRequest, NodeInfo, UncordonRequest


def _blank(name: str) -> NodeStats:
    """An edge that never answered: no capacity to offer."""
    return NodeStats(edge=name, healthy=False, backends=[], cpus=0, memory_mb=0, cpu_overcommit=0,
                     memory_overcommit=0, sandboxes=0, cpu_reserved=0, memory_reserved_mb=0, max_sandboxes=0)


def node_info(name: str, st: NodeStats | None, row: EdgeRow | None, redact: bool = False) -> NodeInfo:
    """An edge as a caller sees it; ``redact`` (a project's token): without other projects'
    job names, the operators' token ids and the detector's evidence."""
    if st is None:
        st = row.stats if row is not None and row.stats is not None else _blank(name)
    lost = row is not None and row.state == "lost"
    fields = {**st.model_dump(), "edge": name,
              "state": "lost" if lost else ("up" if st.healthy else "unreachable")}
    if row is not None:
        fields.update(health=row.health, cordoned=row.health == "cordoned", health_reason=row.health_reason,
                      health_at=row.health_at, evidence=row.evidence, cordoned_by=row.cordoned_by)
        if lost:
            fields["healthy"] = False
    if redact:
        fields.update(per_job={}, cordoned_by="operator" if fields.get("cordoned_by") not in ("", "detector", None)
                      else fields.get("cordoned_by", ""), evidence=[])
    return NodeInfo.model_validate(fields)


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()

    def health() -> FleetHealth:
        if api.watcher.health is None:  # (every apiserver dsec assembles keeps it)
            raise NotFound("this apiserver keeps no edge health records", field="name")
        return api.watcher.health

    async def rows() -> dict[str, EdgeRow]:
        """The rows of the edges this apiserver fronts (a database may hold rows of edges
        an earlier ``--edges`` named)."""
        return {r.name: r for r in await asyncio.to_thread(health().registry.edges)
                if r.state != "removed" and r.name in api.edges}

    async def one(name: str) -> NodeInfo:
        if name not in api.edges:
            raise NotFound(f"no edge {name!r} in this fleet", field="name")
        row = await health().row(name)
        return node_info(name, api.watcher.view.get(name), row, not current_principal.get().all_projects)

    @router.get("/v1/nodes")
    async def nodes() -> list[NodeInfo]:
        """Every edge: its load (a fresh poll), whether it answers, its health and why."""
        view = await api.watcher.refresh()
        have = await rows()
        redact = not current_principal.get().all_projects
        return [node_info(n, view.get(n), have.get(n), redact) for n in sorted(set(view) | set(have))]

    @router.get("/v1/nodes/{name}")
    async def node(name: str) -> NodeInfo:
        return await one(name)

    @router.post("/v1/nodes/{name}/cordon")
    async def cordon(name: str, req: CordonRequest) -> NodeInfo:
        """No new sandboxes on this edge until it is uncordoned (by hand: the detector never
        lifts an operator's cordon); what runs there runs on."""
        await one(name)  # NotFound naming the field
        await health().cordon(name, req.reason, current_principal.get().token_id, api.edges.get(name))
        return await one(name)

    @router.post("/v1/nodes/{name}/uncordon")
    async def uncordon(name: str, req: UncordonRequest | None = None) -> NodeInfo:
        """Lift a cordon (the operator's or the detector's) and the detector's verdict."""
        await one(name)
        await health().uncordon(name, current_principal.get().token_id, api.edges.get(name),
                                req.reason if req else "")
        return await one(name)

    @router.get("/v1/fleet/events")
    async def events(edge: str | None = None, sandbox_id: str | None = None, kind: str | None = None,
                     after: int = Query(default=0, ge=0), limit: int = Query(default=200, ge=1, le=10_000)
                     ) -> list[FleetEvent]:
        """Health changes, cordons, uncordons (and drains, moves, restores), oldest first
        after event ``after``."""
        return await asyncio.to_thread(health().events.list, edge, sandbox_id, kind, after, limit)
    return router
