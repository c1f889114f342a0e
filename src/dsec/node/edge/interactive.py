"""Requests into a running sandbox, through its agent: exec (plain, streamed, keyed through
dsec.node.edge.keyed), files, processes, the TTY, directory watches, HTTP to its ports,
the display of a VM, and the FnCall pool's worker channel. Each goes through the
lifecycle's gate first (a paused sandbox resumes); the streams themselves are
dsec.node.edge.streams'."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator

from dsec.node.agent.aether import DEFAULT_PATH, OnData
from dsec.node.agent.interfaces import check_path
from dsec.node.agent.procs import ProcessTable
from dsec.node.agent.watch import DirWatch
from dsec.node.backends.api import Display
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.keyed import KeyedExec
from dsec.node.edge.lifecycle import Lifecycle, Op
from dsec.node.edge.runner import CommandRunner
from dsec.node.edge.streams import (
    MAX_STREAMS_PER_SANDBOX,
    MAX_WATCHERS,
    MAX_WATCHERS_PER_SANDBOX,
    InputBuffer,
    StreamSlots,
    Watchers,
    check_signal,
    exec_events,
    find_proc,
    fs_events,
    proc_events,
    proc_input,
    proc_list,
    proc_resize,
    proc_start,
    tty_session,
    watch_stream,
)
from dsec.shared import tracing
from dsec.shared.errors import InvalidRequest, PayloadTooLarge
from dsec.shared.wire.edge import FsEvent, HttpPart, ProcInfo, ProcOutput, ProcRef, ProcSpec, TtyInput, TtyOutput
from dsec.shared.wire.models import ExecEvent, ExecRequest, ExecResult, FileStat, HttpResponse, Owner

__all__ = ["MAX_STREAMS_PER_SANDBOX", "MAX_WATCHERS", "MAX_WATCHERS_PER_SANDBOX", "InputBuffer", "Interactive",
           "StreamSlots", "Watchers"]


class Interactive:
    """The contract's requests into a sandbox (see the module's docstring)."""

    def __init__(self, node: EdgeNode, lifecycle: Lifecycle, runner: CommandRunner, keyed: KeyedExec) -> None:
        self.node = node
        self.lifecycle = lifecycle
        self.runner = runner
        self.keyed = keyed

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await self._exec(sandbox_id, req, None)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        with self.node.streams.hold(sandbox_id, "streamed command"):
            async for ev in exec_events(lambda on_data: self._exec(sandbox_id, req, on_data)):
                yield ev

    async def _exec(self, sandbox_id: str, req: ExecRequest, on_data: OnData | None) -> ExecResult:
        with tracing.span("edge.exec", sandbox_id=sandbox_id, session=req.session, keyed=req.key is not None):
            if req.key is not None:
                return await self.keyed.exec(sandbox_id, req, on_data)
            sb, agent = await self.lifecycle.ready(Op.EXEC, sandbox_id)
            return await self.runner.run(sb, agent, req, on_data)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        check_path(path)
        _, agent = await self.lifecycle.ready(Op.READ_FILE, sandbox_id)
        return await agent.files.read_file(path, self.node.cfg.max_file_bytes)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644,
                         owner: Owner | None = None) -> None:
        limit = self.node.cfg.max_file_bytes
        if len(data) > limit:
            raise PayloadTooLarge(f"file body of {len(data)} bytes exceeds the {limit}-byte limit", field="body")
        check_path(path)
        sb, agent = await self.lifecycle.ready(Op.WRITE_FILE, sandbox_id)
        self.node.audit.record(sb.id, "file_write", f"{path} ({len(data)} bytes, mode {mode:o})")
        await agent.files.write_file(path, data, mode, owner)

    async def make_dir(self, sandbox_id: str, path: str, owner: Owner | None = None) -> bool:
        """Make ``path`` and its parents; False if it already existed."""
        check_path(path)
        sb, agent = await self.lifecycle.ready(Op.MAKE_DIR, sandbox_id)
        if await agent.files.exists(path):
            return False
        self.node.audit.record(sb.id, "file_write", f"{path} (directory)")
        await agent.files.mkdirs(path, owner)
        return True

    async def set_xattrs(self, sandbox_id: str, path: str, prefix: str, values: dict[str, str]) -> None:
        """The user.* extended attributes under ``prefix`` on ``path`` become ``values``."""
        check_path(path)
        sb, agent = await self.lifecycle.ready(Op.SET_XATTRS, sandbox_id)
        self.node.audit.record(sb.id, "file_write", f"{path} (xattrs {prefix}*)")
        await agent.files.set_xattrs(path, prefix, values)

    async def move(self, sandbox_id: str, source: str, destination: str) -> FileStat:
        check_path(source, "source")
        check_path(destination, "destination")
        sb, agent = await self.lifecycle.ready(Op.MOVE, sandbox_id)
        self.node.audit.record(sb.id, "file_write", f"{source} moved to {destination}")
        await agent.files.move(source, destination)
        return await agent.files.stat(destination)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileStat]:
        check_path(path)
        _, agent = await self.lifecycle.ready(Op.LIST_DIR, sandbox_id)
        return await agent.files.list_dir(path)

    async def stat(self, sandbox_id: str, path: str) -> FileStat:
        check_path(path)
        _, agent = await self.lifecycle.ready(Op.STAT, sandbox_id)
        return await agent.files.stat(path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        check_path(path)
        sb, agent = await self.lifecycle.ready(Op.REMOVE, sandbox_id)
        self.node.audit.record(sb.id, "file_remove", f"{path}{' (recursive)' if recursive else ''}")
        await agent.files.remove(path, recursive)

    async def http(self, sandbox_id: str, port: int, method: str, path: str,
                   headers: list[tuple[str, str]], body: bytes, timeout: float = 60.0) -> HttpResponse:
        sb, agent = await self.lifecycle.ready(Op.HTTP, sandbox_id)
        self.node.audit.record(sb.id, "http", f"{method} :{port}{path[:512]}")
        return await agent.http_request(port, method, path, headers, body, timeout)

    async def spawn_worker(self, sandbox_id: str, argv: list[str], files: dict[str, bytes]
                           ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Put ``files`` (root-owned, read-only to others) into a sandbox and start ``argv``
        as root with a socketpair for stdin and stdout: the FnCall pool's worker channel."""
        _, agent = await self.lifecycle.ready(Op.SPAWN_WORKER, sandbox_id)
        for path, data in files.items():
            await agent.files.write_file(path, data, 0o644)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            await agent.init.spawn(argv, {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"}, "/",
                                   [theirs.fileno(), theirs.fileno(), devnull])
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
            os.close(devnull)
        return await asyncio.open_unix_connection(sock=mine, limit=64 << 20)

    def _display(self, op: Op, sandbox_id: str) -> Display:
        sb, _ = self.lifecycle.attached(op, sandbox_id)
        display = self.node.backend_of(sb).display(sb)
        if display is None:
            raise InvalidRequest(f"sandbox {sandbox_id} has no display (a VMArgs sandbox with display=True has)",
                                 field="sandbox_id")
        return display

    async def screenshot(self, sandbox_id: str) -> bytes:
        await self.lifecycle.ready(Op.SCREENSHOT, sandbox_id)
        return await self._display(Op.SCREENSHOT, sandbox_id).screenshot()

    async def send_keys(self, sandbox_id: str, keys: str) -> None:
        await self.lifecycle.ready(Op.SEND_KEYS, sandbox_id)
        await self._display(Op.SEND_KEYS, sandbox_id).send_keys(keys)

    async def click(self, sandbox_id: str, x: int, y: int, button: str = "left") -> None:
        await self.lifecycle.ready(Op.CLICK, sandbox_id)
        await self._display(Op.CLICK, sandbox_id).click(x, y, button)

    async def _table(self, op: Op, sandbox_id: str) -> ProcessTable:
        _, agent = await self.lifecycle.ready(op, sandbox_id)
        self.lifecycle.table.touch(sandbox_id)
        return agent.procs

    async def proc_start(self, sandbox_id: str, spec: ProcSpec) -> AsyncIterator[ProcOutput]:
        with self.node.streams.hold(sandbox_id, "process stream"):
            p = await proc_start(await self._table(Op.PROC_START, sandbox_id), spec)
            async for ev in proc_events(p):
                yield ev

    async def proc_connect(self, sandbox_id: str, ref: ProcRef) -> AsyncIterator[ProcOutput]:
        with self.node.streams.hold(sandbox_id, "process stream"):
            p = find_proc(await self._table(Op.PROC_CONNECT, sandbox_id), ref)
            async for ev in proc_events(p):
                yield ev

    async def proc_list(self, sandbox_id: str) -> list[ProcInfo]:
        return proc_list(await self._table(Op.PROC_LIST, sandbox_id))

    async def proc_input(self, sandbox_id: str, ref: ProcRef, data: bytes) -> None:
        await proc_input(await self._table(Op.PROC_INPUT, sandbox_id), ref, data)

    async def proc_close_stdin(self, sandbox_id: str, ref: ProcRef) -> None:
        table = await self._table(Op.PROC_CLOSE_STDIN, sandbox_id)
        table.close_stdin(find_proc(table, ref))

    async def proc_signal(self, sandbox_id: str, ref: ProcRef, signal: int) -> None:
        table = await self._table(Op.PROC_SIGNAL, sandbox_id)
        await table.signal(find_proc(table, ref), check_signal(signal))

    async def proc_resize(self, sandbox_id: str, ref: ProcRef, cols: int, rows: int) -> None:
        await proc_resize(await self._table(Op.PROC_RESIZE, sandbox_id), ref, cols, rows)

    async def tty(self, sandbox_id: str, cols: int, rows: int, input: AsyncIterator[TtyInput]
                  ) -> AsyncIterator[TtyOutput]:
        cols, rows = max(1, min(cols, 1000)), max(1, min(rows, 1000))
        sb, agent = await self.lifecycle.ready(Op.TTY, sandbox_id)
        self.node.audit.record(sb.id, "tty", f"interactive shell {cols}x{rows}")

        def touch() -> None:
            self.lifecycle.table.touch(sandbox_id)
        with self.node.streams.hold(sb.id, "terminal"):
            async for out in tty_session(agent, cols, rows, input, touch):
                yield out

    async def _dir_watch(self, op: Op, sandbox_id: str, path: str, recursive: bool) -> DirWatch:
        check_path(path)
        _, agent = await self.lifecycle.ready(op, sandbox_id)
        return agent.files.watch(path, recursive)

    async def watch(self, sandbox_id: str, path: str, recursive: bool) -> AsyncIterator[list[FsEvent]]:
        with self.node.streams.hold(sandbox_id, "watch"):
            async for batch in watch_stream(await self._dir_watch(Op.WATCH, sandbox_id, path, recursive)):
                yield batch

    async def watcher_create(self, sandbox_id: str, path: str, recursive: bool) -> str:
        return self.node.watchers.add(sandbox_id, await self._dir_watch(Op.WATCHER_CREATE, sandbox_id, path, recursive))

    async def watcher_events(self, sandbox_id: str, watcher_id: str) -> list[FsEvent]:
        self.lifecycle.check(Op.WATCHER_EVENTS, sandbox_id)  # (answers in any state: the watcher is looked up)
        return fs_events(self.node.watchers.get(sandbox_id, watcher_id))

    async def watcher_remove(self, sandbox_id: str, watcher_id: str) -> None:
        self.lifecycle.check(Op.WATCHER_REMOVE, sandbox_id)
        self.node.watchers.remove(sandbox_id, watcher_id)

    async def http_stream(self, sandbox_id: str, port: int, method: str, path: str, headers: list[tuple[str, str]],
                          body: bytes, timeout: float = 60.0) -> AsyncIterator[HttpPart]:
        sb, agent = await self.lifecycle.ready(Op.HTTP_STREAM, sandbox_id)
        self.node.audit.record(sb.id, "http", f"{method} :{port}{path[:512]}")
        with self.node.streams.hold(sb.id, "port stream"):
            resp = await agent.http_stream(port, method, path, headers, body, timeout)
            try:
                yield HttpPart(status=resp.status, headers=resp.headers)
                async for chunk in resp.body:
                    yield HttpPart(data=chunk)
            finally:
                aclose = getattr(resp.body, "aclose", None)
                if aclose is not None:
                    await aclose()
