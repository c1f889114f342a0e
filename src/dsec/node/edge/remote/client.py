"""RemoteEdge: the edge contract, reached over the network from an edge daemon.

It has every method of :class:`~dsec.node.edge.api.EdgeAPI` (made from the Protocol's
operations, see :mod:`dsec.node.edge.remote.ops`), so the apiserver, the E2B face and FnCall
routing hold a ``RemoteEdge`` exactly as they hold the in-process edge. One aiohttp
session per edge keeps its connections alive; an edge that cannot be reached is
:class:`~dsec.shared.errors.EdgeUnavailable`, and errors the edge raised arrive as the same
typed exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from dsec.node.edge import api
from dsec.node.edge.remote.ops import CANCEL, END, ERROR, ITEM, OK, Op, error_from, ops
from dsec.shared import tracing
from dsec.shared.errors import DeadlineExceeded, EdgeUnavailable

CONNECT_TIMEOUT_S = 5.0
CALL_BOUND_S = 1800.0  # no unary call outlives this (a VM create, a big pack_diff take minutes at most)
EXEC_MARGIN_S = 60.0  # an exec may run its own timeout plus this
HEARTBEAT_S = 20.0


class RemoteEdge(api.SandboxOps, api.ExecOps, api.FileOps, api.NetworkOps, api.NodeOps, api.LayerOps,
                 api.FnCallOps, api.FleetOps, api.SnapshotOps):
    """An edge daemon at ``url`` (``http://host:port``, or ``https://`` with ``tls``: the
    client context of dsec.shared.tls, which presents this side's certificate and
    checks the edge's), known to the cluster as ``name``."""

    def __init__(self, name: str, url: str, secret: str, max_connections: int = 256,
                 tls: ssl.SSLContext | None = None) -> None:
        self.name, self.url = name, url.rstrip("/")
        if self.url.startswith("https://") and tls is None:
            raise ValueError(f"edge {name}: {url} is TLS, and this apiserver has no certificate (--tls-cert)")
        self._tls = tls
        self._auth = {"Authorization": f"Bearer {secret}"}
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._calls = _Calls(self)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # idle connections are dropped before the daemon's keep-alive would (75 s), so
            # a request never goes out on a connection the daemon is closing
            # (kept alive, a TLS connection's handshake is paid once, not per request)
            conn = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=30,
                                        ssl=self._tls if self._tls is not None else True)
            self._session = aiohttp.ClientSession(
                connector=conn, headers=self._auth,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S))
        return self._session

    async def close(self) -> None:
        await self._calls.close()
        if self._session is not None:
            await self._session.close()

    def _unreachable(self, op: str, e: BaseException, connecting: bool = False) -> EdgeUnavailable:
        out = EdgeUnavailable(f"edge {self.name} ({self.url}) did not answer {op}: {type(e).__name__}: {e}"
                              .rstrip(": "), operation=op)
        # a connection never made carried nothing (a timeout while connecting may have: a
        # frozen daemon accepts TCP, and a TLS handshake may end after the request went)
        out.sent = not (connecting or isinstance(e, aiohttp.ClientConnectorError))
        return out

    async def _call(self, op: Op, arguments: dict[str, Any]) -> Any:
        data = op.encode_args(arguments)
        bound = CALL_BOUND_S
        if op.name == "exec":
            bound = arguments["req"].timeout_s + EXEC_MARGIN_S
        if op.multiplexed and not tracing.on():  # a traced call needs its own headers (traceparent)
            return op.decode_result(await self._calls.call(op.name, data.decode(), bound))
        headers = {"Content-Type": "application/octet-stream" if op.body is not None else "application/json"}
        tracing.inject(headers)
        if op.body is not None:  # the arguments' JSON line, then the raw bytes
            data = data + b"\n" + arguments[op.body]
        try:
            async with asyncio.timeout(bound):
                async with self._http().post(f"{self.url}/v1/call/{op.name}", data=data, headers=headers) as resp:
                    body = await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise self._unreachable(op.name, e) from None
        if resp.status >= 400:
            try:
                err = json.loads(body)
            except ValueError:
                err = {"error": "edge_unavailable" if resp.status >= 500 else "internal",
                       "message": body[:200].decode(errors="replace")}
            raise error_from(err, f"edge {self.name}: {op.name} failed with HTTP {resp.status}")
        if op.raw_result:
            return body
        if op.result is None:
            return None
        return op.result.validate_json(body)

    async def _stream(self, op: Op, arguments: dict[str, Any]) -> AsyncIterator[Any]:
        assert op.item is not None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):  # a frozen daemon still accepts TCP
                traced: dict[str, str] = {}
                tracing.inject(traced)
                ws = await self._http().ws_connect(f"{self.url}/v1/stream/{op.name}", heartbeat=HEARTBEAT_S,
                                                   max_msg_size=0, headers=traced)
        except aiohttp.WSServerHandshakeError as e:
            raise error_from({"error": {401: "unauthorized", 404: "not_found"}.get(e.status, "edge_unavailable"),
                              "message": f"edge {self.name}: {op.name}: HTTP {e.status} {e.message}"}, "") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise self._unreachable(op.name, e) from None
        sender: asyncio.Task[None] | None = None
        try:
            await ws.send_str(op.encode_args(arguments).decode())
            if op.input is not None:
                sender = asyncio.create_task(self._send_inputs(ws, op, arguments[op.input]))
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                kind = msg.data[:1]
                if kind == ITEM:
                    yield op.item.validate_json(msg.data[1:])
                elif kind == END:
                    return
                elif kind == ERROR:
                    raise error_from(json.loads(msg.data[1:]), f"edge {self.name}: {op.name} failed")
            raise EdgeUnavailable(f"edge {self.name} ({self.url}) ended {op.name} before its end"
                                  + (f" (close code {ws.close_code})" if ws.close_code else ""), operation=op.name)
        except (aiohttp.ClientError, OSError) as e:
            raise self._unreachable(op.name, e) from None
        finally:
            if sender is not None:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sender
            await ws.close()

    @staticmethod
    async def _send_inputs(ws: aiohttp.ClientWebSocketResponse, op: Op, items: AsyncIterator[Any]) -> None:
        assert op.input_item is not None
        with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError):
            async for item in items:
                await ws.send_str(ITEM + op.input_item.dump_json(item).decode())
            await ws.send_str(END)


class _Calls:
    """One WebSocket to the edge carrying every small unary call, matched by id; lost
    with the connection (pending calls fail as EdgeUnavailable), made again by the next
    call. A call given up on (cancelled, or past its bound) is cancelled at the edge."""

    def __init__(self, edge: RemoteEdge) -> None:
        self.edge = edge
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.reader: asyncio.Task[None] | None = None
        self.pending: dict[str, asyncio.Future[tuple[bool, str]]] = {}
        self.ids = itertools.count(1)
        self.connecting = asyncio.Lock()
        self.cancels: set[asyncio.Future[None]] = set()

    async def _ws(self, op: str) -> aiohttp.ClientWebSocketResponse:
        if self.ws is not None and not self.ws.closed:
            return self.ws
        async with self.connecting:
            if self.ws is None or self.ws.closed:
                try:
                    async with asyncio.timeout(CONNECT_TIMEOUT_S):  # a frozen daemon still accepts TCP
                        self.ws = await self.edge._http().ws_connect(f"{self.edge.url}/v1/calls",
                                                                     heartbeat=HEARTBEAT_S, max_msg_size=0)
                except aiohttp.WSServerHandshakeError as e:
                    raise error_from({"error": "unauthorized" if e.status == 401 else "edge_unavailable",
                                      "message": f"edge {self.edge.name}: {op}: HTTP {e.status} {e.message}"},
                                     "") from None
                except (aiohttp.ClientError, TimeoutError, OSError) as e:  # no call was sent on it
                    raise self.edge._unreachable(op, e, connecting=True) from None
                self.reader = asyncio.create_task(self._read(self.ws))
            return self.ws

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                cid, _, rest = msg.data.partition(" ")
                fut = self.pending.get(cid)
                if fut is not None and not fut.done():
                    fut.set_result((rest[:1] == OK, rest[1:]))
        finally:
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(EdgeUnavailable(f"edge {self.edge.name} ({self.edge.url}): the connection "
                                                      f"closed (code {ws.close_code}) before the answer"))

    async def call(self, op: str, args: str, bound: float) -> str:
        ws = await self._ws(op)
        cid = str(next(self.ids))
        fut: asyncio.Future[tuple[bool, str]] = asyncio.get_running_loop().create_future()
        self.pending[cid] = fut
        try:
            try:
                await ws.send_str(f"{cid} {op} {args}")
                async with asyncio.timeout(bound):
                    ok, body = await fut
            except TimeoutError:  # past its bound (caught before OSError: it is one): the edge stops on it
                if not ws.closed:
                    self._cancel_later(ws, cid)
                raise DeadlineExceeded(f"edge {self.edge.name}: {op} did not answer within {bound:g} s",
                                       operation=op) from None
            except (aiohttp.ClientError, OSError) as e:
                raise self.edge._unreachable(op, e) from None
            except EdgeUnavailable as e:
                e.operation = op
                raise
            except BaseException:  # cancelled: the edge stops working on it
                if not ws.closed:
                    self._cancel_later(ws, cid)
                raise
        finally:
            self.pending.pop(cid, None)
        if not ok:
            raise error_from(json.loads(body), f"edge {self.edge.name}: {op} failed")
        return body

    def _cancel_later(self, ws: aiohttp.ClientWebSocketResponse, cid: str) -> None:
        async def send() -> None:
            with contextlib.suppress(ConnectionError, RuntimeError, aiohttp.ClientError):
                await ws.send_str(f"{cid} {CANCEL}")
        task = asyncio.ensure_future(send())
        self.cancels.add(task)
        task.add_done_callback(self.cancels.discard)

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.reader is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.reader


def _method(op: Op) -> Any:
    if op.stream:
        def stream(self: RemoteEdge, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            return self._stream(op, op.bind(args, kwargs))
        fn: Any = stream
    else:
        async def call(self: RemoteEdge, *args: Any, **kwargs: Any) -> Any:
            return await self._call(op, op.bind(args, kwargs))
        fn = call
    fn.__name__ = fn.__qualname__ = op.name
    fn.__doc__ = f"The edge contract's {op.name}, over the wire."
    return fn


for _name, _op in ops().items():
    setattr(RemoteEdge, _name, _method(_op))


def remote_edge(name: str, url: str, secret: str, tls: ssl.SSLContext | None = None) -> RemoteEdge:
    """A client of the edge daemon at ``url``. (mypy sees the contract's methods as the
    Protocol's empty ones; the loop above gives the class every one of them.)"""
    return RemoteEdge(name, url, secret, tls=tls)  # type: ignore[abstract]
