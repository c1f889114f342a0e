"""HTTP to a port inside a sandbox."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from dsec.apiserver.core import Apiserver
from dsec.errors import InvalidRequest


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    @router.api_route("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}",
                      methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def proxy(sandbox_id: str, port: int, path: str, request: Request) -> Response:
        if not 1 <= port <= 65535:
            raise InvalidRequest("port must be 1-65535", field="port")
        body = await request.body()
        skip = {"host", "authorization", "content-length", "connection", "transfer-encoding"}
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in skip]
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        resp = await api.edge_for(sandbox_id).http(sandbox_id, port, request.method, target, headers, body)
        out_headers = {k: v for k, v in resp.headers
                       if k.lower() not in ("content-length", "transfer-encoding", "connection")}
        return Response(content=resp.body, status_code=resp.status, headers=out_headers)
    return router
