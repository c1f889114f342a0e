"""Files inside a sandbox: read, write, list, stat, remove."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from dsec.control.apiserver.core import Apiserver, read_body
from dsec.shared.errors import InvalidRequest
from dsec.shared.wire.models import FileStat


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    @router.get("/v1/sandboxes/{sandbox_id}/files")
    async def read_file(sandbox_id: str, path: str) -> Response:
        data = await api.edge_for(sandbox_id).read_file(sandbox_id, path)
        return Response(content=data, media_type="application/octet-stream")

    @router.put("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def write_file(sandbox_id: str, path: str, request: Request, mode: int = 0o644) -> Response:
        edge = api.edge_for(sandbox_id)
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest("mode must be between 0 and 0o7777", field="mode")
        await edge.write_file(sandbox_id, path, await read_body(request, api.max_file_bytes, "body"), mode)
        return Response(status_code=204)

    @router.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def remove(sandbox_id: str, path: str, recursive: bool = False) -> Response:
        await api.edge_for(sandbox_id).remove(sandbox_id, path, recursive)
        return Response(status_code=204)

    @router.get("/v1/sandboxes/{sandbox_id}/files/list")
    async def list_dir(sandbox_id: str, path: str) -> list[FileStat]:
        return await api.edge_for(sandbox_id).list_dir(sandbox_id, path)

    @router.get("/v1/sandboxes/{sandbox_id}/files/stat")
    async def stat(sandbox_id: str, path: str) -> FileStat:
        return await api.edge_for(sandbox_id).stat(sandbox_id, path)
    return router
