"""Layers: the catalog, pack_diff (a sandbox's writes as a layer), fork (sandboxes from a snapshot), gc."""

from __future__ import annotations

from fastapi import APIRouter

from dsec.apiserver.core import Apiserver, layer_ref
from dsec.layers.store import Layer
from dsec.wire.models import (
    ForkRequest,
    PackDiffRequest,
    SandboxInfo,
)


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    @router.post("/v1/sandboxes/{sandbox_id}/pack_diff", status_code=201)
    async def pack_diff(sandbox_id: str, req: PackDiffRequest) -> Layer:
        return await api.edge_for(sandbox_id).pack_diff(sandbox_id, req.ref, req.scrub_paths, req.default_scrub)

    @router.post("/v1/fork", status_code=201)
    async def fork(req: ForkRequest) -> list[SandboxInfo]:
        return await api.fork(req)

    @router.get("/v1/layers")
    async def list_layers() -> list[Layer]:
        return api.layers.list()

    @router.post("/v1/layers/gc")
    async def gc_layers() -> dict[str, list[str]]:
        for e in api.edges.values():
            await e.release_layers()
        return {"removed_blobs": api.layers.gc(await api.layers_in_use())}

    @router.get("/v1/layers/{ref:path}")
    async def get_layer(ref: str) -> Layer:
        return api.layers.get(layer_ref(ref))

    @router.delete("/v1/layers/{ref:path}")
    async def remove_layer(ref: str) -> Layer:
        return api.layers.remove(layer_ref(ref), await api.layers_in_use())
    return router
