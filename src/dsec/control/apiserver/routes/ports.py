"""HTTP to a port inside a sandbox, on the API's own origin. What a sandbox serves here is
hostile to a browser that opens it: the API's cookies (the console's session) never reach
the sandbox, its Set-Cookie never reaches the browser, and its pages run in CSP's sandbox
(an opaque origin: no cookies, no same-origin requests to dsec). A web app meant for a
browser is reached through E2B's per-sandbox hosts (dsec.faces.e2b.ports) instead."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from dsec.control.apiserver.core import Apiserver
from dsec.shared.errors import InvalidRequest

SANDBOXED = {"Content-Security-Policy": "sandbox allow-scripts allow-forms allow-popups allow-downloads",
             "X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY"}


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    @router.api_route("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}",
                      methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def proxy(sandbox_id: str, port: int, path: str, request: Request) -> Response:
        if not 1 <= port <= 65535:
            raise InvalidRequest("port must be 1-65535", field="port")
        body = await request.body()
        skip = {"host", "authorization", "cookie", "content-length", "connection", "transfer-encoding"}
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in skip]
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        resp = await api.edge_for(sandbox_id).http(sandbox_id, port, request.method, target, headers, body)
        out_headers = {k: v for k, v in resp.headers
                       if k.lower() not in ("content-length", "transfer-encoding", "connection", "set-cookie",
                                            "content-security-policy")}
        out_headers.update(SANDBOXED)
        return Response(content=resp.body, status_code=resp.status, headers=out_headers)
    return router
