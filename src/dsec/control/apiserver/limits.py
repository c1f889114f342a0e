"""Limits on what a connection may make the apiserver hold or believe, before anyone has
looked at who sent it: a cap on every request body (small for JSON control routes, the
route's own for file, exec and upload routes), a deadline for a request's headers and for
each piece of its body (slow-loris), nothing read past the cap, and each credential or
routing header given at most once (two copies of ``E2B-Sandbox-Id`` let the auth check
read one and the route act on the other).

The outermost middleware (ahead of every face and of authentication), so an
unauthenticated body is bounded too. A route that reads its body with a lower cap of its
own (exec, SWE-ReX, SandboxFusion) keeps it; this one is the ceiling.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from dsec.control.apiserver.core import MAX_EXEC_BODY, error_response
from dsec.shared.errors import DsecError, InvalidRequest, PayloadTooLarge, RequestTimeout

CONTROL_BODY = 1 << 20  # JSON control routes: a create, a job, a token, ...
# headers that say who is asking or which sandbox a request is for: one copy each, else 400
SINGLE_HEADERS = frozenset({
    b"authorization", b"x-api-key", b"x-access-token", b"cookie", b"host", b"content-length",
    b"transfer-encoding", b"e2b-sandbox-id", b"e2b-sandbox-port", b"e2b-traffic-access-token", b"origin",
    b"x-dsec-console",
})
CONSOLE_LOGIN_BODY = 64 << 10
BODY_PIECE_TIMEOUT_S = 60.0  # a body that stops arriving for this long is given up on
HEADER_TIMEOUT_S = 30.0  # a request's line and headers arrive within this, once begun


class BodyRefused(Exception):
    """Raised into the app from receive(): the middleware answers (413 or 408) itself."""


def body_limits(max_file_bytes: int, max_context_bytes: int) -> list[tuple[re.Pattern[str], int]]:
    """(path pattern, cap) for the routes that take more than a control body; the first
    match wins, everything else gets CONTROL_BODY."""
    files = max_file_bytes + (1 << 20)  # the file, and a multipart form around it
    return [(re.compile(p), n) for p, n in (
        (r"^/v1/sandboxes/[^/]+/files$", max_file_bytes),
        (r"^/v1/sandboxes/[^/]+/exec", MAX_EXEC_BODY),
        (r"^/v1/sandboxes/[^/]+/ports/", MAX_EXEC_BODY),
        (r"^/v1/fncall$", MAX_EXEC_BODY),
        (r"^/v1/rollouts", 16 << 20),  # a rollout's steps, a batch of acks
        (r"^/files$", files),  # E2B's envd upload
        (r"^/(process\.Process|filesystem\.Filesystem)/", MAX_EXEC_BODY),  # envd's RPCs
        (r"^/e2b/template-files/", max_context_bytes),  # a build context
        (r"^/swerex/", files),
        (r"^/daytona/toolbox/[^/]+/files/bulk-upload$", files),
        (r"^/daytona/(toolbox|preview)/", MAX_EXEC_BODY),
        (r"^/sandboxfusion/", MAX_EXEC_BODY),
        (r"^/ui/session$", CONSOLE_LOGIN_BODY),
    )]


class RequestLimits:
    """ASGI middleware: 400 for a credential or routing header given twice (a websocket is
    closed with 4400), 413 for a body over its route's cap (by its Content-Length at once,
    else as it streams), 408 for a body that stalls. E2B's port traffic (any path, routed
    by its E2b-Sandbox-Port header) gets the exec cap."""

    def __init__(self, app: Any, limits: list[tuple[re.Pattern[str], int]]) -> None:
        self.app = app
        self.limits = limits

    def limit_for(self, scope: dict[str, Any]) -> int:
        path = scope["path"]
        for pattern, cap in self.limits:
            if pattern.match(path):
                return cap
        if any(k == b"e2b-sandbox-port" for k, _ in scope["headers"]):
            return MAX_EXEC_BODY
        return CONTROL_BODY

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and (twice := _repeated(scope["headers"])):
            err = InvalidRequest(f"header {twice} is given more than once", field=twice)
            if scope["type"] == "http":
                await error_response(err)(scope, receive, send)
            else:
                await receive()  # websocket.connect
                await send({"type": "websocket.close", "code": 4400, "reason": err.message})
            return
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        cap = self.limit_for(scope)
        declared, chunked = None, False
        for k, v in scope["headers"]:
            if k == b"content-length":
                declared = int(v) if v.isdigit() else None
            elif k == b"transfer-encoding":
                chunked = True
        if declared is not None and declared > cap:
            await error_response(PayloadTooLarge(f"body: {declared} bytes is over this route's {cap}-byte limit",
                                                 field="body"))(scope, receive, send)
            return
        # a declared length is enforced by the HTTP parser itself; what is left to watch is
        # a body with no length, and any body that stops arriving
        await self._watched(scope, receive, send, cap if chunked or declared is None else None)

    async def _watched(self, scope: dict[str, Any], receive: Any, send: Any, cap: int | None) -> None:
        seen = 0
        failed: list[DsecError] = []
        started = False
        body_done = False

        async def guarded_receive() -> Any:
            nonlocal seen, body_done
            if body_done:  # after the body: the app waits for a disconnect, for as long as it likes
                return await receive()
            try:
                async with asyncio.timeout(BODY_PIECE_TIMEOUT_S):
                    msg = await receive()
            except TimeoutError:
                failed.append(RequestTimeout(f"body: nothing arrived for {BODY_PIECE_TIMEOUT_S:g} s",
                                             field="body"))
                raise BodyRefused from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                body_done = not msg.get("more_body", False)
                if cap is not None and seen > cap:
                    failed.append(PayloadTooLarge(f"body: over this route's {cap}-byte limit", field="body"))
                    raise BodyRefused
            else:
                body_done = True
            return msg

        async def guarded_send(msg: dict[str, Any]) -> None:
            nonlocal started
            if failed:  # the app's own answer to the exception it got: ours goes instead
                return
            started = True
            await send(msg)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if not failed:
                raise
        if failed and not started:
            await error_response(failed[0])(scope, receive, send)


def _repeated(headers: list[tuple[bytes, bytes]]) -> str | None:
    seen: set[bytes] = set()
    for k, _ in headers:
        if k in SINGLE_HEADERS:
            if k in seen:
                return k.decode()
            seen.add(k)
    return None


class HeaderDeadline:
    """A deadline for a request's line and headers, mixed into one of uvicorn's HTTP/1.1
    protocols: a client that opens a connection and trickles a header a byte at a time
    (slow-loris) is cut off HEADER_TIMEOUT_S after it began, instead of holding the
    connection for ever. Idle keep-alive connections keep uvicorn's own timeout."""

    _header_timer: asyncio.TimerHandle | None = None
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self._between_requests():
            self._arm()
        super().data_received(data)  # type: ignore[misc]
        if not self._between_requests():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def handle_websocket_upgrade(self, *args: Any) -> None:
        self._disarm()  # the websocket's protocol takes the connection over
        super().handle_websocket_upgrade(*args)  # type: ignore[misc]

    def _between_requests(self) -> bool:
        """No request is being served: the next one's headers are what arrives."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


class GuardedHttpTools(HeaderDeadline, HttpToolsProtocol):
    """uvicorn's httptools protocol (the C parser: the apiserver's hot path) with the header deadline."""


class GuardedH11(HeaderDeadline, H11Protocol):
    """uvicorn's pure-Python h11 protocol with the header deadline."""
