"""Commands (one-shot, in a session, or streamed as NDJSON) and the interactive TTY (a websocket)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from dsec.control.apiserver.core import MAX_EXEC_BODY, Apiserver, parse_body, read_body
from dsec.node.edge.interactive import InputBuffer
from dsec.shared.errors import DsecError
from dsec.shared.wire.edge import TtyInput
from dsec.shared.wire.models import CommandRecord, ExecRequest


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

    @router.get("/v1/sandboxes/{sandbox_id}/commands")
    async def commands(sandbox_id: str, after: int = Query(default=0, ge=0),
                       limit: int = Query(default=1000, ge=1, le=10_000)) -> list[CommandRecord]:
        """The sandbox's command log: its keyed commands in the order they started (``seq``
        greater than ``after``), each with its result once it has one (docs/rl.md)."""
        return await api.edge_for(sandbox_id).command_log(sandbox_id, after, limit)

    @router.websocket("/v1/sandboxes/{sandbox_id}/tty")
    async def tty(ws: WebSocket, sandbox_id: str, cols: int = 80, rows: int = 24) -> None:
        await ws.accept()
        keys = InputBuffer()
        try:
            session = api.edge_for(sandbox_id).tty(sandbox_id, cols, rows, keys.__aiter__())
            await anext(session)  # the shell is up (or why not)
        except DsecError as e:
            # the close code carries the HTTP status (4000 + status) and the reason
            await ws.close(code=4000 + e.status, reason=e.message[:120])
            return

        async def output() -> None:
            async for out in session:
                if out.data:
                    await ws.send_bytes(out.data)
                if out.exit_code is not None:
                    await ws.send_text(json.dumps({"exit": out.exit_code}))

        # the terminal is read on its own, never waiting on the shell: a client that goes
        # away ends the session even while the shell takes no input
        reader = asyncio.create_task(_read_terminal(ws, keys))
        shown = asyncio.create_task(output())
        try:
            await asyncio.wait([reader, shown], return_when=asyncio.FIRST_COMPLETED)
            if shown.done() and shown.exception() is None:
                with contextlib.suppress(Exception):
                    await ws.close()
            elif shown.done() and isinstance(shown.exception(), DsecError):
                err = shown.exception()
                assert isinstance(err, DsecError)
                with contextlib.suppress(Exception):
                    await ws.close(code=4000 + err.status, reason=err.message[:120])
        finally:
            for t in (reader, shown):
                t.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(reader, shown, return_exceptions=True)
            await session.aclose()  # type: ignore[attr-defined]
    return router


async def _read_terminal(ws: WebSocket, keys: InputBuffer) -> None:
    """What the user's terminal sends: bytes are keystrokes; text is JSON control
    ({"resize": [cols, rows]} or {"data": "..."}). Ends the input when the client goes away."""
    try:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("bytes"):
                keys.push(TtyInput(data=msg["bytes"]), len(msg["bytes"]))
            elif msg.get("text"):
                with contextlib.suppress(ValueError, KeyError, TypeError, ValidationError):
                    ctl = json.loads(msg["text"])
                    if "resize" in ctl:
                        keys.push(TtyInput(resize=(int(ctl["resize"][0]), int(ctl["resize"][1]))), 16)
                    if "data" in ctl:
                        data = str(ctl["data"]).encode()
                        keys.push(TtyInput(data=data), len(data))
    except (WebSocketDisconnect, RuntimeError):
        return
    finally:
        keys.end()
