"""Long-lived processes a client starts and attaches to (E2B's process service and any
other interface that needs them): started through dsec-init like every command, with
stdout/stderr (or one pty) read by the edge and fanned out to whoever is attached, stdin
written on request, signals through init.

A process stays in the table until it has ended and its end was delivered; attaching
late gets what it prints from then on. Each subscriber's queue is bounded: a subscriber
that stops reading loses output (it is told once), the process never blocks on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import struct
import termios
from collections.abc import Callable
from dataclasses import dataclass, field

from dsec.node.agent.fdio import write_all
from dsec.node.agent.initclient import CTTY, SETSID, ChannelLost, channel, exit_code
from dsec.node.agent.interfaces import InitChannel

MAX_PROCS = 256
QUEUE_BYTES = 16 << 20


@dataclass
class ProcEvent:
    kind: str  # "data" | "end" | "lost"
    stream: str = ""  # stdout | stderr | pty
    data: bytes = b""
    exit_code: int = 0
    status: str = ""


@dataclass
class Proc:
    pid: int
    tag: str | None
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    pty: bool
    exited: asyncio.Future[int]
    stdin_fd: int | None = None
    master: int | None = None
    subscribers: list[asyncio.Queue[ProcEvent]] = field(default_factory=list)
    queued: dict[int, int] = field(default_factory=dict)
    readers: set[int] = field(default_factory=set)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    end: ProcEvent | None = None

    def subscribe(self) -> asyncio.Queue[ProcEvent]:
        q: asyncio.Queue[ProcEvent] = asyncio.Queue()
        if self.end is not None:
            q.put_nowait(self.end)
        else:
            self.subscribers.append(q)
            self.queued[id(q)] = 0
        return q

    def unsubscribe(self, q: asyncio.Queue[ProcEvent]) -> None:
        with contextlib.suppress(ValueError):
            self.subscribers.remove(q)
        self.queued.pop(id(q), None)

    def publish(self, ev: ProcEvent) -> None:
        for q in list(self.subscribers):
            used = self.queued.get(id(q), 0)
            if ev.kind == "data" and used + len(ev.data) > QUEUE_BYTES:
                if used <= QUEUE_BYTES:  # tell it once, then drop until it catches up
                    q.put_nowait(ProcEvent("lost"))
                    self.queued[id(q)] = QUEUE_BYTES + 1
                continue
            self.queued[id(q)] = used + len(ev.data)
            q.put_nowait(ev)

    def consumed(self, q: asyncio.Queue[ProcEvent], ev: ProcEvent) -> None:
        if id(q) in self.queued:
            self.queued[id(q)] = max(0, min(self.queued[id(q)], QUEUE_BYTES) - len(ev.data))


class ProcessTable:
    def __init__(self, init: InitChannel, default_env: Callable[[], dict[str, str]],
                 default_cwd: Callable[[], str]) -> None:
        self.init = init
        self.default_env, self.default_cwd = default_env, default_cwd
        self.procs: dict[int, Proc] = {}
        self.closed = False  # the sandbox is going: what ends now ended with it

    def find(self, pid: int | None = None, tag: str | None = None) -> Proc | None:
        if pid:
            return self.procs.get(pid)
        return next((p for p in self.procs.values() if tag is not None and p.tag == tag), None)

    async def start(self, cmd: str, args: list[str], envs: dict[str, str], cwd: str | None,
                    pty: tuple[int, int] | None, stdin: bool, tag: str | None,
                    user: tuple[int, int] | None = None) -> Proc:
        """Start ``cmd``; as ``user`` (uid, gid) rather than root when given (init drops
        to it in the child, before the exec)."""
        if len(self.procs) >= MAX_PROCS:
            raise ValueError(f"at most {MAX_PROCS} processes at once")
        env = {**self.default_env(), **envs}
        ours: list[int] = []
        theirs: list[int] = []
        flags = SETSID
        if pty:
            master, slave = os.openpty()
            os.set_inheritable(master, False)
            fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", pty[1], pty[0], 0, 0))
            ours, theirs, flags = [master], [slave, slave, slave], SETSID | CTTY
            env.setdefault("TERM", "xterm-256color")
        else:
            (in_r, in_w), (out_r, out_w), (err_r, err_w) = channel(), channel(), channel()
            ours, theirs = [in_w, out_r, err_r], [in_r, out_w, err_w]
        try:
            pid, exited = await self.init.spawn([cmd, *args], env, cwd or self.default_cwd(), theirs, flags, user)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in set(theirs):
                os.close(fd)
        for fd in ours:  # written and read from the event loop: never block it
            os.set_blocking(fd, False)
        p = Proc(pid, tag, cmd, args, envs, cwd or self.default_cwd(), bool(pty), exited)
        if pty:
            p.master = ours[0]
            self._read(p, p.master, "pty")
        else:
            p.stdin_fd = ours[0]
            if not stdin:
                os.close(ours[0])
                p.stdin_fd = None
            self._read(p, ours[1], "stdout")
            self._read(p, ours[2], "stderr")
        self.procs[pid] = p
        asyncio.ensure_future(self._finish(p))
        return p

    def _read(self, p: Proc, fd: int, stream: str) -> None:
        loop = asyncio.get_running_loop()
        os.set_blocking(fd, False)
        p.readers.add(fd)

        def readable() -> None:
            while fd in p.readers:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    return
                except OSError:  # EIO: a pty whose other side has closed
                    chunk = b""
                if not chunk:
                    self._close_reader(p, fd)
                    return
                p.publish(ProcEvent("data", stream, chunk))

        loop.add_reader(fd, readable)

    def _close_reader(self, p: Proc, fd: int) -> None:
        if fd in p.readers:
            p.readers.discard(fd)
            asyncio.get_running_loop().remove_reader(fd)
            if fd != p.master:
                os.close(fd)
            if not p.readers:
                p.ended.set()

    async def _finish(self, p: Proc) -> None:
        try:
            status = await p.exited
            code, text = exit_code(status), _status_text(status)
        except ChannelLost:
            code, text = -1, "the sandbox ended"
        if self.closed:
            code, text = -1, "the sandbox ended"
        with contextlib.suppress(TimeoutError):  # output held open by a grandchild must not hold the end
            await asyncio.wait_for(p.ended.wait(), 0.2)
        for fd in list(p.readers):
            self._close_reader(p, fd)
        for held in (p.stdin_fd, p.master):
            if held is not None:
                with contextlib.suppress(OSError):
                    os.close(held)
        p.stdin_fd = p.master = None
        p.end = ProcEvent("end", exit_code=code, status=text)
        p.publish(p.end)
        p.subscribers.clear()
        self.procs.pop(p.pid, None)

    async def write(self, p: Proc, data: bytes) -> None:
        fd = p.master if p.pty else p.stdin_fd
        if fd is None:
            raise ValueError("the process has no open stdin")
        await write_all(fd, data)

    def close_stdin(self, p: Proc) -> None:
        if p.stdin_fd is not None:
            os.close(p.stdin_fd)
            p.stdin_fd = None

    async def signal(self, p: Proc, sig: int) -> None:
        await self.init.kill_tree(p.pid, sig, 0, include_self=True)

    async def resize(self, p: Proc, cols: int, rows: int) -> None:
        if p.master is None:
            raise ValueError("the process has no pty")
        fcntl.ioctl(p.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        await self.init.resize(p.master, cols, rows)

    async def close(self) -> None:
        self.closed = True
        for p in list(self.procs.values()):
            with contextlib.suppress(ChannelLost):
                await self.signal(p, signal.SIGKILL)


def _status_text(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal: {signal.Signals(os.WTERMSIG(status)).name.lower().removeprefix('sig')}"
    return f"exit status {os.WEXITSTATUS(status)}"
