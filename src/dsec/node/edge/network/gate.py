"""The egress gate: TCP 80 and 443 from sandboxes arrive here (kernel redirect), are
admitted by the host name the client asks for (TLS SNI, or the HTTP Host header) against
the sandbox's allowed services, and are then spliced to that name's own address.

Why a name check and not only address sets: registries sit behind shared front ends and
CDNs, so one address serves an allowed and a denied service alike (on our machines every
registry resolves to the same address). The gate never connects where the client's packet
was headed, only to an address the allowed name resolves to, so a permitted SNI cannot
carry a connection to any other host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import Callable

from dsec.node.edge.network.dns import ConnLimit

log = logging.getLogger("dsec.network")

SO_ORIGINAL_DST = 80
MAX_HELLO = 16 * 1024 + 5
TLS_ALERT_ACCESS_DENIED = bytes([0x15, 0x03, 0x01, 0x00, 0x02, 0x02, 0x31])
# connections through the gate at once, per sandbox and in all (each holds two fds)
MAX_CONNS_PER_SOURCE, MAX_CONNS = 256, 4096


def sni(data: bytes) -> str | None | bool:
    """The server name in a TLS ClientHello; False while more bytes are needed, None if
    this is not a ClientHello or names no server."""
    if len(data) < 5:
        return False
    if data[0] != 0x16:
        return None
    end = 5 + struct.unpack(">H", data[3:5])[0]
    if len(data) < end:
        return False
    p = 5
    try:
        if data[p] != 1:
            return None
        p += 4 + 2 + 32  # handshake header, client_version, random
        p += 1 + data[p]  # session id
        p += 2 + struct.unpack(">H", data[p:p + 2])[0]  # cipher suites
        p += 1 + data[p]  # compression methods
        ext_end = p + 2 + struct.unpack(">H", data[p:p + 2])[0]
        p += 2
        while p + 4 <= min(ext_end, end):
            etype, elen = struct.unpack(">HH", data[p:p + 4])
            p += 4
            if etype == 0:  # server_name: list length, then (type, length, name)
                q = p + 2
                if data[q] == 0:
                    n = struct.unpack(">H", data[q + 1:q + 3])[0]
                    return data[q + 3:q + 3 + n].decode("ascii").lower()
                return None
            p += elen
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return None


def http_host(data: bytes) -> str | None | bool:
    head, sep, _ = data.partition(b"\r\n\r\n")
    if not sep:
        return False if len(data) < MAX_HELLO else None
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"host":
            host = v.strip().decode("latin-1").lower()
            if host.startswith("["):
                return None
            return host.rsplit(":", 1)[0] if ":" in host else host
    return None


def original_dst(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port = struct.unpack(">H", raw[2:4])[0]
    return socket.inet_ntoa(raw[4:8]), port


class Gate:
    def __init__(self, allowed: Callable[[str, str], bool | None], on_deny: Callable[[str, str], None],
                 forbidden: Callable[[str], bool]) -> None:
        """``allowed(source, host)`` as for the resolver; ``forbidden(address)`` for
        destinations no name may lead to (the host, sandboxes, link-local)."""
        self.allowed, self.on_deny, self.forbidden = allowed, on_deny, forbidden
        self.port = 0
        self._server: asyncio.Server | None = None
        self._cache: dict[str, tuple[float, list[str]]] = {}
        self._conns: set[asyncio.Task[None]] = set()
        self.limit = ConnLimit(MAX_CONNS_PER_SOURCE, MAX_CONNS)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "0.0.0.0", 0, limit=MAX_HELLO)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._server:
            self._server.close()
        for t in self._conns:
            t.cancel()

    async def _resolve(self, host: str) -> list[str]:
        hit = self._cache.get(host)
        if hit and time.monotonic() - hit[0] < 60:  # names are refreshed a minute after use
            return hit[1]
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, family=socket.AF_INET,
                                                             type=socket.SOCK_STREAM)
        addrs = sorted({str(i[4][0]) for i in infos})
        self._cache[host] = (time.monotonic(), addrs)
        return addrs

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            with self.limit.hold(w.get_extra_info("peername")[0]) as ok:
                if ok:  # else: one sandbox holding the edge's fds open; refused at once
                    await self._handle(r, w)
        except (ConnectionError, TimeoutError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.discard(task)
            w.close()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        source = w.get_extra_info("peername")[0]
        _, port = original_dst(w.get_extra_info("socket"))
        data = b""
        name: str | None | bool = False
        deadline = time.monotonic() + 10
        while name is False:
            chunk = await asyncio.wait_for(r.read(MAX_HELLO - len(data)), max(0.1, deadline - time.monotonic()))
            if not chunk:
                return
            data += chunk
            name = sni(data) if data[:1] == b"\x16" else http_host(data)
        tls = data[:1] == b"\x16"
        host = name if isinstance(name, str) else ""
        verdict = self.allowed(source, host) if host else False
        addrs = [a for a in await self._resolve(host) if not self.forbidden(a)] if verdict else []
        if not verdict or not addrs:
            what = f"{'https' if tls else 'http'} {host or '(no host name)'}:{port}"
            if verdict is not None:
                self.on_deny(source, what)
            w.write(TLS_ALERT_ACCESS_DENIED if tls else _forbidden(what))
            with contextlib.suppress(ConnectionError):
                await w.drain()
            return
        ur, uw = await asyncio.wait_for(asyncio.open_connection(addrs[0], port, limit=1 << 16), 15)
        try:
            uw.write(data)
            await asyncio.gather(_pump(r, uw), _pump(ur, w))
        finally:
            uw.close()


async def _pump(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while chunk := await r.read(1 << 16):
            w.write(chunk)
            await w.drain()
        if w.can_write_eof():
            w.write_eof()


def _forbidden(what: str) -> bytes:
    body = f"dsec: {what} is not allowed by this sandbox's network rules\n".encode()
    return (b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

