"""Every program a sandbox executes, from the kernel's process-event connector.

A netlink socket (NETLINK_CONNECTOR, CN_IDX_PROC) hears each exec on the host; the
process's cgroup says which sandbox it belongs to, and its command line is read at once
(a process that has already gone is recorded by its pid). Per sandbox the rate is bounded
(a token bucket), so a fork-and-exec storm costs the edge a counter, not a log entry each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable

from dsec.node.edge.ratelimit import Buckets

log = logging.getLogger("dsec.edge")

NETLINK_CONNECTOR = 11
CN_IDX_PROC = CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN, PROC_CN_MCAST_IGNORE = 1, 2
PROC_EVENT_EXEC = 0x00000002
NLMSG_HDR, CN_HDR = 16, 20
RATE, BURST = 50.0, 500.0


class ProcWatch:
    def __init__(self, cgroup_parent: str, on_exec: Callable[[str, int, str], None]) -> None:
        """``on_exec(sandbox_id, host_pid, cmdline)`` for execs in ``/<cgroup_parent>/<id>``."""
        self.marker = f"/{cgroup_parent}/"
        self.on_exec = on_exec
        self.sock: socket.socket | None = None
        self._buckets = Buckets(RATE, BURST)

    def start(self) -> None:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                             NETLINK_CONNECTOR)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            sock.bind((0, CN_IDX_PROC))
            sock.send(_control(PROC_CN_MCAST_LISTEN))
        except OSError:
            sock.close()
            raise
        self.sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    def close(self) -> None:
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            with contextlib.suppress(OSError):
                self.sock.send(_control(PROC_CN_MCAST_IGNORE))
            self.sock.close()
            self.sock = None

    def _readable(self) -> None:
        assert self.sock is not None
        for _ in range(256):  # bounded per wakeup: the loop has other work
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return
            except OSError as e:  # ENOBUFS: events were lost in a burst; carry on
                log.debug("proc connector: %s", e)
                return
            if len(data) < NLMSG_HDR + CN_HDR + 24:
                continue
            what = struct.unpack_from("I", data, NLMSG_HDR + CN_HDR)[0]
            if what == PROC_EVENT_EXEC:
                pid = struct.unpack_from("I", data, NLMSG_HDR + CN_HDR + 16)[0]
                self._exec(pid)

    def _exec(self, pid: int) -> None:
        sid = self._sandbox_of(pid)
        if sid is None or not self._admit(sid):
            return
        cmd = ""
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read(2048).rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
        if not cmd:  # it already ended (a zombie keeps its name, not its arguments)
            try:
                with open(f"/proc/{pid}/comm") as f:
                    cmd = f"{f.read().strip()} (ended before its arguments were read)"
            except OSError:
                cmd = "(ended before it was read)"
        self.on_exec(sid, pid, cmd)

    def _sandbox_of(self, pid: int) -> str | None:
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                text = f.read()
        except OSError:
            return None
        i = text.find(self.marker)
        if i < 0:
            return None
        rest = text[i + len(self.marker):]
        return rest.split("\n", 1)[0].split("/", 1)[0] or None

    def _admit(self, sid: str) -> bool:
        ok, dropped = self._buckets.admit(sid)
        if ok and dropped:
            self.on_exec(sid, 0, f"({dropped} more executions not recorded: over {RATE:.0f}/s)")
        return ok

    def forget(self, sandbox_id: str) -> None:
        self._buckets.forget(sandbox_id)


def _control(op: int) -> bytes:
    payload = struct.pack("I", op)
    cn = struct.pack("IIIIHH", CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(payload), 0) + payload
    return struct.pack("IHHII", NLMSG_HDR + len(cn), 3, 0, 0, os.getpid()) + cn  # NLMSG_DONE
