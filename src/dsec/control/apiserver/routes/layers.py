"""Layers: the catalog, pack_diff (a sandbox's writes as a layer), fork (sandboxes from a snapshot), gc;
and who may see each layer (dsec.control.iam.visibility): lists and reads show only the layers the caller's
project may see, a hidden layer answers as an unknown one, and only the owner project's builders and
admins (or admins above it) remove a layer or change its visibility."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import Field, field_validator

from dsec.control.apiserver.core import Apiserver, layer_ref
from dsec.control.iam import Principal, current_principal
from dsec.control.iam.visibility import AclRow, LayerAcl, Visibility, may_see
from dsec.node.layers.store import Layer
from dsec.shared.errors import Forbidden, InvalidRequest, NotFound
from dsec.shared.wire.iam import check_project
from dsec.shared.wire.models import (
    ForkRequest,
    PackDiffRequest,
    SandboxInfo,
    Strict,
)


class VisibilityPatch(Strict):
    """A change of a layer's visibility (``PATCH /v1/layers/{ref}``)."""

    visibility: Visibility
    project: str | None = Field(default=None, description="a new owner project: the cluster admin's alone "
                                "(a layer that has no owner, as a base image, gets 'default' unless named)")

    @field_validator("project")
    @classmethod
    def _project(cls, v: str | None) -> str | None:
        return check_project(v) if v is not None else None


def _shown(layer: Layer, row: AclRow | None) -> Layer:
    """The layer with its owner and visibility (no row: no owner, public)."""
    if row is None:
        return layer
    return layer.model_copy(update={"owner": row.project, "visibility": row.visibility})


def _may_change(p: Principal, ref: str, row: AclRow | None, what: str) -> None:
    """Changing a layer (removing it, its visibility) is for whoever covers its owner; a layer
    no project owns (a base image, an import) is the cluster's admin's alone. Holding
    ``layers:write`` is the middleware's check."""
    if row is None:
        if not p.all_projects:
            raise Forbidden(f"layer {ref!r} belongs to no project: only the cluster's admin may {what} it",
                            field="ref")
    elif not p.covers(row.project):
        raise Forbidden(f"layer {ref!r} belongs to project {row.project!r}: a token of project {p.project!r} "
                        f"may not {what} it", field="ref")


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    acl = LayerAcl(api.tokens.db)

    async def _visible(ref: str) -> tuple[Layer, AclRow | None]:
        """The layer and its row; a layer the caller may not see is refused exactly as an
        unknown one is (LayerStore.get's message), so that its existence does not leak."""
        layer = api.layers.get(layer_ref(ref))
        row = await asyncio.to_thread(acl.get, layer.ref)
        if row is not None and not may_see(current_principal.get(), row.project, row.visibility):
            raise NotFound(f"unknown layer {layer.ref!r}", field="ref")
        return layer, row

    @router.post("/v1/sandboxes/{sandbox_id}/pack_diff", status_code=201)
    async def pack_diff(sandbox_id: str, req: PackDiffRequest) -> Layer:
        """The new layer belongs to the sandbox's project (not the caller's: an admin above it
        publishes for that project) with the visibility asked for (Apiserver.publish)."""
        visibility = req.visibility if "visibility" in req.model_fields_set else None
        return _shown(*await api.publish(sandbox_id, layer_ref(req.ref), scrub_paths=req.scrub_paths,
                                         default_scrub=req.default_scrub, visibility=visibility))

    @router.post("/v1/fork", status_code=201)
    async def fork(req: ForkRequest) -> list[SandboxInfo]:
        return await api.fork(req)

    @router.get("/v1/layers")
    async def list_layers() -> list[Layer]:
        """The layers the caller's project may see."""
        layers = api.layers.list()
        rows = await asyncio.to_thread(acl.rows)
        p = current_principal.get()
        return [_shown(layer, row) for layer in layers
                if (row := rows.get(layer.ref)) is None or may_see(p, row.project, row.visibility)]

    @router.post("/v1/layers/gc")
    async def gc_layers() -> dict[str, list[str]]:
        for e in api.edges.values():
            await e.release_layers()
        await asyncio.to_thread(api.checkpoints.gc)  # command logs no checkpoint names
        return {"removed_blobs": api.layers.gc(await api.layers_in_use())}

    @router.get("/v1/layers/{ref:path}")
    async def get_layer(ref: str) -> Layer:
        return _shown(*await _visible(ref))

    @router.patch("/v1/layers/{ref:path}")
    async def set_layer_visibility(ref: str, req: VisibilityPatch) -> Layer:
        """Change who may see the layer: its owner project's builders and admins, and admins
        above it; the cluster's admin may also give it an owner (``project``)."""
        layer, row = await _visible(ref)
        p = current_principal.get()
        _may_change(p, layer.ref, row, "change")
        if row is None and req.project is None:
            if req.visibility == "public":
                return _shown(layer, None)  # an unowned layer is public already
            raise InvalidRequest(f"layer {layer.ref!r} belongs to no project: name the project to own it",
                                 field="project")
        owner = req.project or (row.project if row is not None else "default")
        if row is not None and owner != row.project and not p.all_projects:
            raise Forbidden(f"only the cluster's admin moves a layer to another project (it is {row.project!r}'s)",
                            field="project")
        row = await asyncio.to_thread(acl.set, layer.ref, owner, req.visibility, p.token_id)
        return _shown(layer, row)

    @router.delete("/v1/layers/{ref:path}")
    async def remove_layer(ref: str) -> Layer:
        layer, row = await _visible(ref)
        _may_change(current_principal.get(), layer.ref, row, "remove")
        removed = api.layers.remove(layer.ref, await api.layers_in_use())
        if row is not None:
            await asyncio.to_thread(acl.drop, layer.ref, row)
        return _shown(removed, row)
    return router
