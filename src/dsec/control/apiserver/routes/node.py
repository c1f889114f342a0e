"""The node-level routes: health, Prometheus metrics, the edges' storage (their stats and
health: routes/nodes.py)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from dsec.control.apiserver.core import Apiserver
from dsec.control.iam import current_principal
from dsec.shared.errors import Forbidden
from dsec.shared.wire.models import StorageStats


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    @router.get("/healthz")
    async def healthz() -> dict[str, object]:
        return {"ok": True, "edges": sorted(api.edges)}

    @router.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text format: the edge's counters and per-sandbox cgroup usage (embedded mode has one
        edge; in cluster mode each edge is scraped on its own). The cluster's admin's: the series name
        every project's sandboxes (a project reads its own usage from its sandboxes' usage routes)."""
        p = current_principal.get()
        if not (p.all_projects and p.role == "admin"):
            raise Forbidden("the metrics name every project's sandboxes: scrape them with the cluster's admin token",
                            field="authorization")
        # a scrape reads every sandbox's cgroup (and now and then walks its writable layer): not on the loop
        body = b"".join([await e.metrics_text() for e in api.edges.values()])
        return Response(body, media_type="text/plain; version=0.0.4")

    @router.get("/v1/storage")
    async def storage() -> list[StorageStats]:
        """Per edge: the layer store it reads, its chunk cache, and what it fetched per data blob.
        A project's token gets the node's figures only: the blobs name the layers every project
        runs."""
        stats = [await e.storage_stats() for e in api.edges.values()]
        if current_principal.get().all_projects:
            return stats
        return [s.model_copy(update={"blobs": []}) for s in stats]
    return router
