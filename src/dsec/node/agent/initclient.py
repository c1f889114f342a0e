"""Async client for dsec-init, the PID 1 spawner inside each container sandbox.

One SOCK_SEQPACKET connection per sandbox carries every request; replies to requests
come back in order, exit notices ("X pid status") come whenever a child ends.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import time

from dsec.node.host import linux
from dsec.shared.errors import DeadlineExceeded, SandboxError

SETSID = 1
CTTY = 2
# every request to init has this deadline: init answers from its own loop, outside the
# workload's limits, so a miss means it is stuck (a frozen sandbox, a kernel in trouble)
REQUEST_TIMEOUT_S = 10.0
_NAMES = {"S": "spawn", "T": "kill", "G": "signal", "W": "ping", "A": "adopt", "H": "hold", "R": "retrieve",
          "D": "drop", "L": "list", "C": "configure"}
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def boottime_ticks() -> int:
    """Now, in the units of /proc/PID/stat's starttime."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _CLK_TCK)


class ChannelLost(SandboxError):
    """The connection to the sandbox's init is gone: the sandbox has died."""


class SpawnFailed(SandboxError):
    CHDIR, USER, CGROUP = 6, 7, 8

    def __init__(self, err: int, stage: int, argv0: str, cwd: str) -> None:
        what = f"cannot enter working directory {cwd!r}" if stage == self.CHDIR else \
            "cannot take on the requested user" if stage == self.USER else \
            "cannot join the sandbox's workload cgroup" if stage == self.CGROUP else f"cannot run {argv0!r}"
        super().__init__(f"{what}: {os.strerror(err)}")
        self.errno = err


def channel() -> tuple[int, int]:
    """A one-way byte channel (read end, write end) made of a unix socketpair. Unlike a
    pipe it cannot be opened through /proc/PID/fd/N, so another process in the sandbox
    cannot read a command's pending input or write forged output into its stdout."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.shutdown(socket.SHUT_WR)
    b.shutdown(socket.SHUT_RD)
    return a.detach(), b.detach()


_Reply = tuple[list[bytes], "asyncio.Future[int] | None", list[int]]


class InitClient:
    def __init__(self, sock_path: str, netns: str | None = None) -> None:
        self.sock_path, self.netns = sock_path, netns
        self._sock: socket.socket | None = None
        # each reply carries the exit future of the pid it announces ("P"), made before
        # the exit notice can arrive
        self._pending: collections.deque[asyncio.Future[_Reply]] = collections.deque()
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._lock = asyncio.Lock()
        self.closed = asyncio.Event()

    async def connect(self, timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        # non-blocking from the start: a unix connect to an init whose backlog is full (it
        # is starved, or busy reaping a fork bomb's orphans) would otherwise block the
        # edge's event loop until init accepts; _on_readable also reads until EAGAIN
        # (recv_fds ignores its flags argument)
        kind = socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        if self.netns is None:
            sock = socket.socket(socket.AF_UNIX, kind)
        else:  # made in the sandbox's netns, so init's end of the connection is too (a CRIU dump finds it)
            sock = linux.in_netns(self.netns, lambda: socket.socket(socket.AF_UNIX, kind))
        deadline = loop.time() + timeout
        while True:
            try:
                sock.connect(self.sock_path)
                break
            except (FileNotFoundError, ConnectionRefusedError, BlockingIOError) as e:
                if loop.time() > deadline:
                    sock.close()
                    raise ChannelLost(f"sandbox init socket unreachable: {e}") from e
                await asyncio.sleep(0.005)
        self._sock = sock
        loop.add_reader(sock.fileno(), self._on_readable)

    def _on_readable(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, 1 << 17, 8, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                data, fds = b"", []
            if not data:
                self._lost()
                return
            fields = data.split(b"\0")
            if fields[0] == b"X":
                fut = self._exits.pop(int(fields[1]), None)
                if fut and not fut.done():
                    fut.set_result(int(fields[2]))
                continue
            f = self._pending.popleft() if self._pending else None
            if f is not None and not f.done():
                exit_fut = None
                if fields[0] == b"P":
                    exit_fut = self._exits[int(fields[1])] = asyncio.get_running_loop().create_future()
                f.set_result((fields, exit_fut, fds))
                continue
            # the answer to a request whose caller gave up (its deadline passed): dropped,
            # and a process it started is killed rather than left running unowned
            for fd in fds:
                os.close(fd)
            if fields[0] == b"P" and len(fields) > 1:
                self._fire(["T", fields[1].decode(), "9", "0", "1"])

    def _lost(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        err = ChannelLost("connection to the sandbox init was lost")
        for f in list(self._pending) + list(self._exits.values()):
            if not f.done():
                f.set_exception(err)
                f.exception()  # mark retrieved: nobody may be waiting
        self._pending.clear()
        self._exits.clear()
        self.closed.set()

    def close(self) -> None:
        if self._sock is not None:
            self._lost()

    def _fire(self, fields: list[str]) -> None:
        """Send a request nobody waits for (its reply is dropped in turn)."""
        if self._sock is None:
            return
        fut: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        fut.cancel()
        try:
            self._sock.send(b"\0".join(f.encode() for f in fields))
            self._pending.append(fut)
        except OSError:
            pass

    async def _request(self, fields: list[str], fds: list[int] | None = None,
                       timeout: float | None = None) -> _Reply:
        if self._sock is None:
            raise ChannelLost("sandbox init is not connected")
        what = _NAMES.get(fields[0], fields[0])
        timeout = REQUEST_TIMEOUT_S if timeout is None else timeout
        msg = b"\0".join(f.encode() for f in fields)
        fut: asyncio.Future[_Reply] = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                async with self._lock:
                    if self._sock is None:
                        raise ChannelLost("sandbox init is not connected")
                    try:
                        if fds:
                            socket.send_fds(self._sock, [msg], fds)
                        else:
                            self._sock.send(msg)
                    except BlockingIOError:  # init has not read what we sent before
                        raise DeadlineExceeded(f"sandbox init is not taking requests ({what})") from None
                    except OSError as e:
                        self._lost()
                        raise ChannelLost(f"sandbox init unreachable: {e}") from e
                    self._pending.append(fut)
                return await fut
        except TimeoutError:
            raise DeadlineExceeded(f"sandbox init did not answer a {what} request within {timeout:g} s",
                                   operation=what) from None
        finally:
            fut.cancel()  # no-op once answered; otherwise its reply, when it comes, is dropped in turn

    def channels(self, n: int) -> list[tuple[int, int]]:
        """``n`` channels (see :func:`channel`) for a process that lives on in the sandbox (a
        shell session's): made in the sandbox's network namespace, where a CRIU dump of its
        processes finds both ends, the process's and the one init holds (a live branch then
        carries the session into its children: node/backends/container/branching.py)."""
        if self.netns is not None:
            with contextlib.suppress(OSError):  # (init gone: the spawn says so)
                return linux.in_netns(self.netns, lambda: [channel() for _ in range(n)])
        return [channel() for _ in range(n)]

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int],
                    flags: int = SETSID, user: tuple[int, int] | None = None) -> tuple[int, asyncio.Future[int]]:
        """Start ``argv`` in the sandbox, as ``user`` (uid, gid) if given, else root;
        returns its pid (in the sandbox) and a future of its wait status."""
        envl = [f"{k}={v}" for k, v in env.items()]
        who = [str(user[0]), str(user[1])] if user is not None else []
        reply, exited, _ = await self._request(
            ["S", str(flags), cwd, str(len(argv)), *argv, str(len(envl)), *envl, *who], fds)
        if reply[0] == b"E" or exited is None:
            raise SpawnFailed(int(reply[1]), int(reply[2]) if len(reply) > 2 else 0, argv[0], cwd)
        return int(reply[1]), exited

    async def kill_tree(self, pid: int, sig: int, since_ticks: int = 0, include_self: bool = False) -> int:
        reply, _, _ = await self._request(["T", str(pid), str(sig), str(since_ticks), "1" if include_self else "0"])
        return int(reply[1])

    # The fd store: session pipes parked in init survive a restart of the edge.
    async def hold(self, key: str, fds: list[int]) -> None:
        reply, _, _ = await self._request(["H", key], fds)
        if reply[1] != b"0":
            raise SandboxError(f"sandbox init cannot hold fds for {key}: {os.strerror(int(reply[1]))}")

    async def retrieve(self, key: str) -> list[int] | None:
        reply, _, fds = await self._request(["R", key])
        return fds if reply[0] == b"F" else None

    async def drop(self, key: str) -> None:
        await self._request(["D", key])

    async def held_keys(self) -> list[str]:
        reply, _, _ = await self._request(["L"])
        return [k.decode() for k in reply[1:] if k]

    async def adopt(self, pid: int) -> asyncio.Future[int] | None:
        """Route ``pid``'s exit notice to this connection; None if it has already gone."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._exits[pid] = fut  # registered first: the notice may follow the reply at once
        reply, _, _ = await self._request(["A", str(pid)])
        if reply[1] != b"0":
            self._exits.pop(pid, None)
            return None
        return fut

    async def resize(self, master: int, cols: int, rows: int) -> None:
        """Nothing to do: a container's pty is the host's own, resized by the caller."""

    async def kill_group(self, pgid: int, sig: int) -> None:
        await self._request(["G", str(pgid), str(sig)])

    async def ping(self, timeout: float | None = None) -> None:
        await self._request(["W"], timeout=timeout)

    async def configure(self, cgroup_procs: list[int], idle: bool) -> None:
        """Tell init where the workload lives: every child it spawns from now on joins
        these cgroups (cgroup.procs fds opened on the host) before it execs."""
        await self._request(["C", "1" if idle else "0"], cgroup_procs)


def exit_code(status: int) -> int:
    """Shell-style exit code from a wait status: 128+N for a signal."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)
