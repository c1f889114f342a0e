"""A sandbox's lifecycle on its edge: the one table of which operation is legal in which
state (:data:`LEGAL`), the gate every entry point that names a sandbox goes through
(:meth:`Lifecycle.check`, :meth:`Lifecycle.attached`, :meth:`Lifecycle.ready`), and the
transitions that are not a create or a teardown: pause, resume, stop (which hands the
sandbox to dsec.node.edge.teardown), the agent's binding and the watch on it, the deadline.

A sandbox's state, as the gate reads it (:func:`state_of`)::

    creating --(agent bound)--> running <--pause/resume--> paused
        \\                         |                          |
         +------------------------+--- stop, TTL, failure ---+--> stopping --> ended

``ended`` is a sandbox no longer in the table (its record, if any, is a tombstone);
``creating`` also covers a sandbox whose agent is not bound yet (one being re-adopted).
A request that reaches the agent (:data:`RESUMES`) resumes a paused sandbox first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from enum import StrEnum

from dsec.node.agent.aether import DEFAULT_PATH, Aether, AgentContext, InitChannel
from dsec.node.backends.api import InitLink, SandboxLost
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.sandbox import Sandbox
from dsec.node.edge.table import SandboxTable
from dsec.node.edge.teardown import MOVED_TO, Teardown
from dsec.node.host import memory
from dsec.shared import tracing
from dsec.shared.errors import SandboxBusy, SandboxNotRunning
from dsec.shared.wire.models import PauseInfo, SandboxInfo, SandboxState

log = logging.getLogger("dsec.edge")


class State(StrEnum):
    CREATING = "creating"  # being created, or re-adopted: its agent is not bound yet
    RUNNING = "running"  # its agent answers
    PAUSED = "paused"
    STOPPING = "stopping"  # its teardown is under way
    ENDED = "ended"  # no longer on the edge (a tombstone, or nothing)


class Op(StrEnum):
    """The edge contract's operations that name a sandbox (their method names)."""

    GET = "get"
    STOP = "stop"
    PAUSE = "pause"
    RESUME = "resume"
    SET_DEADLINE = "set_deadline"
    TOUCH = "touch"
    USAGE = "usage"
    EVENTS = "events"
    AUDIT_LOG = "audit_log"
    PROTECT = "protect"
    EXEC = "exec"
    EXEC_STREAM = "exec_stream"
    COMMAND_LOG = "command_log"
    PROC_START = "proc_start"
    PROC_CONNECT = "proc_connect"
    PROC_LIST = "proc_list"
    PROC_INPUT = "proc_input"
    PROC_CLOSE_STDIN = "proc_close_stdin"
    PROC_SIGNAL = "proc_signal"
    PROC_RESIZE = "proc_resize"
    TTY = "tty"
    READ_FILE = "read_file"
    WRITE_FILE = "write_file"
    LIST_DIR = "list_dir"
    STAT = "stat"
    REMOVE = "remove"
    MAKE_DIR = "make_dir"
    MOVE = "move"
    SET_XATTRS = "set_xattrs"
    WATCH = "watch"
    WATCHER_CREATE = "watcher_create"
    WATCHER_EVENTS = "watcher_events"
    WATCHER_REMOVE = "watcher_remove"
    SET_NETWORK_RULES = "set_network_rules"
    HTTP = "http"
    HTTP_STREAM = "http_stream"
    SCREENSHOT = "screenshot"
    SEND_KEYS = "send_keys"
    CLICK = "click"
    PACK_DIFF = "pack_diff"
    SAVE_ACCESS_LISTS = "save_access_lists"
    CHECKPOINT = "checkpoint"
    EVICT = "evict"
    SNAPSHOT = "snapshot"
    LIST_SNAPSHOTS = "list_snapshots"
    DROP_SNAPSHOT = "drop_snapshot"
    ROLLBACK = "rollback"
    BRANCH = "branch"
    SPAWN_WORKER = "spawn_worker"  # (the FnCall pool's, not the contract's)


ANY = frozenset(State)
LIVE = frozenset({State.CREATING, State.RUNNING, State.PAUSED})
HELD = frozenset({State.RUNNING, State.PAUSED})  # created, not stopping: its files and agent are there
AGENT = frozenset({State.RUNNING})  # requests into the sandbox, through its agent
_AGENT_OPS = (Op.PROTECT, Op.EXEC, Op.EXEC_STREAM, Op.PROC_START, Op.PROC_CONNECT, Op.PROC_LIST, Op.PROC_INPUT,
              Op.PROC_CLOSE_STDIN, Op.PROC_SIGNAL, Op.PROC_RESIZE, Op.TTY, Op.READ_FILE, Op.WRITE_FILE,
              Op.LIST_DIR, Op.STAT, Op.REMOVE, Op.MAKE_DIR, Op.MOVE, Op.SET_XATTRS, Op.WATCH, Op.WATCHER_CREATE,
              Op.SET_NETWORK_RULES, Op.HTTP, Op.HTTP_STREAM, Op.SCREENSHOT, Op.SEND_KEYS, Op.CLICK, Op.PACK_DIFF,
              Op.ROLLBACK, Op.SPAWN_WORKER)

# THE table: in which states each operation may go ahead; any other state is refused
# (SandboxNotRunning, NotFound for an id this edge never had). Records answer in any state.
LEGAL: dict[Op, frozenset[State]] = {
    **{op: ANY for op in (Op.GET, Op.STOP, Op.RESUME, Op.TOUCH, Op.EVENTS, Op.AUDIT_LOG, Op.COMMAND_LOG, Op.EVICT,
                          Op.WATCHER_EVENTS, Op.WATCHER_REMOVE)},
    Op.USAGE: LIVE | {State.STOPPING},  # a stopping sandbox still uses what it holds
    Op.SET_DEADLINE: LIVE,
    Op.PAUSE: HELD,  # a paused one is answered as it is
    Op.CHECKPOINT: HELD,
    Op.SAVE_ACCESS_LISTS: HELD,
    Op.SNAPSHOT: HELD, Op.LIST_SNAPSHOTS: HELD, Op.DROP_SNAPSHOT: HELD,  # (a paused container is frozen)
    Op.BRANCH: AGENT,  # a paused parent is not resumed for it: refused, it stays as it is
    **{op: AGENT for op in _AGENT_OPS},
}
# a paused sandbox is resumed for these first (any request into the sandbox resumes it)
RESUMES = frozenset(_AGENT_OPS)
# these answer from what is there and check nothing of the id itself (internal, or keyed by another id)
UNCHECKED_ID = frozenset({Op.TOUCH, Op.WATCHER_EVENTS, Op.WATCHER_REMOVE, Op.EVICT})


def state_of(sb: Sandbox | None) -> State:
    """The sandbox's state as the gate reads it (see the module's docstring)."""
    if sb is None:
        return State.ENDED
    if sb.stopping:
        return State.STOPPING
    state = sb.rec.info.state
    if state == SandboxState.paused:
        return State.PAUSED
    if state == SandboxState.running and sb.agent is not None:
        return State.RUNNING
    return State.CREATING


class Lifecycle:
    """The gate and the transitions (see the module's docstring)."""

    def __init__(self, node: EdgeNode, table: SandboxTable, teardown: Teardown) -> None:
        self.node = node
        self.table = table
        self.teardown = teardown

    # ---- the gate ---------------------------------------------------------------------
    def check(self, op: Op, sandbox_id: str) -> Sandbox | None:
        """The sandbox ``op`` may act on (None: it has ended and ``op`` answers from its
        record), or the error saying why it may not."""
        sb = self.table.sandboxes.get(sandbox_id) if op in UNCHECKED_ID else self.table.find(sandbox_id)
        if state_of(sb) not in LEGAL[op]:
            raise self._refusal(op, sandbox_id, sb)
        return sb

    def attached(self, op: Op, sandbox_id: str) -> tuple[Sandbox, Aether]:
        """A sandbox ``op`` may reach through its agent, and the agent; it counts as used now."""
        return self._attach(op, sandbox_id, self.table.find(sandbox_id))

    async def ready(self, op: Op, sandbox_id: str) -> tuple[Sandbox, Aether]:
        """:meth:`attached`, a paused sandbox resumed first where ``op`` resumes (RESUMES)."""
        sb = self.table.find(sandbox_id)
        if op in RESUMES and sb is not None and state_of(sb) == State.PAUSED:
            await self.resume_sandbox(sb)
            sb = self.table.find(sandbox_id)  # (what the table holds after the wait)
        return self._attach(op, sandbox_id, sb)

    def _attach(self, op: Op, sandbox_id: str, sb: Sandbox | None) -> tuple[Sandbox, Aether]:
        if state_of(sb) not in LEGAL[op] or sb is None or sb.agent is None:
            raise self._refusal(op, sandbox_id, sb)
        sb.rec.info.last_active_at = time.time()
        sb.dirty = True
        return sb, sb.agent

    def _refusal(self, op: Op, sandbox_id: str, sb: Sandbox | None) -> SandboxNotRunning:
        """Why ``op`` may not go ahead (NotFound, raised, for a sandbox this edge never had)."""
        live = sb is not None and not sb.stopping
        if op == Op.SET_DEADLINE:
            self.table.tombstone(sandbox_id)
            return SandboxNotRunning(f"sandbox {sandbox_id} has ended", field="sandbox_id")
        if op == Op.USAGE:
            self.table.tombstone(sandbox_id)
            return SandboxNotRunning(f"sandbox {sandbox_id} has ended: it uses nothing")
        if op == Op.CHECKPOINT:
            if not live:
                info = self.table.tombstone(sandbox_id)
                return SandboxNotRunning(f"sandbox {sandbox_id} is {info.state.value}: nothing to checkpoint")
            assert sb is not None
            return SandboxNotRunning(f"sandbox {sandbox_id} is {sb.rec.info.state.value}")
        info = sb.rec.info if sb is not None else self.table.tombstone(sandbox_id)
        return SandboxNotRunning(f"sandbox {sandbox_id} is {info.state.value}"
                                 + (f" ({info.error})" if info.error else ""))

    # ---- records ------------------------------------------------------------------------
    async def get(self, sandbox_id: str) -> SandboxInfo:
        self.check(Op.GET, sandbox_id)
        return self.table.info(sandbox_id)

    async def touch(self, sandbox_id: str) -> None:
        self.check(Op.TOUCH, sandbox_id)
        self.table.touch(sandbox_id)

    async def set_deadline(self, sandbox_id: str, seconds: int) -> SandboxInfo:
        """End the sandbox ``seconds`` from now (its maximum lifetime, moved)."""
        sb = self.check(Op.SET_DEADLINE, sandbox_id)
        assert sb is not None
        lifetime = int(time.time() - sb.rec.info.created_at) + max(1, seconds)
        sb.rec.args = sb.rec.args.model_copy(update={"max_lifetime_s": lifetime})
        sb.rec.info.expires_at = sb.rec.info.created_at + lifetime
        self.table.state.put(sb.rec)
        return sb.rec.info

    # ---- transitions ------------------------------------------------------------------
    async def stop(self, sandbox_id: str) -> SandboxInfo:
        sb = self.check(Op.STOP, sandbox_id)
        if sb is None:
            info = self.table.tombstone(sandbox_id)
            if info.error and info.error.startswith(MOVED_TO):  # the caller's routing is stale: not stopped
                raise SandboxNotRunning(f"sandbox {sandbox_id} {info.error}; ask again", sandbox_id=sandbox_id)
            return info
        # a teardown already under way (TTL, init exit) is waited for, not raced
        with tracing.span("edge.stop", sandbox_id=sandbox_id, backend=sb.rec.args.backend):
            await self.teardown.teardown(sb, SandboxState.stopped, "stopped")
        return sb.rec.info

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """VM: guest RAM and devices to a snapshot file, QEMU ends. Container: frozen
        and its memory pushed out to swap."""
        live = self.check(Op.PAUSE, sandbox_id)
        if live is not None and live.rec.info.state == SandboxState.paused:
            return live.rec.info
        sb, _ = self.attached(Op.PAUSE, sandbox_id)
        node = self.node
        async with sb.lock:
            info = sb.rec.info
            if info.state == SandboxState.paused:
                return info
            if sb.ops:
                raise SandboxBusy(f"sandbox {sandbox_id} has {sb.ops} request(s) in flight; pause after they end")
            t0 = time.monotonic()
            cg = node.cgroup(sb)
            before = memory.cgroup_memory(cg)
            msg = await node.backend_of(sb).pause(sb)
            after = memory.cgroup_memory(cg)
            info.pause = PauseInfo(memory_before_bytes=before.get("total", 0), memory_after_bytes=after.get("total", 0),
                                   swap_bytes=after.get("swap", 0), pause_s=time.monotonic() - t0)
            info.state = SandboxState.paused
            info.paused_at = time.time()
            self.table.held.update(sb)
            self.table.state.put(sb.rec)
        node.on_event(sb.id, "paused", f"{msg}; memory {info.pause.memory_before_bytes >> 20} -> "
                      f"{info.pause.memory_after_bytes >> 20} MiB in {info.pause.pause_s * 1000:.0f} ms")
        return info

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        sb = self.check(Op.RESUME, sandbox_id)
        if sb is None or sb.stopping:
            return self.table.info(sandbox_id)
        await self.resume_sandbox(sb)
        return sb.rec.info

    async def resume_sandbox(self, sb: Sandbox) -> None:
        """Resume ``sb`` if it is paused (a lost one is torn down as failed, and raises)."""
        async with sb.lock:
            info = sb.rec.info
            if info.state != SandboxState.paused or sb.stopping:
                return
            t0 = time.monotonic()
            try:
                msg, link = await self.node.backend_of(sb).resume(sb)
            except SandboxLost as e:
                self.node.on_event(sb.id, "snapshot_error", e.message)
                asyncio.create_task(self.teardown.teardown(sb, SandboxState.failed, f"resume failed: {e.message}"))
                raise
            if link is not None:  # paused across an edge restart: its agent bound now that it runs
                await self.bind_agent(sb, link)
            if info.pause:
                info.pause.resume_s = time.monotonic() - t0
            info.state = SandboxState.running
            info.paused_at = None
            info.last_active_at = time.time()
            self.table.held.update(sb)
            self.table.state.put(sb.rec)
        self.node.on_event(sb.id, "resumed", msg)

    # ---- the agent ------------------------------------------------------------------------
    async def bind_agent(self, sb: Sandbox, link: InitLink) -> None:
        """dsec-init answers over ``link``: make the sandbox's agent over it."""
        args, init = sb.rec.args, link.init
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": sb.id, "LANG": "C.UTF-8", **args.env}
        ctx = AgentContext(sandbox_id=sb.id, init_pid=sb.rec.init_pid, env=env, workdir="/")
        agent = Aether(ctx, init, link.files)
        bash, workdir = await asyncio.gather(agent.files.exists("/bin/bash"), agent.files.exists(args.workdir))
        ctx.shell = "/bin/bash" if bash else "/bin/sh"
        if not workdir:
            await agent.files.mkdirs(args.workdir)
        ctx.workdir = args.workdir
        # an init this create started holds no sessions; a re-adopted one, or a VM restored
        # with its memory (its shells running on: a checkpoint's, a live branch's), may
        info = sb.rec.info
        if info.state != SandboxState.creating or info.restored_from is not None or info.branched_from is not None:
            recovered = await agent.recover_sessions()
            if recovered:
                log.info("sandbox %s: took back sessions %s", sb.id, recovered)
        sb.agent = agent
        sb.watch = asyncio.create_task(self._watch(sb, init))

    async def _watch(self, sb: Sandbox, init: InitChannel) -> None:
        await init.closed.wait()
        if not sb.stopping:
            why = self.node.backend_of(sb).agent_lost(sb)
            await self.teardown.teardown(sb, SandboxState.failed, why)
