"""The edge's resolver for its sandboxes: every DNS query a sandbox sends (to any address,
port 53, UDP or TCP) is redirected here by the kernel. Names its rules allow are forwarded
to the node's own resolvers; anything else gets NXDOMAIN and is reported as a denial.
The sandbox is known by the query's source address (spoofing is dropped on its veth).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable, Iterator

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.rcode

log = logging.getLogger("dsec.network")

OnDeny = Callable[[str, str], None]  # source address, what was refused
# TCP connections to the resolver held open at once, per sandbox and in all: a sandbox
# opening thousands (each an fd of the edge, held 10 s) ran the edge out of file descriptors
MAX_TCP_PER_SOURCE, MAX_TCP = 16, 1024


class ConnLimit:
    """Connections held at once, per source address and in all (the resolver's, the gate's)."""

    def __init__(self, per_source: int, total: int) -> None:
        self.per_source, self.total = per_source, total
        self.open: dict[str, int] = {}
        self.count = 0

    @contextlib.contextmanager
    def hold(self, source: str) -> Iterator[bool]:
        """Yields whether this connection may be served (counted while it is)."""
        n = self.open.get(source, 0)
        if n >= self.per_source or self.count >= self.total:
            yield False
            return
        self.open[source] = n + 1
        self.count += 1
        try:
            yield True
        finally:
            self.count -= 1
            left = self.open.get(source, 1) - 1
            if left > 0:
                self.open[source] = left
            else:
                self.open.pop(source, None)


def host_resolvers(path: str = "/etc/resolv.conf") -> list[str]:
    out = []
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                out.append(parts[1])
    return out or ["127.0.0.1"]


class Resolver:
    def __init__(self, allowed: Callable[[str, str], bool | None], on_deny: OnDeny) -> None:
        """``allowed(source, name)``: True, False, or None for a source that is no sandbox."""
        self.allowed, self.on_deny = allowed, on_deny
        self.upstreams = host_resolvers()
        self.conns = ConnLimit(MAX_TCP_PER_SOURCE, MAX_TCP)
        self.port = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(20):  # the same port number for UDP and TCP
            udp, _p = await loop.create_datagram_endpoint(lambda: _Udp(self), local_addr=("0.0.0.0", 0))
            port = udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._serve_tcp, "0.0.0.0", port)
            except OSError:
                udp.close()
                continue
            self._udp, self.port = udp, port
            return
        raise OSError("no free port for the sandbox resolver")

    def close(self) -> None:
        if self._udp:
            self._udp.close()
        if self._tcp:
            self._tcp.close()

    async def answer(self, wire: bytes, source: str) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return None
        if not query.question:
            return None
        name = query.question[0].name.to_text(omit_final_dot=True).lower()
        verdict = self.allowed(source, name)
        if verdict is None:
            return _reply(query, dns.rcode.REFUSED)
        if not verdict:
            self.on_deny(source, f"dns {name}")
            return _reply(query, dns.rcode.NXDOMAIN)
        for upstream in self.upstreams:
            try:
                resp = await dns.asyncquery.udp(query, upstream, timeout=3, ignore_unexpected=True)
                if resp.flags & dns.flags.TC:
                    resp = await dns.asyncquery.tcp(query, upstream, timeout=5)
                return resp.to_wire()  # type: ignore[no-any-return]
            except (dns.exception.DNSException, OSError) as e:
                log.debug("resolver %s: %s", upstream, e)
        return _reply(query, dns.rcode.SERVFAIL)

    async def _serve_tcp(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        source = w.get_extra_info("peername")[0]
        with self.conns.hold(source) as ok:
            if not ok:  # one sandbox holding the edge's fds open: the rest of it are refused at once
                w.close()
                return
            await self._serve_tcp_held(source, r, w)

    async def _serve_tcp_held(self, source: str, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                n = struct.unpack(">H", await asyncio.wait_for(r.readexactly(2), 10))[0]
                out = await self.answer(await asyncio.wait_for(r.readexactly(n), 10), source)
                if out is None:
                    break
                w.write(struct.pack(">H", len(out)) + out)
                await w.drain()
        except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
            pass
        finally:
            w.close()


def _reply(query: dns.message.Message, rcode: dns.rcode.Rcode) -> bytes:
    resp = dns.message.make_response(query)
    resp.set_rcode(rcode)
    return resp.to_wire()  # type: ignore[no-any-return]


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, resolver: Resolver) -> None:
        self.resolver = resolver
        self.transport: asyncio.DatagramTransport | None = None
        self.inflight: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if len(self.inflight) > 1024:  # a query flood: drop rather than queue without bound
            return
        t = asyncio.ensure_future(self._one(data, addr))
        self.inflight.add(t)
        t.add_done_callback(self.inflight.discard)

    async def _one(self, data: bytes, addr: tuple[str, int]) -> None:
        out = await self.resolver.answer(data, addr[0])
        if out is not None and self.transport is not None:
            with contextlib.suppress(OSError):
                self.transport.sendto(out, addr)

