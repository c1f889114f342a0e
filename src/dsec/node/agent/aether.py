"""aether: the host-side half of the in-sandbox agent.

It lives outside the sandbox (in the edge's process) and reaches inside only through
dsec-init's socket, the sandbox's /proc/PID/root (opened with RESOLVE_IN_ROOT) and its
network namespace. Nothing of it is visible to the workload: no file, socket or log
inside the sandbox's mount namespace.

The parts, a module each: commands (one-shot exec), sessions (chronus, the shell
sessions), files (a container's files through /proc/PID/root), http (requests to a
sandbox port), tty (an interactive shell), procs (long-lived processes clients attach
to); interfaces holds what they talk to. :class:`Aether` is the facade the edge holds
per sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

from dsec.node.agent.commands import run_once
from dsec.node.agent.files import ProcRootFiles
from dsec.node.agent.http import HttpStream, http_request, http_stream
from dsec.node.agent.interfaces import AgentContext, InitChannel, OnData, SandboxFiles
from dsec.node.agent.procs import ProcessTable
from dsec.node.agent.sessions import ShellSession
from dsec.node.agent.tty import open_tty, resize_tty
from dsec.shared.errors import InvalidRequest
from dsec.shared.wire.models import ExecRequest, ExecResult, HttpResponse

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
__all__ = ["DEFAULT_PATH", "Aether", "AgentContext", "HttpStream", "InitChannel", "OnData", "ProcRootFiles",
           "SandboxFiles"]


class Aether:
    """The agent of one sandbox: exec, sessions, files, HTTP and TTY."""

    def __init__(self, ctx: AgentContext, init: InitChannel, files: SandboxFiles | None = None) -> None:
        self.ctx = ctx
        self.init = init
        self.files: SandboxFiles = files or ProcRootFiles(ctx.init_pid)
        self.procs = ProcessTable(init, lambda: dict(self.ctx.env), lambda: self.ctx.workdir)
        self.sessions: dict[str, ShellSession] = {}

    async def close(self) -> None:
        """The sandbox is going away: end its sessions and processes."""
        await self.procs.close()
        for s in list(self.sessions.values()):
            await s.close()
        self.sessions.clear()
        self.init.close()

    def detach(self) -> None:
        """The edge is going away, the sandbox is not: sessions keep running in it."""
        for s in self.sessions.values():
            s.detach()
        self.sessions.clear()
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
            if exited is None or not fds or len(fds) != 4 or name in self.sessions:
                for fd in fds or []:
                    os.close(fd)
                await self.init.drop(key)
                continue
            self.sessions[name] = ShellSession.reattach(self.init, self.ctx, name, pid, exited, fds)
            recovered.append(name)
        return recovered

    @contextlib.asynccontextmanager
    async def sessions_quiet(self) -> AsyncIterator[list[str]]:
        """Within: no session starts a command (a capture of the sandbox's processes takes
        each shell idle). Yields the sessions running one now, which it cannot stop."""
        busy, held = [], []
        try:
            for name, sess in sorted(self.sessions.items()):
                if sess._lock.locked():
                    busy.append(name)
                else:
                    await sess._lock.acquire()
                    held.append(sess)
            yield busy
        finally:
            for sess in held:
                sess._lock.release()

    # ---- exec -------------------------------------------------------------
    async def exec(self, req: ExecRequest, on_data: OnData | None = None) -> ExecResult:
        if req.session is not None:
            sess = self.sessions.get(req.session)
            if sess is None:
                if len(self.sessions) >= 64:
                    raise InvalidRequest("at most 64 sessions per sandbox", field="session")
                sess = self.sessions[req.session] = ShellSession(self.init, self.ctx, req.session)
            return await sess.run(req, on_data)
        return await run_once(self.init, self.ctx, req, on_data)

    # ---- TTY and HTTP -----------------------------------------------------------
    async def open_tty(self, cols: int, rows: int, argv: list[str] | None = None
                       ) -> tuple[int, int, asyncio.Future[int]]:
        return await open_tty(self.init, self.ctx, cols, rows, argv)

    async def resize_tty(self, master: int, cols: int, rows: int) -> None:
        await resize_tty(self.init, master, cols, rows)

    async def http_stream(self, port: int, method: str, path: str, headers: list[tuple[str, str]],
                          body: bytes, timeout: float) -> HttpStream:
        return await http_stream(self.files, port, method, path, headers, body, timeout)

    async def http_request(self, port: int, method: str, path: str, headers: list[tuple[str, str]],
                           body: bytes, timeout: float) -> HttpResponse:
        return await http_request(self.files, port, method, path, headers, body, timeout)
