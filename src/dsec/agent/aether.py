"""aether: the host-side half of the in-sandbox agent.

It lives outside the sandbox (in the edge's process) and reaches inside only through
dsec-init's socket, the sandbox's /proc/PID/root (opened with RESOLVE_IN_ROOT) and its
network namespace. Nothing of it is visible to the workload: no file, socket or log
inside the sandbox's mount namespace.

chronus, the shell-session half, is :class:`ShellSession`: a long-lived shell inside
the sandbox fed commands on stdin; results come back on a private control pipe (fd 3
of the shell, closed for the command itself) tagged with a per-command random nonce,
so command output can never be mistaken for, or forge, a result.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import http.client
import os
import secrets
import shlex
import signal
import socket
import stat as statmod
import struct
import termios
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from dsec.agent.fdio import FdWait, write_all
from dsec.agent.initclient import SETSID, ChannelLost, SpawnFailed, boottime_ticks, channel, exit_code
from dsec.agent.procs import ProcessTable
from dsec.agent.watch import DirWatch
from dsec.errors import InvalidRequest, NotFound, SandboxError
from dsec.host import linux
from dsec.wire.models import ExecRequest, ExecResult, FileStat, HttpResponse, Owner

OnData = Callable[[str, bytes], None]
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MAX_HTTP_BODY = 64 * 1024 * 1024
# after a timed-out command is SIGKILLed, how long its answer waits for it to be gone
KILLED_EXIT_WAIT_S = 2.0


class _Capture:
    """Drains one pipe into a bounded buffer; past the bound it keeps draining (so the
    writer never blocks on a full pipe) but stores nothing."""

    def __init__(self, fd: int, name: str, limit: int, on_data: OnData | None) -> None:
        self.fd, self.name, self.limit, self.on_data = fd, name, limit, on_data
        self.buf = bytearray()
        self.truncated = False
        self.eof = asyncio.Event()
        self.active = True
        os.set_blocking(fd, False)
        asyncio.get_running_loop().add_reader(fd, self.drain)

    def reset(self, limit: int, on_data: OnData | None) -> None:
        self.buf = bytearray()
        self.truncated = False
        self.limit, self.on_data = limit, on_data

    def drain(self) -> None:
        # once closed, the fd number may already belong to something else (another
        # sandbox's pipe, a client's socket): reading it would steal its bytes or block
        while self.active:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.close()
                return
            room = self.limit - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
                if self.on_data is not None:
                    self.on_data(self.name, chunk[:room])
            if len(chunk) > room:
                self.truncated = True

    def close(self) -> None:
        if self.active:
            self.active = False
            asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)
            self.eof.set()

    def text(self) -> str:
        return self.buf.decode("utf-8", errors="replace")


@dataclass
class AgentContext:
    """What aether needs to know about its sandbox."""

    sandbox_id: str
    init_pid: int  # host pid of dsec-init
    env: dict[str, str]
    workdir: str
    shell: str = "/bin/sh"
    sessions: dict[str, ShellSession] = field(default_factory=dict)


class ShellSession:
    """chronus: one persistent shell; cwd, env and background jobs persist."""

    def __init__(self, agent: Aether, name: str) -> None:
        self.agent, self.name = agent, name
        self.pid = 0
        self.cwd = agent.ctx.workdir
        self._lock = asyncio.Lock()
        self._alive = False

    @property
    def key(self) -> str:
        return f"sess/{self.name}/{self.pid}"

    async def _start(self) -> None:
        init = self.agent.init
        in_r, stdin_w = channel()
        out_r, out_w = channel()
        err_r, err_w = channel()
        ctl_r, ctl_w = channel()
        try:
            self.pid, exited = await init.spawn(
                [self.agent.ctx.shell], self.agent.ctx.env, self.cwd, [in_r, out_w, err_w, ctl_w], SETSID)
        except BaseException:
            for fd in (stdin_w, out_r, err_r, ctl_r):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w, ctl_w):
                os.close(fd)
        self._bind(exited, [stdin_w, out_r, err_r, ctl_r])
        # park copies of our ends in init: the shell then outlives a restart of the edge
        await init.hold(self.key, [stdin_w, out_r, err_r, ctl_r])

    def _bind(self, exited: asyncio.Future[int], fds: list[int]) -> None:
        self._exit = exited
        self._stdin, out_r, err_r, self._ctl_r = fds
        self._out = _Capture(out_r, "stdout", 0, None)
        self._err = _Capture(err_r, "stderr", 0, None)
        os.set_blocking(self._ctl_r, False)
        self._ctl_buf = b""
        self._alive = True

    @classmethod
    def reattach(cls, agent: Aether, name: str, pid: int, exited: asyncio.Future[int],
                 fds: list[int]) -> ShellSession:
        """A session left running by a previous edge, from the fds init held for it."""
        sess = cls(agent, name)
        sess.pid = pid
        sess._bind(exited, fds)
        return sess

    def detach(self) -> None:
        """Let go of the pipes here, leaving the shell running and its pipes parked in init."""
        if not self._alive:
            return
        self._alive = False
        for fd in (self._stdin, self._ctl_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._out.close()
        self._err.close()

    async def _teardown(self) -> None:
        if self._alive:
            self.detach()
            with contextlib.suppress(ChannelLost):
                await self.agent.init.drop(self.key)

    async def close(self) -> None:
        if self._alive:
            with contextlib.suppress(ChannelLost):
                await self.agent.init.kill_tree(self.pid, signal.SIGKILL, 0, include_self=True)
        # a command in flight holds the lock and still reads the session's fds: it ends now
        # that the shell is dead, and only then are the fds closed (never under its feet)
        async with self._lock:
            await self._teardown()

    async def _read_marker(self, nonce: bytes) -> tuple[int, str] | None:
        """Wait for this command's result line on the control pipe; None if the shell died."""
        asyncio.get_running_loop()
        while True:
            while b"\n" in self._ctl_buf:
                line, self._ctl_buf = self._ctl_buf.split(b"\n", 1)
                parts = line.split(b" ", 2)
                if len(parts) == 3 and parts[0] == nonce:
                    return int(parts[1]), parts[2].decode(errors="replace")
            ready = FdWait(self._ctl_r)
            exited = self._exit
            try:
                await asyncio.wait([ready.fut, exited], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
            finally:
                ready.close()
            try:
                chunk = os.read(self._ctl_r, 4096)
            except BlockingIOError:
                chunk = None
            if chunk:
                self._ctl_buf += chunk
            elif chunk == b"" or exited.done():
                return None

    async def run(self, req: ExecRequest, on_data: OnData | None) -> ExecResult:
        async with self._lock:
            if not self._alive:
                await self._start()
            assert req.cmd is not None
            t0 = time.monotonic()
            since = boottime_ticks()
            self._out.reset(req.max_output_bytes, on_data)
            self._err.reset(req.max_output_bytes, on_data)
            nonce = secrets.token_hex(12).encode()
            prefix = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in req.env.items())
            if req.cwd:
                prefix += f"cd {shlex.quote(req.cwd)}\n"
            script = (f"{prefix}eval {shlex.quote(req.cmd)} </dev/null 3>&-\n"
                      f"printf '%s %d %s\\n' {nonce.decode()} \"$?\" \"$PWD\" >&3\n")
            try:
                os.write(self._stdin, script.encode())
            except OSError:
                await self._teardown()
                raise SandboxError(f"session {self.name!r} shell is gone") from None
            timed_out = False
            try:
                marker = await asyncio.wait_for(self._read_marker(nonce), req.timeout_s)
            except TimeoutError:
                timed_out = True
                await self.agent.init.kill_tree(self.pid, signal.SIGKILL, since)
                try:
                    marker = await asyncio.wait_for(self._read_marker(nonce), 1.0)
                except TimeoutError:
                    # a busy loop in the shell itself: only restarting the shell stops it
                    marker = None
            self._out.drain()
            self._err.drain()
            if marker is None:
                if self._exit.done():
                    code = exit_code(self._exit.result())
                else:
                    await self.agent.init.kill_tree(self.pid, signal.SIGKILL, 0, include_self=True)
                    code = 137
                res = self._result(code, timed_out, t0)
                await self._teardown()
                return res
            code, self.cwd = marker
            return self._result(code, timed_out, t0)

    def _result(self, code: int, timed_out: bool, t0: float) -> ExecResult:
        return ExecResult(
            exit_code=code, stdout=self._out.text(), stderr=self._err.text(), timed_out=timed_out,
            stdout_truncated=self._out.truncated, stderr_truncated=self._err.truncated,
            duration_ms=(time.monotonic() - t0) * 1000)


class Aether:
    """The agent of one sandbox: exec, sessions, files, HTTP and TTY."""

    def __init__(self, ctx: AgentContext, init: InitChannel, files: SandboxFiles | None = None) -> None:
        self.ctx = ctx
        self.init = init
        self.files: SandboxFiles = files or ProcRootFiles(ctx.init_pid)
        self.procs = ProcessTable(init, lambda: dict(self.ctx.env), lambda: self.ctx.workdir)

    async def close(self) -> None:
        """The sandbox is going away: end its sessions and processes."""
        await self.procs.close()
        for s in list(self.ctx.sessions.values()):
            await s.close()
        self.ctx.sessions.clear()
        self.init.close()

    def detach(self) -> None:
        """The edge is going away, the sandbox is not: sessions keep running in it."""
        for s in self.ctx.sessions.values():
            s.detach()
        self.ctx.sessions.clear()
        self.init.close()

    async def recover_sessions(self) -> list[str]:
        """Take back the sessions a previous edge left running (their pipes are held by
        init under ``sess/<name>/<pid>``); forget those whose shell has exited."""
        recovered = []
        for key in await self.init.held_keys():
            parts = key.split("/")
            if len(parts) != 3 or parts[0] != "sess" or not parts[2].isdigit():
                continue
            name, pid = parts[1], int(parts[2])
            exited = await self.init.adopt(pid)
            fds = await self.init.retrieve(key) if exited is not None else None
            if exited is None or not fds or len(fds) != 4 or name in self.ctx.sessions:
                for fd in fds or []:
                    os.close(fd)
                await self.init.drop(key)
                continue
            self.ctx.sessions[name] = ShellSession.reattach(self, name, pid, exited, fds)
            recovered.append(name)
        return recovered

    # ---- exec -------------------------------------------------------------
    async def exec(self, req: ExecRequest, on_data: OnData | None = None) -> ExecResult:
        if req.session is not None:
            sess = self.ctx.sessions.get(req.session)
            if sess is None:
                if len(self.ctx.sessions) >= 64:
                    raise InvalidRequest("at most 64 sessions per sandbox", field="session")
                sess = self.ctx.sessions[req.session] = ShellSession(self, req.session)
            return await sess.run(req, on_data)
        return await self._exec_once(req, on_data)

    async def _exec_once(self, req: ExecRequest, on_data: OnData | None) -> ExecResult:
        argv = req.argv if req.argv is not None else [self.ctx.shell, "-c", req.cmd or ""]
        env = {**self.ctx.env, **req.env}
        t0 = time.monotonic()
        # socketpairs here too: another process in the sandbox cannot open this command's
        # stdout through /proc to append forged output (say, a fake "5 passed")
        in_r, in_w = channel()
        out_r, out_w = channel()
        err_r, err_w = channel()
        try:
            pid, exited = await self.init.spawn(argv, env, req.cwd or self.ctx.workdir, [in_r, out_w, err_w])
        except SpawnFailed as e:  # like a shell: 127 for a missing program, 126 otherwise
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            return ExecResult(exit_code=127 if e.errno == errno.ENOENT else 126, stdout="", stderr=e.message + "\n",
                              duration_ms=(time.monotonic() - t0) * 1000)
        except BaseException:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        out = _Capture(out_r, "stdout", req.max_output_bytes, on_data)
        err = _Capture(err_r, "stderr", req.max_output_bytes, on_data)
        feeder = asyncio.create_task(self._feed(in_w, (req.stdin or "").encode()))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(exited), req.timeout_s)
        except TimeoutError:
            timed_out = True
            await self.init.kill_tree(pid, signal.SIGKILL, 0, include_self=True)
            # a killed task needs CPU time to exit, and a sandbox at its CPU quota may give it
            # little: the answer does not wait for that (init reaps it whenever it ends)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(exited), KILLED_EXIT_WAIT_S)
        except asyncio.CancelledError:  # the caller went away (a dropped stream): the command goes too
            with contextlib.suppress(ChannelLost):
                await asyncio.shield(self.init.kill_tree(pid, signal.SIGKILL, 0, include_self=True))
            out.close()
            err.close()
            raise
        finally:
            feeder.cancel()
        # output held open by a background grandchild must not hold the caller
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(out.eof.wait(), err.eof.wait()), 0.2)
        out.drain()
        err.drain()
        out.close()
        err.close()
        return ExecResult(
            exit_code=137 if timed_out else exit_code(exited.result()), stdout=out.text(), stderr=err.text(),
            timed_out=timed_out, stdout_truncated=out.truncated, stderr_truncated=err.truncated,
            duration_ms=(time.monotonic() - t0) * 1000)

    @staticmethod
    async def _feed(fd: int, data: bytes) -> None:
        os.set_blocking(fd, False)
        try:
            await write_all(fd, data)
        except OSError:
            pass
        finally:
            os.close(fd)

    # ---- TTY --------------------------------------------------------------
    async def open_tty(self, cols: int, rows: int, argv: list[str] | None = None
                       ) -> tuple[int, int, asyncio.Future[int]]:
        """Start an interactive shell on a new pty; returns (master fd, pid, exit future)."""
        from dsec.agent.initclient import CTTY

        master, slave = os.openpty()
        os.set_inheritable(master, False)
        set_winsize(master, cols, rows)
        env = {**self.ctx.env, "TERM": "xterm-256color"}
        try:
            pid, exited = await self.init.spawn(argv or [self.ctx.shell, "-i"], env, self.ctx.workdir,
                                                [slave, slave, slave], SETSID | CTTY)
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        return master, pid, exited

    async def resize_tty(self, master: int, cols: int, rows: int) -> None:
        set_winsize(master, cols, rows)
        await self.init.resize(master, cols, rows)  # a VM's pty is in the guest: it is told too

    # ---- HTTP -------------------------------------------------------------
    async def http_stream(self, port: int, method: str, path: str, headers: list[tuple[str, str]],
                          body: bytes, timeout: float) -> HttpStream:
        """One HTTP/1.1 request to 127.0.0.1:port inside the sandbox, its response body
        handed on as it arrives (``timeout`` bounds each wait for more of it)."""
        sock = await self.files.connect(port)
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

    async def http_request(self, port: int, method: str, path: str, headers: list[tuple[str, str]],
                           body: bytes, timeout: float) -> HttpResponse:
        """One HTTP/1.1 request to 127.0.0.1:port inside the sandbox."""
        sock = await self.files.connect(port)
        return await asyncio.to_thread(_http_over, sock, port, method, path, headers, body, timeout)


@dataclass
class HttpStream:
    """An HTTP response from inside a sandbox whose body is read as it arrives."""

    status: int
    headers: list[tuple[str, str]]
    body: AsyncIterator[bytes]


class SandboxFiles(Protocol):
    """Files and TCP inside one sandbox, whatever it runs on."""

    async def exists(self, path: str) -> bool: ...
    async def mkdirs(self, path: str, owner: Owner | None = None) -> None: ...
    async def read_file(self, path: str, limit: int) -> bytes: ...
    async def write_file(self, path: str, data: bytes, mode: int = 0o644, owner: Owner | None = None) -> None: ...
    async def stat(self, path: str) -> FileStat: ...
    async def list_dir(self, path: str) -> list[FileStat]: ...
    async def remove(self, path: str, recursive: bool) -> None: ...
    async def move(self, source: str, destination: str) -> None: ...
    async def set_xattrs(self, path: str, prefix: str, values: dict[str, str]) -> None: ...
    def watch(self, path: str, recursive: bool) -> DirWatch: ...
    async def connect(self, port: int) -> socket.socket: ...


class InitChannel(Protocol):
    """dsec-init's interface, over its unix socket (containers) or a VM's channel."""

    closed: asyncio.Event

    async def spawn(self, argv: list[str], env: dict[str, str], cwd: str, fds: list[int],
                    flags: int = SETSID, user: tuple[int, int] | None = None) -> tuple[int, asyncio.Future[int]]: ...
    async def kill_tree(self, pid: int, sig: int, since_ticks: int = 0, include_self: bool = False) -> int: ...
    async def hold(self, key: str, fds: list[int]) -> None: ...
    async def retrieve(self, key: str) -> list[int] | None: ...
    async def drop(self, key: str) -> None: ...
    async def held_keys(self) -> list[str]: ...
    async def adopt(self, pid: int) -> asyncio.Future[int] | None: ...
    async def resize(self, master: int, cols: int, rows: int) -> None: ...
    def close(self) -> None: ...


class ProcRootFiles:
    """A container's files, reached from the host through /proc/<init>/root with every
    lookup resolved in that root (openat2 RESOLVE_IN_ROOT), and its network namespace.
    The work is blocking syscalls, so each call runs in a thread."""

    def __init__(self, init_pid: int) -> None:
        self.init_pid = init_pid

    @property
    def root(self) -> str:
        return f"/proc/{self.init_pid}/root"

    async def exists(self, path: str) -> bool:
        return await asyncio.to_thread(self._exists, path)

    async def mkdirs(self, path: str, owner: Owner | None = None) -> None:
        await asyncio.to_thread(self._mkdirs, path, owner)

    async def read_file(self, path: str, limit: int) -> bytes:
        return await asyncio.to_thread(self._read_file, path, limit)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, owner: Owner | None = None) -> None:
        await asyncio.to_thread(self._write_file, path, data, mode, owner)

    async def stat(self, path: str) -> FileStat:
        return await asyncio.to_thread(self._stat, path)

    async def list_dir(self, path: str) -> list[FileStat]:
        return await asyncio.to_thread(self._list_dir, path)

    async def remove(self, path: str, recursive: bool) -> None:
        await asyncio.to_thread(self._remove, path, recursive)

    def watch(self, path: str, recursive: bool) -> DirWatch:
        """inotify on a directory of the sandbox (resolved in its root, never followed out)."""
        def open_dir(p: str) -> int:
            return self._open_in_root(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return DirWatch(open_dir, path, recursive)
        except FileNotFoundError:
            raise NotFound(f"no such directory: {path}", field="path") from None
        except OSError as e:
            raise InvalidRequest(f"{path}: {e.strerror}", field="path") from None

    async def set_xattrs(self, path: str, prefix: str, values: dict[str, str]) -> None:
        """Make the user.* extended attributes under ``prefix`` exactly ``values``
        (names relative to the prefix) on a regular file or directory."""
        def go() -> None:
            d, name = self._open_parent(path)
            try:
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
            finally:
                os.close(d)
            try:
                st = os.fstat(fd)
                if not (statmod.S_ISREG(st.st_mode) or statmod.S_ISDIR(st.st_mode)):
                    raise InvalidRequest(f"{path} is not a regular file or directory", field="path")
                at = f"/proc/self/fd/{fd}"  # an O_PATH fd: xattr calls go through its magic link
                for old in os.listxattr(at):
                    if old.startswith(prefix) and old[len(prefix):] not in values:
                        os.removexattr(at, old)
                for key, value in values.items():
                    os.setxattr(at, prefix + key, value.encode())
            finally:
                os.close(fd)
        if not prefix.startswith("user."):
            raise InvalidRequest("only user.* extended attributes can be set", field="prefix")
        await asyncio.to_thread(self._wrap_fs, go, path)

    async def move(self, source: str, destination: str) -> None:
        """rename(2) within the sandbox (destination's parents are made)."""
        def go() -> None:
            src_dir, src_name = self._open_parent(source)
            try:
                dst_dir, dst_name = self._open_parent(destination, create=True)
                try:
                    os.rename(src_name, dst_name, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
                finally:
                    os.close(dst_dir)
            finally:
                os.close(src_dir)
        await asyncio.to_thread(self._wrap_fs, go, source)

    async def connect(self, port: int) -> socket.socket:
        def go() -> socket.socket:
            sock = linux.socket_in_netns(f"/proc/{self.init_pid}/ns/net")
            sock.settimeout(10)
            try:
                sock.connect(("127.0.0.1", port))
            except OSError as e:
                sock.close()
                raise SandboxError(f"nothing answers on port {port} in the sandbox: {e.strerror}") from None
            return sock
        return await asyncio.to_thread(go)

    def _rootfd(self) -> int:
        return os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def _open_in_root(self, path: str, flags: int, mode: int = 0o644) -> int:
        rootfd = self._rootfd()
        try:
            return linux.openat2(rootfd, path, flags, mode)
        finally:
            os.close(rootfd)

    def _open_parent(self, path: str, create: bool = False, owner: Owner | None = None) -> tuple[int, str]:
        """An O_PATH fd of ``path``'s parent (made, with its parents, if ``create``, owned
        by ``owner`` when given) and the last component. Every lookup is scoped to the
        sandbox's root."""
        if not path.startswith("/"):
            raise InvalidRequest("path must be absolute", field="path")
        parent, name = os.path.split(os.path.normpath(path))
        if not name:
            raise InvalidRequest("path names the root directory", field="path")
        flags = os.O_PATH | os.O_DIRECTORY
        try:
            return self._open_in_root(parent, flags), name
        except FileNotFoundError:
            if not create:
                raise
        prefix = "/"
        for part in [p for p in parent.split("/") if p]:
            here = os.path.join(prefix, part)
            try:
                os.close(self._open_in_root(here, flags))
            except FileNotFoundError:
                up = self._open_in_root(prefix, flags)
                try:
                    os.mkdir(part, 0o755, dir_fd=up)
                    if owner is not None:
                        os.chown(part, *owner, dir_fd=up, follow_symlinks=False)
                except FileExistsError:
                    pass
                finally:
                    os.close(up)
            prefix = here
        return self._open_in_root(parent, flags), name

    def tree(self, path: str, limit: int = 100_000) -> list[tuple[str, int, int, int]]:
        """Regular files at or under ``path``: (path, size, mtime_ns, ctime_ns), not
        following symlinks; a missing path is an empty tree. Blocking."""
        out: list[tuple[str, int, int, int]] = []

        def walk(fd: int, here: str) -> None:
            with os.scandir(fd) as it:
                for e in it:
                    if len(out) >= limit:
                        return
                    st = e.stat(follow_symlinks=False)
                    child = os.path.join(here, e.name)
                    if statmod.S_ISREG(st.st_mode):
                        out.append((child, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
                    elif statmod.S_ISDIR(st.st_mode):
                        sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                        try:
                            walk(sub, child)
                        finally:
                            os.close(sub)

        try:
            fd = self._open_in_root(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            return out
        try:
            st = os.fstat(fd)
            if statmod.S_ISREG(st.st_mode):
                out.append((os.path.normpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns))
            elif statmod.S_ISDIR(st.st_mode):
                walk(fd, os.path.normpath(path))
        finally:
            os.close(fd)
        return out

    def read_bytes(self, path: str, limit: int = 64 << 20) -> bytes:
        """Blocking read of a regular file (for the edge's own threads)."""
        return self._read_file(path, limit)

    def _wrap_fs(self, fn: Callable[[], object], path: str) -> object:
        try:
            return fn()
        except FileNotFoundError:
            raise NotFound(f"no such file or directory: {path}", field="path") from None
        except NotADirectoryError:
            raise InvalidRequest(f"a component of {path} is not a directory", field="path") from None
        except IsADirectoryError:
            raise InvalidRequest(f"{path} is a directory", field="path") from None
        except OSError as e:
            raise InvalidRequest(f"{path}: {e.strerror}", field="path") from None

    def _exists(self, path: str) -> bool:
        try:
            os.close(self._open_in_root(path, os.O_PATH))
            return True
        except OSError:
            return False

    def _mkdirs(self, path: str, owner: Owner | None = None) -> None:
        def go() -> None:
            os.close(self._open_parent(os.path.join(path, "x"), create=True, owner=owner)[0])
        self._wrap_fs(go, path)

    def _read_file(self, path: str, limit: int) -> bytes:
        def go() -> bytes:
            if not path.startswith("/"):
                raise InvalidRequest("path must be absolute", field="path")
            # O_NONBLOCK: a FIFO planted by the workload must not park an edge thread forever
            with os.fdopen(self._open_in_root(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                st = os.fstat(f.fileno())
                if not statmod.S_ISREG(st.st_mode):
                    raise InvalidRequest(f"{path} is not a regular file", field="path")
                os.set_blocking(f.fileno(), True)
                data = bytearray()
                while len(data) <= limit:  # in bounded reads: procfs refuses one of the whole limit (ENOMEM)
                    chunk = os.read(f.fileno(), min(1 << 20, limit + 1 - len(data)))
                    if not chunk:
                        break
                    data += chunk
            if len(data) > limit:
                raise InvalidRequest(f"{path} is larger than the {limit}-byte read limit", field="path")
            return bytes(data)
        return self._wrap_fs(go, path)  # type: ignore[return-value]

    def _write_file(self, path: str, data: bytes, mode: int = 0o644, owner: Owner | None = None) -> None:
        def go() -> None:
            os.close(self._open_parent(path, create=True, owner=owner)[0])
            # O_TRUNC: one change event per step for watchers (create, owner, write), and
            # the kernel ignores it on FIFOs and devices, which are refused just below
            fd = self._open_in_root(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, mode)
            with os.fdopen(fd, "wb") as f:
                if not statmod.S_ISREG(os.fstat(fd).st_mode):
                    raise InvalidRequest(f"{path} exists and is not a regular file", field="path")
                os.set_blocking(fd, True)
                if owner is not None:
                    os.fchown(fd, *owner)
                f.write(data)
        self._wrap_fs(go, path)

    def _stat(self, path: str) -> FileStat:
        def go() -> FileStat:
            if os.path.normpath(path) == "/":
                st = os.stat(self.root)
                return _filestat("/", "/", st, None)
            d, name = self._open_parent(path)
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                target = os.readlink(name, dir_fd=d) if statmod.S_ISLNK(st.st_mode) else None
                xattrs = _user_xattrs(d, name, st)
            finally:
                os.close(d)
            return _filestat(os.path.normpath(path), name, st, target, xattrs)
        return self._wrap_fs(go, path)  # type: ignore[return-value]

    def _list_dir(self, path: str) -> list[FileStat]:
        def go() -> list[FileStat]:
            fd = self._open_in_root(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                out = []
                for name in sorted(os.listdir(fd)):
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    target = os.readlink(name, dir_fd=fd) if statmod.S_ISLNK(st.st_mode) else None
                    out.append(_filestat(os.path.join(path, name), name, st, target, _user_xattrs(fd, name, st)))
                return out
            finally:
                os.close(fd)
        if not path.startswith("/"):
            raise InvalidRequest("path must be absolute", field="path")
        return self._wrap_fs(go, path)  # type: ignore[return-value]

    def _remove(self, path: str, recursive: bool) -> None:
        import shutil

        def go() -> None:
            d, name = self._open_parent(path)
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                if statmod.S_ISDIR(st.st_mode):
                    if recursive:
                        shutil.rmtree(name, dir_fd=d)
                    else:
                        os.rmdir(name, dir_fd=d)
                else:
                    os.unlink(name, dir_fd=d)
            finally:
                os.close(d)
        self._wrap_fs(go, path)


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


def _user_xattrs(dir_fd: int, name: str, st: os.stat_result) -> dict[str, str]:
    """The user.* extended attributes of ``name`` in ``dir_fd`` (regular files and
    directories: the only ones that can have them), values as text."""
    if not (statmod.S_ISREG(st.st_mode) or statmod.S_ISDIR(st.st_mode)):
        return {}
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return {}
    try:
        at = f"/proc/self/fd/{fd}"
        out = {}
        for key in os.listxattr(at):
            if key.startswith("user."):
                with contextlib.suppress(OSError):
                    out[key] = os.getxattr(at, key)[:4096].decode(errors="replace")
        return out
    except OSError:
        return {}
    finally:
        os.close(fd)


def _filestat(path: str, name: str, st: os.stat_result, target: str | None,
              xattrs: dict[str, str] | None = None) -> FileStat:
    if statmod.S_ISREG(st.st_mode):
        kind = "file"
    elif statmod.S_ISDIR(st.st_mode):
        kind = "dir"
    elif statmod.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    return FileStat(path=path, name=name, type=kind, size=st.st_size, mode=statmod.S_IMODE(st.st_mode),  # type: ignore[arg-type]
                    mtime=st.st_mtime, link_target=target, uid=st.st_uid, gid=st.st_gid, xattrs=xattrs or {})


def set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
