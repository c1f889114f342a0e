"""E2B's traffic to a sandbox's own ports. A request that carries ``E2b-Sandbox-Port``
(other than envd's) is passed to that port inside the sandbox and the response streamed
back as it comes, as E2B's proxy does; this is how the code interpreter SDK reaches its
Jupyter server on 49999. The credential is the sandbox's traffic token (E2B's
``E2B-Traffic-Access-Token``, good for its ports only) or its envd access token, both bound
to the token that made the sandbox (dsec.control.iam.bound): a response still streaming when that
token is revoked ends within the apiserver's re-check period; the path,
query, method, headers (less E2B's own and hop-by-hop ones) and body go through as sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from dsec.control.console.session import without_session
from dsec.control.iam.bound import ENVD, TRAFFIC, BoundKeys
from dsec.node.edge.api import EdgeAPI
from dsec.shared.errors import DsecError, NotFound, SandboxError, SandboxNotRunning
from dsec.shared.wire.edge import HttpPart

ENVD_PORT = 49983
MAX_BODY = 64 << 20
READ_TIMEOUT_S = 3600.0  # a silent stretch of a long computation; the client keeps its own deadline
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                        "proxy-authorization", "proxy-authenticate", "content-length", "host"})


class PortProxy:
    """ASGI middleware in front of the apiserver."""

    def __init__(self, app: Any, edge_for: Callable[[str], EdgeAPI], keys: BoundKeys) -> None:
        self.app, self.edge_for, self.keys = app, edge_for, keys

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        port = dict(scope.get("headers", [])).get(b"e2b-sandbox-port") if scope["type"] == "http" else None
        if port is None or port == str(ENVD_PORT).encode():
            await self.app(scope, receive, send)
            return
        from dsec.faces.front.auth import while_valid  # the apiserver's own watch on long-lived responses
        token_id: str | None = None
        response = await self._forward(Request(scope, receive), port.decode(errors="replace"))
        if isinstance(response, tuple):
            response, token_id = response
        if token_id is None:
            await response(scope, receive, send)
            return
        live_token = token_id

        async def recheck() -> bool:  # a streamed response ends once the sandbox's token is revoked
            return await self.keys.tokens.live(live_token)
        await while_valid(response, scope, receive, send, recheck)

    async def _credential(self, request: Request, sid: str) -> str | None:
        """The token id behind the request's traffic token (or envd access token), if it is
        this sandbox's and its token still lives."""
        traffic, envd = request.headers.get("e2b-traffic-access-token"), request.headers.get("x-access-token")
        if traffic and (token_id := await self.keys.check(TRAFFIC, sid, traffic)) is not None:
            return token_id
        if envd:
            return await self.keys.check(ENVD, sid, envd)
        return None

    async def _forward(self, request: Request, raw_port: str) -> Response | tuple[Response, str]:
        sid = request.headers.get("e2b-sandbox-id", "")
        if not raw_port.isdigit() or not 0 < int(raw_port) < 65536:
            return _error(400, f"E2b-Sandbox-Port must be a port number, not {raw_port!r}")
        token_id = await self._credential(request, sid) if sid else None
        if token_id is None:
            return _error(401, "missing, wrong or revoked E2B-Traffic-Access-Token (or X-Access-Token) for this "
                          "sandbox")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                return _error(413, f"request body over {MAX_BODY} bytes")
        headers = [(k, without_session(v) if k == "cookie" else v) for k, v in request.headers.items()
                   if k not in HOP_BY_HOP and not k.startswith("e2b-") and k != "x-access-token"]  # ours, not theirs
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        port = int(raw_port)
        try:
            stream = self.edge_for(sid).http_stream(sid, port, request.method, path, headers, body, READ_TIMEOUT_S)
            head = await anext(stream)
        except (NotFound, SandboxNotRunning):
            return JSONResponse({"code": 502, "message": "The sandbox was not found", "sandboxId": sid},
                                status_code=502)
        except SandboxError as e:
            return JSONResponse({"code": 502, "message": f"The sandbox is running but port is not open ({e.message})",
                                 "sandboxId": sid, "port": port}, status_code=502)
        except DsecError as e:
            return _error(e.status, e.message)
        return StreamingResponse(_body(stream), status_code=head.status or 502,
                                 headers={k: v for k, v in head.headers if k.lower() not in HOP_BY_HOP}), token_id


async def _body(stream: AsyncIterator[HttpPart]) -> AsyncIterator[bytes]:
    try:
        async for part in stream:
            yield part.data
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)
