"""A VM sandbox's display: screenshot, keys, clicks."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from dsec.control.apiserver.core import Apiserver
from dsec.shared.wire.models import (
    ClickRequest,
    KeysRequest,
)


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    @router.get("/v1/sandboxes/{sandbox_id}/screenshot", response_class=Response,
                responses={200: {"content": {"image/png": {}}, "description": "the VM's screen as PNG"}})
    async def screenshot(sandbox_id: str) -> Response:
        return Response(await api.edge_for(sandbox_id).screenshot(sandbox_id), media_type="image/png")

    @router.post("/v1/sandboxes/{sandbox_id}/keys", status_code=204)
    async def send_keys(sandbox_id: str, req: KeysRequest) -> Response:
        await api.edge_for(sandbox_id).send_keys(sandbox_id, req.keys)
        return Response(status_code=204)

    @router.post("/v1/sandboxes/{sandbox_id}/click", status_code=204)
    async def click(sandbox_id: str, req: ClickRequest) -> Response:
        await api.edge_for(sandbox_id).click(sandbox_id, req.x, req.y, req.button)
        return Response(status_code=204)
    return router
