"""Commands (one-shot, in a session, or streamed as NDJSON) and the interactive TTY (a websocket)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from dsec.apiserver.core import MAX_EXEC_BODY, Apiserver, parse_body, read_body
from dsec.errors import DsecError
from dsec.wire.edge import TtyInput
from dsec.wire.models import ExecRequest


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    exec_body = {"content": {"application/json": {"schema": ExecRequest.model_json_schema()}}, "required": True}

    @router.post("/v1/sandboxes/{sandbox_id}/exec", response_model=None,
                 openapi_extra={"requestBody": exec_body},
                 responses={200: {"description": "ExecResult, or NDJSON ExecEvents with ?stream=true"}})
    async def exec_(sandbox_id: str, request: Request, stream: bool = False) -> Response:
        # the hot path: the body is parsed by pydantic-core directly (FastAPI's body
        # machinery costs ~0.5 ms a call here) and the result serialized once
        req = parse_body(ExecRequest, await read_body(request, MAX_EXEC_BODY, "body"))
        edge = api.edge_for(sandbox_id)
        if not stream:  # the hot path: serialize once, skip FastAPI's re-validation
            res = await edge.exec(sandbox_id, req)
            return Response(res.model_dump_json(), media_type="application/json")
        await edge.get(sandbox_id)  # a bad id fails before the 200 goes out
        events = edge.exec_stream(sandbox_id, req)

        async def body() -> AsyncIterator[bytes]:
            try:  # closing the stream (the client went away) stops the command
                async for item in events:
                    yield item.model_dump_json(exclude_none=True).encode() + b"\n"
            except DsecError as e:
                yield (json.dumps({"type": "error", "error": e.code, "message": e.message}) + "\n").encode()
            finally:
                await events.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(body(), media_type="application/x-ndjson")

    @router.websocket("/v1/sandboxes/{sandbox_id}/tty")
    async def tty(ws: WebSocket, sandbox_id: str, cols: int = 80, rows: int = 24) -> None:
        await ws.accept()
        try:
            session = api.edge_for(sandbox_id).tty(sandbox_id, cols, rows, _tty_input(ws))
            await anext(session)  # the shell is up (or why not)
        except DsecError as e:
            # the close code carries the HTTP status (4000 + status) and the reason
            await ws.close(code=4000 + e.status, reason=e.message[:120])
            return
        try:
            async for out in session:
                if out.data:
                    await ws.send_bytes(out.data)
                if out.exit_code is not None:
                    await ws.send_text(json.dumps({"exit": out.exit_code}))
            with contextlib.suppress(Exception):
                await ws.close()
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client went away: closing the session kills the shell
        finally:
            await session.aclose()  # type: ignore[attr-defined]
    return router


async def _tty_input(ws: WebSocket) -> AsyncIterator[TtyInput]:
    """What the user's terminal sends: bytes are keystrokes; text is JSON control
    ({"resize": [cols, rows]} or {"data": "..."}). Ends when the client goes away."""
    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return
        if msg.get("bytes"):
            yield TtyInput(data=msg["bytes"])
        elif msg.get("text"):
            with contextlib.suppress(ValueError, KeyError, TypeError, ValidationError):
                ctl = json.loads(msg["text"])
                if "resize" in ctl:
                    yield TtyInput(resize=(int(ctl["resize"][0]), int(ctl["resize"][1])))
                if "data" in ctl:
                    yield TtyInput(data=str(ctl["data"]).encode())
