"""The edge: one per node. Final admission, storage provisioning, runtime launch,
lifecycle and TTLs, cleanup, and recovery after its own restart.

:class:`Edge` implements :class:`dsec.node.edge.api.EdgeAPI` (the apiserver reaches it only
through that interface, in-process in embedded mode) as a thin facade: its constructor
builds the parts, each with the collaborators it uses, and every operation is one call
into the part that owns it (docs/architecture.md, "The edge"):

- the node (dsec.node.edge.core) and the sandbox table (dsec.node.edge.table);
- lifecycle (dsec.node.edge.lifecycle): the state table of which operation is legal in
  which state, the gate every entry point goes through, pause, resume, stop;
- creation, teardown, recovery, capacity, sweepers, auditing;
- interactive (exec, files, processes, TTYs, watches), the keyed command log (keyed);
- checkpointing (and its chains), in-place snapshots (rollback), pack_diff (snapshots),
  live branches (branching).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator

from prometheus_client import generate_latest
from sqlalchemy import Engine

from dsec.node.backends.api import Sandbox
from dsec.node.backends.fncall.pool import FnCallService
from dsec.node.checkpoints.store import CheckpointStore
from dsec.node.edge.accesslists import AccessLists
from dsec.node.edge.auditing import Auditing
from dsec.node.edge.branching import Brancher
from dsec.node.edge.capacity import Capacity
from dsec.node.edge.chains import CheckpointChains
from dsec.node.edge.checkpointing import Checkpointing
from dsec.node.edge.cmdlog import CommandLog
from dsec.node.edge.config import EdgeConfig
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.creation import Creation
from dsec.node.edge.interactive import Interactive
from dsec.node.edge.keyed import KeyedExec
from dsec.node.edge.lifecycle import Lifecycle, Op
from dsec.node.edge.metrics import EdgeMetrics
from dsec.node.edge.recovery import Recovery
from dsec.node.edge.rollback import InplaceSnapshots
from dsec.node.edge.runner import CommandRunner
from dsec.node.edge.snapshots import Snapshots
from dsec.node.edge.sweepers import Sweepers
from dsec.node.edge.table import SandboxTable
from dsec.node.edge.teardown import Teardown
from dsec.node.layers.store import Layer, LayerStore
from dsec.shared.meta import open_db, sqlite_url
from dsec.shared.meta.registry import Registry
from dsec.shared.wire.console import FnCallStats, SandboxPage, SandboxQuery
from dsec.shared.wire.edge import FsEvent, HttpPart, ProcInfo, ProcOutput, ProcRef, ProcSpec, TtyInput, TtyOutput
from dsec.shared.wire.fleet import CheckpointInfo, RestoreSpec
from dsec.shared.wire.models import (
    AuditRecord,
    CommandRecord,
    ContainerArgs,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileStat,
    FnCallArgs,
    FnCallResult,
    HttpResponse,
    MicroVMArgs,
    NetworkInfo,
    NodeStats,
    Owner,
    SandboxEvent,
    SandboxInfo,
    SandboxUsage,
    StorageStats,
    VMArgs,
)
from dsec.shared.wire.snapshots import RollbackResult, SandboxSnapshot


class Edge:
    """The in-process edge (see the module's docstring)."""

    def __init__(self, cfg: EdgeConfig, layers: LayerStore, meta: Engine | None = None) -> None:
        """``meta``: the metadata database checkpoints are recorded in (a cluster's, so that
        another edge can restore them); by default the data dir's own."""
        self.cfg, self.name, self.layers = cfg, cfg.name, layers
        root = os.path.join(cfg.data_dir, "edges", cfg.name)
        os.makedirs(root, exist_ok=True)
        table = self.table = SandboxTable(cfg.name, os.path.join(root, "state.db"))
        node = self.node = EdgeNode(cfg, layers, table)
        self.sandboxes, self.held, self.network = table.sandboxes, table.held, node.network  # (read by tests, tools)
        self.cmdlog = CommandLog(os.path.join(root, "commands.db"))  # keyed commands (node/edge/keyed.py)
        self.metrics = EdgeMetrics(self.name, lambda: [
            (sb.id, sb.rec.info.state.value, sb.rec.info.job, self.capacity.usage_of(sb))
            for sb in list(table.sandboxes.values()) if not sb.stopping], lambda: self.capacity.storage_stats_now())
        # the parts, lowest first: each gets the ones it calls
        self.chains = CheckpointChains(node, CheckpointStore(meta or open_db(sqlite_url(cfg.data_dir)), layers))
        access = AccessLists(node)
        self.teardown = Teardown(node, table, self.chains, access, self.metrics)
        self.lifecycle = Lifecycle(node, table, self.teardown)
        self.capacity = Capacity(node, table, self.lifecycle)
        self.auditing = Auditing(node, self.lifecycle)
        self.creation = Creation(node, table, self.lifecycle, self.capacity, self.auditing, self.teardown,
                                 self.metrics)
        runner = CommandRunner(node, self.metrics)
        self.keyed = KeyedExec(table, self.lifecycle, runner, self.cmdlog)
        self.interactive = Interactive(node, self.lifecycle, runner, self.keyed)
        self.snapshots = Snapshots(node, self.lifecycle, access)
        self.inplace = InplaceSnapshots(node, table, self.lifecycle, self.cmdlog)
        self.checkpointing = Checkpointing(node, table, self.chains, self.lifecycle, self.creation, self.teardown,
                                           self.cmdlog)
        self.recovery = Recovery(node, table, self.lifecycle, self.teardown, self.cmdlog)
        self.sweepers = Sweepers(node, table, self.lifecycle, self.teardown, self.auditing, self.checkpointing,
                                 self.cmdlog)
        self.fncall_service = FnCallService(self, os.cpu_count() or 1)
        if meta is not None:  # a cluster's edge: its sandboxes walled off from the cluster's services
            node.network.use_cluster(Registry(meta), cfg.name)
        self.brancher = Brancher(
            running=self._branch_parent, backend_of=node.backend_of, admit=self.capacity.admit_many,
            create=self.creation.create_sandbox, stop=self.stop, cmdlog=self.cmdlog, on_event=node.on_event,
            work_dir=os.path.join(os.path.dirname(node.sandbox_root), "branches"))

    # ---- the edge itself ------------------------------------------------------------------
    async def start(self) -> None:
        await self.node.start()
        await self.recovery.recover()
        self.sweepers.start()

    async def close(self) -> None:
        """Stop serving; running sandboxes keep running and are re-adopted next start
        (FnCall pool containers are stopped: they hold no one's state)."""
        await self.fncall_service.close()
        await self.keyed.close()
        await self.sweepers.close()
        if self.teardown.tasks:  # bounded: a teardown stuck on the kernel must not hold the shutdown forever
            await asyncio.wait(list(self.teardown.tasks), timeout=60)
        node, left = self.node, bool(self.sandboxes)
        for sb in self.sandboxes.values():
            if sb.watch:
                sb.watch.cancel()
            if sb.agent:
                sb.agent.detach()
            node.backend_of(sb).detach(sb)
        self.sweepers.flush_activity()
        node.containers.close(sandboxes_left=left)
        await node.network.close(keep=left)
        node.procwatch.close()
        node.audit.close()
        if not left:
            node.volume.close()
        await self.release_layers()
        await node.node_layers.close(sandboxes_left=left)
        if not left:  # per-boot sockets and runtime state: nothing left to find again
            shutil.rmtree(node.run_dir, ignore_errors=True)

    async def create_sandbox(self, args: ContainerArgs | MicroVMArgs | VMArgs, sandbox_id: str | None = None,
                             extra: list[str] | None = None, origin: SandboxInfo | None = None,
                             restored_from: str | None = None, base: list[str] | None = None,
                             restore: dict[str, str] | None = None, branched_from: str | None = None
                             ) -> SandboxInfo:
        """Every create's internal entry point (a restore's, a branch's): Creation.create_sandbox."""
        return await self.creation.create_sandbox(args, sandbox_id, extra, origin, restored_from, base, restore,
                                                  branched_from)

    def _branch_parent(self, sandbox_id: str) -> Sandbox:
        sb = self.lifecycle.check(Op.BRANCH, sandbox_id)
        assert sb is not None  # (BRANCH is legal only while it runs)
        return sb

    # ---- the contract, each operation in the part that owns it ---------------------------
    async def create(self, args: ContainerArgs | MicroVMArgs | VMArgs) -> SandboxInfo:
        return await self.creation.create(args)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self.lifecycle.get(sandbox_id)

    async def list_sandboxes(self, job: str | None = None, labels: dict[str, str] | None = None,
                             usage: bool = False) -> list[SandboxInfo]:
        return await self.capacity.list_sandboxes(job, labels, usage)

    async def query_sandboxes(self, query: SandboxQuery) -> SandboxPage:
        return await self.capacity.query_sandboxes(query)

    async def stop(self, sandbox_id: str) -> SandboxInfo:
        return await self.lifecycle.stop(sandbox_id)

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return await self.lifecycle.pause(sandbox_id)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self.lifecycle.resume(sandbox_id)

    async def set_deadline(self, sandbox_id: str, seconds: int) -> SandboxInfo:
        return await self.lifecycle.set_deadline(sandbox_id, seconds)

    async def touch(self, sandbox_id: str) -> None:
        return await self.lifecycle.touch(sandbox_id)

    async def usage(self, sandbox_id: str) -> SandboxUsage:
        return await self.capacity.usage(sandbox_id)

    async def usage_many(self, sandbox_ids: list[str]) -> dict[str, SandboxUsage]:
        return await self.capacity.usage_many(sandbox_ids)

    async def events(self, sandbox_id: str) -> list[SandboxEvent]:
        return await self.auditing.events(sandbox_id)

    async def audit_log(self, sandbox_id: str, kind: str | None = None, flagged: bool = False,
                        limit: int = 1000) -> list[AuditRecord]:
        return await self.auditing.audit_log(sandbox_id, kind, flagged, limit)

    async def protect(self, sandbox_id: str, paths: list[str]) -> int:
        return await self.auditing.protect(sandbox_id, paths)

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await self.interactive.exec(sandbox_id, req)

    def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        return self.interactive.exec_stream(sandbox_id, req)

    async def command_log(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[CommandRecord]:
        return await self.keyed.command_log(sandbox_id, after, limit)

    def proc_start(self, sandbox_id: str, spec: ProcSpec) -> AsyncIterator[ProcOutput]:
        return self.interactive.proc_start(sandbox_id, spec)

    def proc_connect(self, sandbox_id: str, ref: ProcRef) -> AsyncIterator[ProcOutput]:
        return self.interactive.proc_connect(sandbox_id, ref)

    async def proc_list(self, sandbox_id: str) -> list[ProcInfo]:
        return await self.interactive.proc_list(sandbox_id)

    async def proc_input(self, sandbox_id: str, ref: ProcRef, data: bytes) -> None:
        return await self.interactive.proc_input(sandbox_id, ref, data)

    async def proc_close_stdin(self, sandbox_id: str, ref: ProcRef) -> None:
        return await self.interactive.proc_close_stdin(sandbox_id, ref)

    async def proc_signal(self, sandbox_id: str, ref: ProcRef, signal: int) -> None:
        return await self.interactive.proc_signal(sandbox_id, ref, signal)

    async def proc_resize(self, sandbox_id: str, ref: ProcRef, cols: int, rows: int) -> None:
        return await self.interactive.proc_resize(sandbox_id, ref, cols, rows)

    def tty(self, sandbox_id: str, cols: int, rows: int,
            input: AsyncIterator[TtyInput]) -> AsyncIterator[TtyOutput]:
        return self.interactive.tty(sandbox_id, cols, rows, input)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self.interactive.read_file(sandbox_id, path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644,
                         owner: Owner | None = None) -> None:
        return await self.interactive.write_file(sandbox_id, path, data, mode, owner)

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileStat]:
        return await self.interactive.list_dir(sandbox_id, path)

    async def stat(self, sandbox_id: str, path: str) -> FileStat:
        return await self.interactive.stat(sandbox_id, path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        return await self.interactive.remove(sandbox_id, path, recursive)

    async def make_dir(self, sandbox_id: str, path: str, owner: Owner | None = None) -> bool:
        return await self.interactive.make_dir(sandbox_id, path, owner)

    async def move(self, sandbox_id: str, source: str, destination: str) -> FileStat:
        return await self.interactive.move(sandbox_id, source, destination)

    async def set_xattrs(self, sandbox_id: str, path: str, prefix: str, values: dict[str, str]) -> None:
        return await self.interactive.set_xattrs(sandbox_id, path, prefix, values)

    def watch(self, sandbox_id: str, path: str, recursive: bool) -> AsyncIterator[list[FsEvent]]:
        return self.interactive.watch(sandbox_id, path, recursive)

    async def watcher_create(self, sandbox_id: str, path: str, recursive: bool) -> str:
        return await self.interactive.watcher_create(sandbox_id, path, recursive)

    async def watcher_events(self, sandbox_id: str, watcher_id: str) -> list[FsEvent]:
        return await self.interactive.watcher_events(sandbox_id, watcher_id)

    async def watcher_remove(self, sandbox_id: str, watcher_id: str) -> None:
        return await self.interactive.watcher_remove(sandbox_id, watcher_id)

    async def set_network_rules(self, sandbox_id: str, changes: dict[str, bool]) -> NetworkInfo:
        return await self.creation.set_network_rules(sandbox_id, changes)

    async def http(self, sandbox_id: str, port: int, method: str, path: str,
                   headers: list[tuple[str, str]], body: bytes, timeout: float = 60.0) -> HttpResponse:
        return await self.interactive.http(sandbox_id, port, method, path, headers, body, timeout)

    def http_stream(self, sandbox_id: str, port: int, method: str, path: str,
                    headers: list[tuple[str, str]], body: bytes, timeout: float = 60.0) -> AsyncIterator[HttpPart]:
        return self.interactive.http_stream(sandbox_id, port, method, path, headers, body, timeout)

    async def screenshot(self, sandbox_id: str) -> bytes:
        return await self.interactive.screenshot(sandbox_id)

    async def send_keys(self, sandbox_id: str, keys: str) -> None:
        return await self.interactive.send_keys(sandbox_id, keys)

    async def click(self, sandbox_id: str, x: int, y: int, button: str = "left") -> None:
        return await self.interactive.click(sandbox_id, x, y, button)

    async def stats(self) -> NodeStats:
        return await self.capacity.stats()

    async def storage_stats(self) -> StorageStats:
        return await self.capacity.storage_stats()

    async def pack_diff(self, sandbox_id: str, ref: str, scrub_paths: list[str] | None = None,
                        default_scrub: bool = True, source: str | None = None) -> Layer:
        return await self.snapshots.pack_diff(sandbox_id, ref, scrub_paths, default_scrub, source)

    async def save_access_lists(self, sandbox_id: str) -> dict[str, int]:
        return await self.snapshots.save_access_lists(sandbox_id)

    async def layers_in_use(self) -> set[str]:
        return await self.capacity.layers_in_use()

    async def release_layers(self) -> None:
        return await self.capacity.release_layers()

    async def set_cordon(self, cordoned: bool, reason: str = "") -> None:
        return await self.capacity.set_cordon(cordoned, reason)

    async def checkpoint(self, sandbox_id: str, full: bool = False) -> CheckpointInfo:
        return await self.checkpointing.checkpoint(sandbox_id, full)

    async def restore(self, spec: RestoreSpec) -> SandboxInfo:
        return await self.checkpointing.restore(spec)

    async def evict(self, sandbox_id: str, moved_to: str) -> SandboxInfo:
        return await self.checkpointing.evict(sandbox_id, moved_to)

    async def snapshot(self, sandbox_id: str, name: str | None = None) -> SandboxSnapshot:
        return await self.inplace.snapshot(sandbox_id, name)

    async def list_snapshots(self, sandbox_id: str) -> list[SandboxSnapshot]:
        return await self.inplace.list_snapshots(sandbox_id)

    async def drop_snapshot(self, sandbox_id: str, name: str) -> None:
        return await self.inplace.drop_snapshot(sandbox_id, name)

    async def rollback(self, sandbox_id: str, snapshot: str) -> RollbackResult:
        return await self.inplace.rollback(sandbox_id, snapshot)

    async def branch(self, sandbox_id: str, n: int = 1) -> list[SandboxInfo]:
        """``n`` live branches of a running sandbox (dsec.node.edge.branching)."""
        return await self.brancher.branch(sandbox_id, n)

    async def metrics_text(self) -> bytes:
        return await asyncio.to_thread(generate_latest, self.metrics.registry)

    async def fncall(self, args: FnCallArgs) -> FnCallResult:
        return await self.fncall_service.call(args)

    async def fncall_languages(self, image: str) -> list[str]:
        return await self.fncall_service.languages(image, self.layers.has)

    async def fncall_stats(self) -> FnCallStats:
        return self.fncall_service.stats(self.name)

    async def spawn_worker(self, sandbox_id: str, argv: list[str], files: dict[str, bytes]
                           ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The FnCall pool's worker channel (Interactive.spawn_worker)."""
        return await self.interactive.spawn_worker(sandbox_id, argv, files)
