"""The in-process edge's streams: the agent's live objects (output callbacks, the process
table, inotify watches, a pty, an HTTP response) turned into the contract's async
iterators of models, and the polled directory watchers the edge holds for clients.

Every stream here ends its work when the consumer closes it: a closed exec stream
cancels the command, a closed TTY kills the shell, a closed watch drops its inotify fd.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from dsec.node.agent.aether import Aether, OnData
from dsec.node.agent.fdio import write_all
from dsec.node.agent.initclient import exit_code
from dsec.node.agent.procs import Proc, ProcessTable
from dsec.node.agent.watch import DirWatch
from dsec.shared.errors import AdmissionRejected, DsecError, InvalidRequest, NotFound, SandboxBusy
from dsec.shared.wire.edge import FsEvent, ProcInfo, ProcOutput, ProcRef, ProcSpec, TtyInput, TtyOutput
from dsec.shared.wire.models import ExecEvent, ExecResult

INPUT_LIMIT = 4 << 20  # bytes of input queued for a stream before its input is ended
KEEPALIVE_S = 30.0  # a quiet stream says it is alive this often (proxies and clients time out idle ones)
MAX_WATCHERS, MAX_WATCHERS_PER_SANDBOX = 8192, 256
MAX_STREAMS_PER_SANDBOX = 256  # as many as its process table holds processes
TTY_DRAIN_S = 0.5  # output after the shell's exit still goes out for this long


async def exec_events(run: Callable[[OnData], Awaitable[ExecResult]]) -> AsyncIterator[ExecEvent]:
    """A command's output as it is produced, then its result; closing the stream early
    cancels the command."""
    queue: asyncio.Queue[ExecEvent | BaseException | None] = asyncio.Queue()

    def on_data(name: str, data: bytes) -> None:
        queue.put_nowait(ExecEvent(type=name, data=data.decode("utf-8", errors="replace")))  # type: ignore[arg-type]

    async def go() -> None:
        try:
            queue.put_nowait(ExecEvent(type="result", result=await run(on_data)))
        except Exception as e:  # noqa: BLE001 - re-raised to the consumer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    task = asyncio.create_task(go())
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


class InputBuffer:
    """Input items pushed without ever waiting (so whoever reads them off a socket keeps
    reading, and sees the peer leave), taken as an async iterator. Past ``limit`` bytes
    queued the input ends: a consumer that stopped reading does not make the edge hold
    unbounded input."""

    def __init__(self, limit: int = INPUT_LIMIT) -> None:
        self.q: asyncio.Queue[tuple[Any, int] | None] = asyncio.Queue()
        self.queued, self.limit, self.ended = 0, limit, False

    def push(self, item: Any, size: int) -> None:
        if self.ended:
            return
        if self.queued + size > self.limit:
            self.end()
            return
        self.queued += size
        self.q.put_nowait((item, size))

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.q.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[Any]:
        while (got := await self.q.get()) is not None:
            item, size = got
            self.queued -= size
            yield item


# ---- processes ---------------------------------------------------------------------

def find_proc(table: ProcessTable, ref: ProcRef) -> Proc:
    p = table.find(ref.pid, ref.tag)
    if p is None:
        raise NotFound(f"process with {ref} not found", field="ref")
    return p


async def proc_start(table: ProcessTable, spec: ProcSpec) -> Proc:
    try:
        return await table.start(spec.cmd, spec.args, spec.envs, spec.cwd, spec.pty, spec.stdin, spec.tag,
                                 spec.owner)
    except ValueError as e:  # the table is full
        raise AdmissionRejected(str(e)) from None


async def proc_events(p: Proc) -> AsyncIterator[ProcOutput]:
    """``start`` (its pid), then what it prints from now on, then its end; a keepalive
    while it is quiet."""
    q = p.subscribe()
    try:
        yield ProcOutput(kind="start", pid=p.pid)
        while True:
            try:
                ev = await asyncio.wait_for(q.get(), KEEPALIVE_S)
            except TimeoutError:
                yield ProcOutput(kind="keepalive", pid=p.pid)
                continue
            p.consumed(q, ev)
            if ev.kind == "end":
                yield ProcOutput(kind="end", pid=p.pid, exit_code=ev.exit_code, status=ev.status)
                return
            yield ProcOutput(kind="data" if ev.kind == "data" else "lost", pid=p.pid, stream=ev.stream,
                             data=ev.data)
    finally:
        p.unsubscribe(q)


def proc_list(table: ProcessTable) -> list[ProcInfo]:
    return [ProcInfo(pid=p.pid, tag=p.tag, cmd=p.cmd, args=p.args, envs=p.envs, cwd=p.cwd, pty=p.pty)
            for p in table.procs.values()]


async def proc_input(table: ProcessTable, ref: ProcRef, data: bytes) -> None:
    p = find_proc(table, ref)
    try:
        await table.write(p, data)
    except (ValueError, OSError) as e:
        raise SandboxBusy(f"cannot write to process {p.pid}: {e}", field="ref") from None


async def proc_resize(table: ProcessTable, ref: ProcRef, cols: int, rows: int) -> None:
    p = find_proc(table, ref)
    try:
        await table.resize(p, cols, rows)
    except ValueError as e:
        raise SandboxBusy(str(e), field="ref") from None


# ---- directory watches ------------------------------------------------------------------

def fs_events(w: DirWatch) -> list[FsEvent]:
    return [FsEvent(name=e.name, kind=e.kind) for e in w.drain()]  # type: ignore[arg-type]


async def watch_stream(w: DirWatch) -> AsyncIterator[list[FsEvent]]:
    """Batches of events as they come; an empty batch every KEEPALIVE_S of quiet."""
    try:
        yield []  # the watch exists: what happens from here on is reported
        while not w.closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.changed.wait(), KEEPALIVE_S)
            yield fs_events(w)
    finally:
        w.close()


class Watchers:
    """Directory watchers the edge holds for clients that poll them (E2B's CreateWatcher):
    bounded per sandbox and per edge, released with their sandbox."""

    def __init__(self) -> None:
        self.by_sandbox: dict[str, dict[str, DirWatch]] = {}

    def count(self) -> int:
        return sum(len(ws) for ws in self.by_sandbox.values())

    def add(self, sandbox_id: str, w: DirWatch) -> str:
        mine = self.by_sandbox.setdefault(sandbox_id, {})
        for wid in [k for k, v in mine.items() if v.closed]:
            del mine[wid]
        if len(mine) >= MAX_WATCHERS_PER_SANDBOX or self.count() >= MAX_WATCHERS:
            w.close()
            limit = (f"{MAX_WATCHERS_PER_SANDBOX} watchers per sandbox" if len(mine) >= MAX_WATCHERS_PER_SANDBOX
                     else f"{MAX_WATCHERS} watchers per edge")
            raise AdmissionRejected(f"at most {limit}", field="path", sandbox_id=sandbox_id)
        wid = secrets.token_hex(8)
        mine[wid] = w
        return wid

    def get(self, sandbox_id: str, watcher_id: str) -> DirWatch:
        w = self.by_sandbox.get(sandbox_id, {}).get(watcher_id)
        if w is None:
            raise NotFound(f"watcher {watcher_id!r} not found", field="watcher_id", sandbox_id=sandbox_id)
        return w

    def remove(self, sandbox_id: str, watcher_id: str) -> None:
        self.get(sandbox_id, watcher_id).close()
        self.by_sandbox[sandbox_id].pop(watcher_id, None)

    def release(self, sandbox_id: str) -> None:
        for w in self.by_sandbox.pop(sandbox_id, {}).values():
            w.close()


class StreamSlots:
    """Open streams per sandbox (TTYs, streamed execs, process streams, watches, streamed
    port responses): bounded, so that one client cannot hold an edge's memory and fds
    open through one sandbox. A slot is held for as long as the stream is."""

    def __init__(self, per_sandbox: int = MAX_STREAMS_PER_SANDBOX) -> None:
        self.per_sandbox = per_sandbox
        self.open: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, sandbox_id: str, what: str) -> Iterator[None]:
        n = self.open.get(sandbox_id, 0)
        if n >= self.per_sandbox:
            raise AdmissionRejected(f"sandbox {sandbox_id} has {n} open streams (terminals, streamed commands, "
                                    f"watches, port streams), the most it may; close one before opening a {what}",
                                    sandbox_id=sandbox_id)
        self.open[sandbox_id] = n + 1
        try:
            yield
        finally:
            left = self.open.get(sandbox_id, 1) - 1
            if left > 0:
                self.open[sandbox_id] = left
            else:
                self.open.pop(sandbox_id, None)


# ---- the TTY duplex ------------------------------------------------------------------------

async def tty_session(agent: Aether, cols: int, rows: int, input: AsyncIterator[TtyInput],
                      touch: Callable[[], None]) -> AsyncIterator[TtyOutput]:
    """An interactive shell on a new pty: ``input`` is written to it (and resizes it),
    its output comes back, the exit code last. The shell is killed when the input ends
    or the consumer closes the stream."""
    master, pid, exited = await agent.open_tty(cols, rows)
    loop = asyncio.get_running_loop()
    out: asyncio.Queue[bytes] = asyncio.Queue()
    os.set_blocking(master, False)

    def readable() -> None:
        try:
            data = os.read(master, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        out.put_nowait(data)
        if not data:
            loop.remove_reader(master)

    async def pump_in() -> None:
        async for item in input:
            if item.resize is not None:
                await agent.resize_tty(master, max(1, min(item.resize[0], 1000)), max(1, min(item.resize[1], 1000)))
            if item.data:
                await write_all(master, item.data)  # a full pty waits, never fails the session
            touch()

    loop.add_reader(master, readable)
    in_task = asyncio.create_task(pump_in())
    ended_input = False
    try:
        yield TtyOutput()  # the shell is up
        while True:
            get = asyncio.ensure_future(out.get())
            done, _ = await asyncio.wait([get, in_task, exited], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
            if get in done:
                data = get.result()
                if data:
                    yield TtyOutput(data=data)
                    continue
                break  # the pty closed
            get.cancel()
            if in_task in done:
                ended_input = True
                break
            break  # exited: let the last output through below
        if not ended_input:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TTY_DRAIN_S):
                    while data := await out.get():
                        yield TtyOutput(data=data)
            with contextlib.suppress(TimeoutError, DsecError):
                await asyncio.wait_for(asyncio.shield(exited), 2)
            code = exit_code(exited.result()) if exited.done() and not exited.exception() else -1
            yield TtyOutput(exit_code=code)
    finally:
        in_task.cancel()
        with contextlib.suppress(BaseException):  # its wait on the pty must end before the fd closes
            await in_task
        if not exited.done():
            with contextlib.suppress(DsecError):
                await agent.init.kill_tree(pid, signal.SIGKILL, 0, include_self=True)
            with contextlib.suppress(asyncio.TimeoutError, DsecError):
                await asyncio.wait_for(asyncio.shield(exited), 2)
        with contextlib.suppress(Exception):
            loop.remove_reader(master)
        os.close(master)


def check_signal(sig: int) -> int:
    if sig not in signal.valid_signals():
        raise InvalidRequest(f"{sig} is not a signal", field="signal")
    return sig
