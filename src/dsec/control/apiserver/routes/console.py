"""What the web console and ``dsec top`` read (docs/console.md), each scoped to the
caller's projects like the rest of the API: the fleet at a glance (edges with load and
health, sandboxes by state and backend, the last hour's creation rate and latency), a
sandbox query every edge answers for itself (filtered, sorted, paged: a 10,000-sandbox
fleet sends only pages), the layer catalog with lineage and on-demand cache hit rates,
and FnCall pool occupancy and verdicts."""

from __future__ import annotations

import asyncio
from collections import Counter

from fastapi import APIRouter, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from dsec.control.apiserver.core import LIST_TIMEOUT_S, Apiserver, parse_labels
from dsec.control.apiserver.routes.nodes import node_info
from dsec.control.iam import current_principal
from dsec.control.iam.visibility import LayerAcl, may_see
from dsec.node.edge.api import EdgeAPI
from dsec.shared.errors import EdgeUnavailable
from dsec.shared.query import merge, needs_usage
from dsec.shared.wire.console import (
    MAX_PAGE,
    FleetHistory,
    FleetOverview,
    FnCallStats,
    LayerCacheStats,
    LayerCatalog,
    LayerNode,
    SandboxPage,
    SandboxQuery,
)
from dsec.shared.wire.fleet import FleetEvent
from dsec.shared.wire.models import SandboxUsage

EVENTS_SHOWN = 30


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    acl = LayerAcl(api.tokens.db)

    async def query(q: SandboxQuery) -> SandboxPage:
        p = current_principal.get()
        if not p.all_projects:
            q = q.model_copy(update={"scope": p.project, "scope_subtree": p.role == "admin"})
        names = list(api.edges)
        parts = await asyncio.gather(*(asyncio.wait_for(api.edges[n].query_sandboxes(q), LIST_TIMEOUT_S)
                                       for n in names), return_exceptions=True)
        pages, missing = [], []
        for name, part in zip(names, parts, strict=True):
            if isinstance(part, EdgeUnavailable | TimeoutError):
                missing.append(name)
            elif isinstance(part, BaseException):
                raise part
            else:
                pages.append(part)
        page = merge(pages, q, missing)
        if (q.usage or needs_usage(q)) and page.items:
            # what is shown is read for the page alone, one call per edge (the edges ranked by
            # two cgroup files)
            by_edge: dict[str, tuple[EdgeAPI, list[str]]] = {}
            for i in page.items:
                edge = api.edge_for(i.sandbox_id)
                by_edge.setdefault(edge.name, (edge, []))[1].append(i.sandbox_id)
            found = await asyncio.gather(*(asyncio.wait_for(edge.usage_many(ids), LIST_TIMEOUT_S)
                                           for edge, ids in by_edge.values()), return_exceptions=True)
            uses: dict[str, SandboxUsage] = {}
            for got in found:
                if isinstance(got, dict):
                    uses.update(got)
            page.items = [i.model_copy(update={"usage": uses.get(i.sandbox_id)}) for i in page.items]
        return page

    @router.get("/v1/console/sandboxes", response_model=SandboxPage)
    async def sandboxes(q: str = "", state: list[str] = Query(default=[]), backend: list[str] = Query(default=[]),
                        job: str | None = None, label: list[str] = Query(default=[]), project: str | None = None,
                        edge: str | None = None, sort: str = "-created", offset: int = 0, limit: int = 50,
                        usage: bool = False) -> Response:
        """The caller's sandboxes matching every filter given, ``sort``ed (created, last_active,
        cpu or memory; '-' for descending), ``offset``..``offset+limit``, with the counts of all
        that match by state, backend and job."""
        try:
            sq = SandboxQuery(q=q, state=state, backend=backend, job=job, labels=parse_labels(label),
                              project=project, edge=edge, sort=sort, offset=offset, limit=limit,  # type: ignore[arg-type]
                              usage=usage)
        except ValidationError as e:  # reported as any query parameter's error is (faces/front/app.py)
            raise RequestValidationError([{**err, "loc": ("query", *err.get("loc", ()))}
                                          for err in e.errors()]) from None
        # dumped here: FastAPI would validate the page's items once more on the way out
        return Response((await query(sq)).model_dump_json(), media_type="application/json")

    @router.get("/v1/console/fleet")
    async def fleet(since: float = 0.0) -> FleetOverview:
        """Every edge's load and health as the watcher last saw it (no new poll), the caller's
        sandboxes by state and backend, the fleet's samples after ``since``, and (for the
        cluster's admin) the newest fleet events."""
        p = current_principal.get()
        fleet_wide = p.all_projects  # a project's token sees the edges' load, not other projects' work
        health = api.watcher.health
        rows = {r.name: r for r in await asyncio.to_thread(health.registry.edges)} if health else {}
        view = api.watcher.view
        nodes = [node_info(n, view.get(n), rows.get(n), redact=not fleet_wide) for n in sorted(set(api.edges))]
        counts = await query(SandboxQuery(limit=0))
        events: list[FleetEvent] = []
        if health is not None and fleet_wide and p.role == "admin":
            events = await asyncio.to_thread(health.events.newest, EVENTS_SHOWN)
        history = api.series.history(since) if fleet_wide else FleetHistory(interval_s=api.series.interval_s,
                                                                             samples=[], shown=False)
        return FleetOverview(nodes=nodes, sandboxes=counts, history=history, events=events)

    @router.delete("/v1/console/sessions")
    async def end_sessions(token_id: str = Query(min_length=1, max_length=64)) -> dict[str, str]:
        """End every console session of a token made until now (the cluster's admin: a copied
        session cookie is refused from now on, even the admin token's own)."""
        await api.sessions.end_all(token_id)
        return {"ended": token_id}

    @router.get("/v1/console/fncall")
    async def fncall() -> list[FnCallStats]:
        """Per edge: its FnCall pools (containers, workers busy, calls waiting) and what its
        calls came to (results by status, test cases by verdict)."""
        parts = await asyncio.gather(*(asyncio.wait_for(e.fncall_stats(), LIST_TIMEOUT_S) for e in api.edges.values()),
                                     return_exceptions=True)
        out = [s for s in parts if isinstance(s, FnCallStats)]
        p = current_principal.get()
        if p.all_projects:
            return out
        # a project's token: the pools of layers it may see, without their errors, and no
        # counters (FnCall pools serve every project: what they ran is no one project's)
        rows = await asyncio.to_thread(acl.rows)

        def visible(ref: str) -> bool:
            row = rows.get(ref)
            return row is None or may_see(p, row.project, row.visibility)
        return [s.model_copy(update={
            "pools": [pool.model_copy(update={"error": None}) for pool in s.pools
                      if visible(pool.image) and all(visible(ref) for ref in pool.layers)],
            "calls": 0, "statuses": {}, "verdicts": {}, "errors": 0, "shown": False}) for s in out]

    @router.get("/v1/console/layers")
    async def layers(q: str = "", offset: int = Query(default=0, ge=0),
                     limit: int = Query(default=100, ge=0, le=MAX_PAGE)) -> LayerCatalog:
        """The layers the caller may see, newest first, each with the layer it was taken on
        (its lineage), how many were taken on it, and its on-demand reads over all edges."""
        p = current_principal.get()
        rows = await asyncio.to_thread(acl.rows)
        shown = [layer for layer in api.layers.list()
                 if (row := rows.get(layer.ref)) is None or may_see(p, row.project, row.visibility)]
        children: Counter[str] = Counter()
        nodes = []
        for layer in shown:
            parent = layer.parent_layers[-1] if layer.parent_layers else layer.parent_image
            if parent:
                children[parent] += 1
            row = rows.get(layer.ref)
            nodes.append(LayerNode(ref=layer.ref, kind=layer.kind, size=layer.size, created_at=layer.created_at,
                                   parent=parent, owner=row.project if row else None,
                                   visibility=row.visibility if row else "public", source=layer.source))
        if q:
            nodes = [n for n in nodes if q.lower() in n.ref.lower() or q.lower() in (n.parent or "").lower()]
        nodes.sort(key=lambda n: -n.created_at)
        page = nodes[offset:offset + limit]
        stats = await asyncio.gather(*(asyncio.wait_for(e.storage_stats(), LIST_TIMEOUT_S)
                                       for e in api.edges.values()), return_exceptions=True)
        cache: dict[str, LayerCacheStats] = {}
        for st in stats:
            if isinstance(st, BaseException):
                continue
            for b in st.blobs:
                for ref in b.layers:
                    c = cache.setdefault(ref, LayerCacheStats())
                    c.hits += b.hits
                    c.misses += b.misses
                    c.prefetched += b.prefetched
                    c.remote_bytes += b.remote_bytes
                    c.errors += b.errors
        for n in page:
            n.children = children.get(n.ref, 0)
            if (hit := cache.get(n.ref)) is not None:
                n.cache, n.hit_rate = hit, hit.hit_rate
        return LayerCatalog(total=len(nodes), items=page)

    return router
