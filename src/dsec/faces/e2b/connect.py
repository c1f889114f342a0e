"""The Connect RPC protocol (connectrpc.com/docs/protocol), JSON codec, as the E2B SDKs
speak it to envd: unary calls are a JSON body in and out; streams are envelopes (a flags
byte, a 4-byte big-endian length, a JSON message), the last one flagged end-of-stream and
carrying the error, if any. Errors are Connect codes with their HTTP statuses.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

END_STREAM = 0x02
COMPRESSED = 0x01
MAX_MESSAGE = 64 << 20

HTTP_STATUS = {"canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
               "not_found": 404, "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429,
               "failed_precondition": 400, "aborted": 409, "out_of_range": 400, "unimplemented": 501,
               "internal": 500, "unavailable": 503, "data_loss": 500, "unauthenticated": 401}


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message

    def json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


async def read_envelopes(request: Request) -> AsyncIterator[dict[str, Any]]:
    """The messages of a streaming request body, as they arrive."""
    buf = b""
    async for chunk in request.stream():
        buf += chunk
        while len(buf) >= 5:
            flags, n = struct.unpack(">BI", buf[:5])
            if n > MAX_MESSAGE:
                raise ConnectError("resource_exhausted", f"message of {n} bytes")
            if len(buf) < 5 + n:
                break
            body, buf = buf[5:5 + n], buf[5 + n:]
            if flags & COMPRESSED:
                raise ConnectError("unimplemented", "compressed messages are not accepted")
            if flags & END_STREAM:
                return
            yield json.loads(body or b"{}")


async def first_message(request: Request) -> dict[str, Any]:
    """The request message of a server-streaming call (one envelope)."""
    async for msg in read_envelopes(request):
        return msg
    raise ConnectError("invalid_argument", "no request message")


async def unary_body(request: Request) -> dict[str, Any]:
    body = await request.body()
    if len(body) > MAX_MESSAGE:
        raise ConnectError("resource_exhausted", "request too large")
    try:
        msg = json.loads(body or b"{}")
    except ValueError:
        raise ConnectError("invalid_argument", "the request is not JSON") from None
    if not isinstance(msg, dict):
        raise ConnectError("invalid_argument", "the request is not a JSON object")
    return msg


def unary_error(e: ConnectError) -> Response:
    return JSONResponse(e.json(), status_code=HTTP_STATUS.get(e.code, 500))


def timeout_of(request: Request) -> float | None:
    """The client's deadline for the call (Connect-Timeout-Ms), in seconds."""
    raw = request.headers.get("connect-timeout-ms", "")
    return int(raw) / 1000 if raw.isdigit() and 0 < len(raw) <= 10 else None


def stream_response(events: AsyncIterator[dict[str, Any]], timeout: float | None = None) -> StreamingResponse:
    """A server stream: each message in an envelope, then the end-of-stream envelope
    (with the error, if the stream failed or outlived ``timeout``)."""
    async def body() -> AsyncIterator[bytes]:
        end: dict[str, Any] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(anext(events), deadline - loop.time() if deadline else None)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise ConnectError("deadline_exceeded", f"the call outlived its {timeout:g} s timeout") from None
                yield envelope(msg)
        except ConnectError as e:
            end = {"error": e.json()}
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        yield envelope(end, END_STREAM)

    return StreamingResponse(body(), media_type="application/connect+json")
