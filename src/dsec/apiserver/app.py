"""The apiserver: the only path between trusted callers and sandboxes.

Stateless: it authenticates, validates, asks placement where a new sandbox goes, and
routes every other request to the edge named in the sandbox id. It keeps no record of
any sandbox, so any number of replicas can serve any request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
from collections.abc import AsyncIterator, Mapping

from fastapi import Depends, FastAPI, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import HTTPConnection

from dsec.edge.api import EdgeAPI
from dsec.errors import AdmissionRejected, DsecError, InvalidRequest, NotFound, PayloadTooLarge, Unauthorized
from dsec.models import (
    CreateRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileStat,
    NodeStats,
    SandboxInfo,
    parse_sandbox_id,
)
from dsec.placement.engine import Placement
from dsec.watcher.watcher import Watcher

log = logging.getLogger("dsec.apiserver")
MAX_CREATE_ATTEMPTS = 3


class Apiserver:
    def __init__(self, edges: Mapping[str, EdgeAPI], watcher: Watcher, placement: Placement,
                 token: str, max_file_bytes: int = 256 * 1024 * 1024) -> None:
        self.edges = edges
        self.watcher = watcher
        self.placement = placement
        self.token = token
        self.max_file_bytes = max_file_bytes

    def edge_for(self, sandbox_id: str) -> EdgeAPI:
        try:
            name = parse_sandbox_id(sandbox_id)
        except ValueError as e:
            raise InvalidRequest(str(e), field="sandbox_id") from None
        edge = self.edges.get(name)
        if edge is None:
            raise NotFound(f"no sandbox {sandbox_id!r}: edge {name!r} is not part of this cluster",
                           field="sandbox_id")
        return edge

    async def create(self, req: CreateRequest) -> SandboxInfo:
        tried: set[str] = set()
        last: AdmissionRejected | None = None
        for _ in range(MAX_CREATE_ATTEMPTS):
            if not self.watcher.view:
                await self.watcher.refresh()
            name = self.placement.choose(req.args, exclude=tried)
            try:
                with self.placement.reserve(name, req.args):
                    return await self.edges[name].create(req.args)
            except AdmissionRejected as e:  # the edge has the final word; re-place elsewhere
                tried.add(name)
                last = e
                with contextlib.suppress(AdmissionRejected):
                    self.placement.choose(req.args, exclude=tried)
                    continue
                break
        raise last or AdmissionRejected("no edge admitted the sandbox")

    async def list(self, job: str | None, labels: dict[str, str]) -> list[SandboxInfo]:
        parts = await asyncio.gather(*(e.list_sandboxes(job=job, labels=labels) for e in self.edges.values()))
        return sorted((i for p in parts for i in p), key=lambda i: i.created_at)


def _error(e: DsecError) -> JSONResponse:
    return JSONResponse({"error": e.code, "message": e.message, "field": e.field}, status_code=e.status)


def _parse_labels(label: list[str]) -> dict[str, str]:
    out = {}
    for item in label:
        if "=" not in item:
            raise InvalidRequest(f"label filter {item!r} must be key=value", field="label")
        k, v = item.split("=", 1)
        out[k] = v
    return out


def build_app(api: Apiserver) -> FastAPI:
    app = FastAPI(title="dsec", version="0.1.0",
                  description="Elastic sandboxes for agentic RL: create, exec, files, HTTP, TTY.")

    @app.exception_handler(DsecError)
    async def _dsec_error(_: Request, e: DsecError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "args")]
        field = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        return _error(InvalidRequest(f"{field}: {msg}" if field else msg, field=field))

    async def auth(request: HTTPConnection) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, cred = header.partition(" ")
        if scheme.lower() != "bearer" or not cred.strip():
            raise Unauthorized("missing or malformed Authorization header; expected 'Bearer <token>'",
                               field="authorization")
        if not hmac.compare_digest(cred.strip().encode(), api.token.encode()):
            raise Unauthorized("invalid token", field="authorization")

    authed = [Depends(auth)]

    @app.get("/healthz")
    async def healthz() -> dict[str, object]:
        return {"ok": True, "edges": sorted(api.edges)}

    @app.get("/v1/nodes", dependencies=authed)
    async def nodes() -> list[NodeStats]:
        return list((await api.watcher.refresh()).values())

    @app.post("/v1/sandboxes", status_code=201, dependencies=authed)
    async def create(req: CreateRequest) -> SandboxInfo:
        return await api.create(req)

    @app.get("/v1/sandboxes", dependencies=authed)
    async def list_sandboxes(job: str | None = None, label: list[str] = Query(default=[])) -> list[SandboxInfo]:
        return await api.list(job, _parse_labels(label))

    @app.get("/v1/sandboxes/{sandbox_id}", dependencies=authed)
    async def get(sandbox_id: str) -> SandboxInfo:
        return await api.edge_for(sandbox_id).get(sandbox_id)

    @app.delete("/v1/sandboxes/{sandbox_id}", dependencies=authed)
    async def stop(sandbox_id: str) -> SandboxInfo:
        return await api.edge_for(sandbox_id).stop(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/exec", dependencies=authed, response_model=None)
    async def exec_(sandbox_id: str, req: ExecRequest, stream: bool = False) -> ExecResult | StreamingResponse:
        edge = api.edge_for(sandbox_id)
        if not stream:
            return await edge.exec(sandbox_id, req)
        await edge.get(sandbox_id)  # a bad id fails before the 200 goes out
        queue: asyncio.Queue[ExecEvent | DsecError | None] = asyncio.Queue()

        def on_data(name: str, data: bytes) -> None:
            queue.put_nowait(ExecEvent(type=name, data=data.decode("utf-8", errors="replace")))  # type: ignore[arg-type]

        async def run() -> None:
            try:
                res = await edge.exec(sandbox_id, req, on_data)
                queue.put_nowait(ExecEvent(type="result", result=res))
            except DsecError as e:
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        task = asyncio.create_task(run())

        async def body() -> AsyncIterator[bytes]:
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, DsecError):
                        yield (json.dumps({"type": "error", "error": item.code, "message": item.message})
                               + "\n").encode()
                    else:
                        yield item.model_dump_json(exclude_none=True).encode() + b"\n"
            finally:
                await task

        return StreamingResponse(body(), media_type="application/x-ndjson")

    @app.get("/v1/sandboxes/{sandbox_id}/files", dependencies=authed)
    async def read_file(sandbox_id: str, path: str) -> Response:
        data = await api.edge_for(sandbox_id).read_file(sandbox_id, path)
        return Response(content=data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files", status_code=204, dependencies=authed)
    async def write_file(sandbox_id: str, path: str, request: Request, mode: int = 0o644) -> Response:
        edge = api.edge_for(sandbox_id)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > api.max_file_bytes:
            raise PayloadTooLarge(f"body of {declared} bytes exceeds the {api.max_file_bytes}-byte file limit",
                                  field="body")
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest("mode must be between 0 and 0o7777", field="mode")
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > api.max_file_bytes:
                raise PayloadTooLarge(f"body exceeds the {api.max_file_bytes}-byte file limit", field="body")
        await edge.write_file(sandbox_id, path, bytes(buf), mode)
        return Response(status_code=204)

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204, dependencies=authed)
    async def remove(sandbox_id: str, path: str, recursive: bool = False) -> Response:
        await api.edge_for(sandbox_id).remove(sandbox_id, path, recursive)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list", dependencies=authed)
    async def list_dir(sandbox_id: str, path: str) -> list[FileStat]:
        return await api.edge_for(sandbox_id).list_dir(sandbox_id, path)

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat", dependencies=authed)
    async def stat(sandbox_id: str, path: str) -> FileStat:
        return await api.edge_for(sandbox_id).stat(sandbox_id, path)

    @app.api_route("/v1/sandboxes/{sandbox_id}/ports/{port}/{path:path}", dependencies=authed,
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

    @app.websocket("/v1/sandboxes/{sandbox_id}/tty")
    async def tty(ws: WebSocket, sandbox_id: str, cols: int = 80, rows: int = 24) -> None:
        try:
            await auth(ws)
            edge = api.edge_for(sandbox_id)
            master, pid, exited, agent = await edge.open_tty(sandbox_id, max(1, min(cols, 1000)),
                                                             max(1, min(rows, 1000)))
        except DsecError as e:
            # accept first so the client sees why (close code 4000 + HTTP status), not a bare 403
            await ws.accept()
            await ws.close(code=4000 + e.status, reason=e.message[:120])
            return
        await ws.accept()
        await _bridge_tty(ws, master, pid, exited, agent, lambda: edge.touch(sandbox_id))

    return app


async def _bridge_tty(ws: WebSocket, master: int, pid: int, exited: asyncio.Future[int],
                      agent: object, touch: object) -> None:
    from dsec.agent.aether import Aether, set_winsize
    from dsec.agent.initclient import exit_code

    assert isinstance(agent, Aether)
    loop = asyncio.get_running_loop()
    out: asyncio.Queue[bytes] = asyncio.Queue()
    os.set_blocking(master, False)

    def readable() -> None:
        try:
            data = os.read(master, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        out.put_nowait(data)
        if not data:
            loop.remove_reader(master)

    loop.add_reader(master, readable)

    async def pump_out() -> None:
        while data := await out.get():
            await ws.send_bytes(data)

    async def pump_in() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("bytes"):
                os.write(master, msg["bytes"])
            elif msg.get("text"):
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    ctl = json.loads(msg["text"])
                    if "resize" in ctl:
                        set_winsize(master, int(ctl["resize"][0]), int(ctl["resize"][1]))
                    if "data" in ctl:
                        os.write(master, str(ctl["data"]).encode())
            if callable(touch):
                touch()

    out_task, in_task = asyncio.create_task(pump_out()), asyncio.create_task(pump_in())
    tasks = [out_task, in_task]
    try:
        await asyncio.wait([out_task, in_task, exited], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
        if exited.done():  # let the last output through
            await asyncio.wait([out_task], timeout=0.5)
    finally:
        if not exited.done():
            with contextlib.suppress(DsecError):
                await agent.init.kill_tree(pid, signal.SIGKILL, 0, include_self=True)
        with contextlib.suppress(asyncio.TimeoutError, DsecError):
            await asyncio.wait_for(asyncio.shield(exited), 2)
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            loop.remove_reader(master)
        os.close(master)
        with contextlib.suppress(Exception):
            code = exit_code(exited.result()) if exited.done() and not exited.exception() else -1
            await ws.send_text(json.dumps({"exit": code}))
            await ws.close()
