"""The edge daemon's HTTP face (``dsec edge serve``): every operation of the edge
contract, served from one in-process edge, to callers holding the cluster secret.

Every request carries ``Authorization: Bearer <cluster secret>``; anything else is
refused (401) before it is read. The daemon keeps no state of its own: it is the edge.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import WSMsgType, web
from pydantic import ValidationError

from dsec.node.edge.api import EdgeAPI
from dsec.node.edge.interactive import InputBuffer
from dsec.node.edge.remote.ops import CANCEL, END, ERROR, FAILED, ITEM, OK, Op, error_json, ops
from dsec.shared import tracing
from dsec.shared.errors import DsecError, InvalidRequest, NotFound, Unauthorized
from dsec.shared.meta.db import unavailable

log = logging.getLogger("dsec.edge.remote")
HEARTBEAT_S = 20.0
ARGS_TIMEOUT_S = 30.0  # a peer that stops answering pings is dropped (its streams end)


def _error(e: DsecError) -> web.Response:
    return web.json_response(error_json(e), status=e.status)


def _internal(op: str, e: BaseException) -> DsecError:
    if (away := unavailable(e)) is not None:  # the cluster's database (the layer catalog) is away
        log.warning("edge operation %s: %s", op, away.message)
        away.operation = op
        return away
    log.exception("edge operation %s failed", op, exc_info=e)
    return DsecError(f"{op}: {type(e).__name__}: {e}", operation=op)


def _bad_args(op: Op, e: ValidationError) -> InvalidRequest:
    first: dict[str, Any] = dict(e.errors()[0]) if e.errors() else {}
    field = ".".join(str(x) for x in first.get("loc", ())) or None
    return InvalidRequest(f"{op.name}: {field or 'arguments'}: {first.get('msg', 'invalid')}", field, operation=op.name)


def build_app(edge: EdgeAPI, secret: str, max_body: int) -> web.Application:
    """The daemon's aiohttp application for ``edge``; ``max_body`` bounds a request body
    (a file written whole)."""
    if not secret:
        raise ValueError("the cluster secret is empty")
    token = f"Bearer {secret}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, token):
            return _error(Unauthorized("missing or wrong cluster secret"))
        return await handler(request)

    app = web.Application(middlewares=[auth], client_max_size=max_body + (1 << 20))
    open_streams: set[web.WebSocketResponse] = set()

    def op_of(request: web.Request, stream: bool) -> Op:
        op = ops().get(request.match_info["op"])
        if op is None or op.stream != stream:
            raise NotFound(f"no {'stream' if stream else 'unary'} operation {request.match_info['op']!r}",
                           field="op")
        return op

    async def call(request: web.Request) -> web.Response:
        try:
            op = op_of(request, stream=False)
            try:
                raw = await request.read()
                if op.body is not None:  # the arguments' JSON line, then the raw bytes
                    head, nl, data = raw.partition(b"\n")
                    if not nl:
                        raise InvalidRequest(f"{op.name}: the body is the arguments' JSON line, then the bytes",
                                             field="body")
                    kwargs = op.decode_args(head)
                    kwargs[op.body] = data
                else:
                    kwargs = op.decode_args(raw)
            except ValidationError as e:
                raise _bad_args(op, e) from None
            with tracing.extracted(request.headers), tracing.span(f"edge.call {op.name}", kind="server",
                                                                 edge=getattr(edge, "name", None)):
                result = await _invoke(edge, op, kwargs)
        except DsecError as e:
            return _error(e)
        if op.raw_result:
            return web.Response(body=result, content_type="application/octet-stream")
        if op.result is None:
            return web.Response(status=204)
        try:
            body = op.encode_result(result)
        except Exception as e:  # noqa: BLE001 - a result that does not serialize is still an answer
            return _error(_internal(op.name, e))
        return web.Response(body=body, content_type="application/json")

    async def calls(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=max_body + (1 << 20))
        await ws.prepare(request)
        open_streams.add(ws)
        try:
            await _serve_calls(edge, ws)
        finally:
            open_streams.discard(ws)
            await ws.close()
        return ws

    async def stream(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(heartbeat=HEARTBEAT_S, max_msg_size=max_body + (1 << 20))
        await ws.prepare(request)
        open_streams.add(ws)
        try:
            with tracing.extracted(request.headers), tracing.span(
                    f"edge.stream {request.match_info['op']}", kind="server", edge=getattr(edge, "name", None)):
                await _serve_stream(edge, ws, request)
        finally:
            open_streams.discard(ws)
            await ws.close()
        return ws

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "edge": edge.name})

    async def close_streams(_: web.Application) -> None:
        for ws in list(open_streams):
            await ws.close(code=1001, message=b"the edge is shutting down")

    app.router.add_post("/v1/call/{op}", call)
    app.router.add_get("/v1/stream/{op}", stream)
    app.router.add_get("/v1/calls", calls)
    app.router.add_get("/healthz", healthz)
    app.on_shutdown.append(close_streams)
    return app


async def _invoke(edge: EdgeAPI, op: Op, kwargs: dict[str, Any]) -> Any:
    try:
        return await getattr(edge, op.name)(**kwargs)
    except DsecError:
        raise
    except Exception as e:  # noqa: BLE001 - reported to the caller, logged here
        raise _internal(op.name, e) from None


async def _serve_calls(edge: EdgeAPI, ws: web.WebSocketResponse) -> None:
    """Unary calls multiplexed on one connection, each in a task of its own; a caller
    that goes away (or cancels one) cancels what it asked for."""
    tasks: dict[str, asyncio.Task[None]] = {}

    async def run(cid: str, name: str, raw: str) -> None:
        try:
            op = ops().get(name)
            if op is None or not op.multiplexed:
                raise NotFound(f"no multiplexed operation {name!r}", field="op")
            try:
                kwargs = op.decode_args(raw)
            except ValidationError as e:
                raise _bad_args(op, e) from None
            result = await _invoke(edge, op, kwargs)
            try:
                frame = f"{cid} {OK}" + op.encode_result(result).decode()
            except Exception as e:  # noqa: BLE001 - a result that does not serialize is still an answer
                raise _internal(name, e) from None
        except DsecError as e:
            frame = f"{cid} {FAILED}" + json.dumps(error_json(e))
        finally:
            tasks.pop(cid, None)
        if not ws.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await ws.send_str(frame)

    try:
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                continue
            cid, _, rest = msg.data.partition(" ")
            name, _, raw = rest.partition(" ")
            if name == CANCEL:
                if (t := tasks.get(cid)) is not None:
                    t.cancel()
            elif cid not in tasks:
                tasks[cid] = asyncio.create_task(run(cid, name, raw))
    finally:
        for t in list(tasks.values()):  # the caller is gone: nobody waits for these
            t.cancel()


async def _serve_stream(edge: EdgeAPI, ws: web.WebSocketResponse, request: web.Request) -> None:
    """One stream: the arguments come first; then items go out until the stream ends,
    fails, or the caller goes away (which closes the edge's iterator, ending its work)."""
    gen: AsyncIterator[Any] | None = None
    try:
        op = ops().get(request.match_info["op"])
        if op is None or not op.stream:
            raise NotFound(f"no stream operation {request.match_info['op']!r}", field="op")
        try:  # a caller that opens a stream and never says what it wants does not hold it
            first = await ws.receive(timeout=ARGS_TIMEOUT_S)
        except TimeoutError:
            raise InvalidRequest(f"{op.name}: no arguments within {ARGS_TIMEOUT_S:g} s", field="op") from None
        if first.type != WSMsgType.TEXT:
            return
        try:
            kwargs = op.decode_args(first.data)
        except ValidationError as e:
            raise _bad_args(op, e) from None
        inputs = InputBuffer()
        if op.input is not None:
            kwargs[op.input] = inputs.__aiter__()
        gen = getattr(edge, op.name)(**kwargs)
        assert gen is not None and op.item is not None
        pump = asyncio.create_task(_pump(gen, ws, op))
        reader = asyncio.create_task(_read_inputs(ws, op, inputs))
        done, _ = await asyncio.wait([pump, reader], return_when=asyncio.FIRST_COMPLETED)
        if pump not in done:  # the caller went away: end the work
            pump.cancel()
        else:
            reader.cancel()
        for t in (pump, reader):
            with contextlib.suppress(asyncio.CancelledError):
                await t
    except DsecError as e:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_str(ERROR + json.dumps(error_json(e)))
    finally:
        if gen is not None:
            with contextlib.suppress(Exception):
                await gen.aclose()  # type: ignore[attr-defined]


async def _pump(gen: AsyncIterator[Any], ws: web.WebSocketResponse, op: Op) -> None:
    assert op.item is not None
    try:
        async for item in gen:
            await ws.send_str(ITEM + op.item.dump_json(item).decode())
        await ws.send_str(END)
    except DsecError as e:
        await ws.send_str(ERROR + json.dumps(error_json(e)))
    except (ConnectionError, RuntimeError) as e:
        if ws.closed:
            return  # the caller went away mid-stream
        await ws.send_str(ERROR + json.dumps(error_json(_internal(op.name, e))))
    except Exception as e:  # noqa: BLE001 - reported to the caller, logged here
        await ws.send_str(ERROR + json.dumps(error_json(_internal(op.name, e))))


async def _read_inputs(ws: web.WebSocketResponse, op: Op, inputs: InputBuffer) -> None:
    """Input items into the buffer, never waiting on its consumer; returns when the caller
    goes away. Input that does not parse ends the input."""
    async for msg in ws:
        if msg.type != WSMsgType.TEXT or op.input_item is None:
            continue
        if msg.data == END:
            inputs.end()
            continue
        try:
            inputs.push(op.input_item.validate_json(msg.data[1:]), len(msg.data))
        except ValidationError:
            inputs.end()
    inputs.end()
