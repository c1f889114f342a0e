"""chronus: shell sessions. A long-lived shell inside the sandbox is fed commands on stdin;
results come back on a private control pipe (fd 3 of the shell, closed for the command
itself) tagged with a per-command random nonce, so command output can never be mistaken
for, or forge, a result. The shell's pipes are parked in dsec-init, so a session outlives
a restart of the edge."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import signal
import time

from dsec.node.agent.capture import Capture
from dsec.node.agent.fdio import FdWait
from dsec.node.agent.initclient import SETSID, ChannelLost, boottime_ticks, exit_code
from dsec.node.agent.interfaces import AgentContext, InitChannel, OnData
from dsec.shared.errors import SandboxError
from dsec.shared.wire.models import ExecRequest, ExecResult


class ShellSession:
    """chronus: one persistent shell; cwd, env and background jobs persist."""

    def __init__(self, init: InitChannel, ctx: AgentContext, name: str) -> None:
        self.init, self.ctx, self.name = init, ctx, name
        self.pid = 0
        self.cwd = ctx.workdir
        self._lock = asyncio.Lock()
        self._alive = False

    @property
    def key(self) -> str:
        return f"sess/{self.name}/{self.pid}"

    async def _start(self) -> None:
        init = self.init
        # made where init can see them (a container's netns): a live branch carries the session
        (in_r, stdin_w), (out_r, out_w), (err_r, err_w), (ctl_r, ctl_w) = init.channels(4)
        try:
            self.pid, exited = await init.spawn(
                [self.ctx.shell], self.ctx.env, self.cwd, [in_r, out_w, err_w, ctl_w], SETSID)
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
        self._out = Capture(out_r, "stdout", 0, None)
        self._err = Capture(err_r, "stderr", 0, None)
        os.set_blocking(self._ctl_r, False)
        self._ctl_buf = b""
        self._alive = True

    @classmethod
    def reattach(cls, init: InitChannel, ctx: AgentContext, name: str, pid: int, exited: asyncio.Future[int],
                 fds: list[int]) -> ShellSession:
        """A session left running by a previous edge, from the fds init held for it."""
        sess = cls(init, ctx, name)
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
                await self.init.drop(self.key)

    async def close(self) -> None:
        if self._alive:
            with contextlib.suppress(ChannelLost):
                await self.init.kill_tree(self.pid, signal.SIGKILL, 0, include_self=True)
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
                await self.init.kill_tree(self.pid, signal.SIGKILL, since)
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
                    await self.init.kill_tree(self.pid, signal.SIGKILL, 0, include_self=True)
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
