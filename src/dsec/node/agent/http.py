"""One HTTP/1.1 request to a port inside a sandbox, over a socket opened in its network
namespace (or a VM's channel); the answer whole, or its body as it arrives."""

from __future__ import annotations

import asyncio
import http.client
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

from dsec.node.agent.interfaces import SandboxFiles
from dsec.shared.errors import SandboxError
from dsec.shared.wire.models import HttpResponse

MAX_HTTP_BODY = 64 * 1024 * 1024


@dataclass
class HttpStream:
    """An HTTP response from inside a sandbox whose body is read as it arrives."""

    status: int
    headers: list[tuple[str, str]]
    body: AsyncIterator[bytes]


async def http_stream(files: SandboxFiles, port: int, method: str, path: str, headers: list[tuple[str, str]],
                      body: bytes, timeout: float) -> HttpStream:
    """The request, its response body handed on as it arrives (``timeout`` bounds each
    wait for more of it)."""
    sock = await files.connect(port)
    conn, resp = await asyncio.to_thread(_http_start, sock, port, method, path, headers, body, timeout)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while data := await asyncio.to_thread(resp.read1, 65536):
                yield data
        except (OSError, http.client.HTTPException):
            return  # the server went away mid-body: the body ends there
        finally:
            conn.close()
    return HttpStream(status=resp.status, headers=resp.getheaders(), body=chunks())


async def http_request(files: SandboxFiles, port: int, method: str, path: str, headers: list[tuple[str, str]],
                       body: bytes, timeout: float) -> HttpResponse:
    sock = await files.connect(port)
    return await asyncio.to_thread(_http_over, sock, port, method, path, headers, body, timeout)


def _http_start(sock: socket.socket, port: int, method: str, path: str, headers: list[tuple[str, str]],
                body: bytes, timeout: float) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Send one request on ``sock`` and read the response's head (blocking)."""
    sock.settimeout(timeout)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.sock = sock
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        names = {k.lower() for k, _ in headers}
        if "host" not in names:
            conn.putheader("Host", f"127.0.0.1:{port}")
        for k, v in headers:
            conn.putheader(k, v)
        if body or method in ("POST", "PUT", "PATCH"):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        return conn, conn.getresponse()
    except (OSError, http.client.HTTPException) as e:
        conn.close()
        raise SandboxError(f"HTTP to port {port} in the sandbox failed: {e}") from None


def _http_over(sock: socket.socket, port: int, method: str, path: str, headers: list[tuple[str, str]],
               body: bytes, timeout: float) -> HttpResponse:
    conn, resp = _http_start(sock, port, method, path, headers, body, timeout)
    try:
        data = resp.read(MAX_HTTP_BODY + 1)
        if len(data) > MAX_HTTP_BODY:
            raise SandboxError(f"response from port {port} exceeds {MAX_HTTP_BODY} bytes")
        return HttpResponse(status=resp.status, headers=resp.getheaders(), body=data)
    except (OSError, http.client.HTTPException) as e:
        raise SandboxError(f"HTTP to port {port} in the sandbox failed: {e}") from None
    finally:
        conn.close()
