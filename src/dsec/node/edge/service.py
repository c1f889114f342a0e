"""The edge: one per node. Final admission, storage provisioning, runtime launch,
lifecycle and TTLs, cleanup, and recovery after its own restart.

It implements :class:`dsec.node.edge.api.EdgeAPI`; the apiserver reaches it only through
that interface (in-process in embedded mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import socket
import time
import weakref
from collections.abc import AsyncIterator

from sqlalchemy import Engine

from dsec.node.agent.aether import (
    DEFAULT_PATH,
    Aether,
    AgentContext,
    InitChannel,
    OnData,
)
from dsec.node.agent.initclient import ChannelLost
from dsec.node.agent.interfaces import check_path
from dsec.node.agent.watch import ensure_instances as ensure_inotify_instances
from dsec.node.backends.api import Display, InitLink, SandboxLost, SandboxRuntime
from dsec.node.checkpoints.store import CheckpointStore
from dsec.node.edge.auditing import Auditing
from dsec.node.edge.branching import Brancher
from dsec.node.edge.capacity import Capacity
from dsec.node.edge.checkpointing import Checkpointing
from dsec.node.edge.config import EdgeConfig
from dsec.node.edge.core import ID_ALPHABET
from dsec.node.edge.interactive import exec_events
from dsec.node.edge.keyed import KeyedExec
from dsec.node.edge.recovery import Recovery
from dsec.node.edge.rollback import InplaceSnapshots
from dsec.node.edge.sandbox import (
    Sandbox,
    explain,
    out_of_space,
)
from dsec.node.edge.snapshots import Snapshots
from dsec.node.edge.state import Record
from dsec.node.edge.sweepers import Sweepers
from dsec.node.edge.teardown import Teardown
from dsec.node.host import linux, memory
from dsec.node.layers.store import LayerStore, layer_kind
from dsec.shared import tracing
from dsec.shared.errors import (
    AdmissionRejected,
    DeadlineExceeded,
    InsufficientStorage,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    SandboxBusy,
    SandboxError,
    SandboxNotRunning,
)
from dsec.shared.faults import failpoint
from dsec.shared.meta import open_db, sqlite_url
from dsec.shared.meta.registry import Registry
from dsec.shared.wire.models import (
    Backend,
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
    Owner,
    PauseInfo,
    SandboxInfo,
    SandboxState,
    VMArgs,
)

log = logging.getLogger("dsec.edge")
RESOLVE_TTL_S = 2.0  # a ref's blobs kept this long when the catalog is a cluster's
# ... for every edge of this process over the same store (one on a node; a hollow fleet's 160
# share it: each alone saw too few creates to hit its own within 2 s, bench/scale.py)
_RESOLVED: weakref.WeakKeyDictionary[LayerStore, dict[str, tuple[float, list[str]]]] = weakref.WeakKeyDictionary()


class Edge(Capacity, Teardown, Recovery, Sweepers, Snapshots, Auditing, KeyedExec, Checkpointing, InplaceSnapshots):
    def __init__(self, cfg: EdgeConfig, layers: LayerStore, meta: Engine | None = None) -> None:
        """``meta``: the metadata database checkpoints are recorded in (a cluster's, so that
        another edge can restore them); by default the data dir's own."""
        super().__init__(cfg, layers)
        self._resolved = _RESOLVED.setdefault(layers, {})  # ref -> (when, its blobs)
        self._init_checkpoints(CheckpointStore(meta or open_db(sqlite_url(cfg.data_dir)), layers))
        if meta is not None:  # a cluster's edge: its sandboxes walled off from the cluster's services
            self.network.use_cluster(Registry(meta), cfg.name)
        self.brancher = Brancher(
            running=lambda sid: self._running(sid)[0], backend_of=self.backend_of, admit=self._admit_many,
            create=self._create, stop=self.stop, cmdlog=self.cmdlog, on_event=self.on_event,
            work_dir=os.path.join(os.path.dirname(self.sandbox_root), "branches"))

    # ---- lifecycle of the edge itself ---------------------------------------
    async def start(self) -> None:
        if self.hollow is not None:  # no process, mount or link of its own (dsec.node.backends.hollow)
            self.network_status = "hollow edge: no network"
            self.density["hollow"] = "a load instrument: its sandboxes run nothing (docs/scale.md)"
            await self._recover()
            self._ttl_task = asyncio.create_task(self._ttl_loop())
            return
        linux.become_subreaper()  # a container's init is orphaned by crun run -d: the edge reaps it
        self.density["swap"] = await asyncio.to_thread(memory.ensure_swap)
        self.density["inotify_instances"] = await asyncio.to_thread(ensure_inotify_instances)
        await self.node_layers.start()
        try:
            self.procwatch.start()
            self.density["audit"] = "every process executed in a sandbox (kernel process events), platform " \
                "requests, egress denials"
        except OSError as e:
            self.density["audit"] = f"platform requests and egress denials; process events unavailable: {e}"
        try:
            await self.network.start()
            self.network_status = f"subnet {self.network.subnet}, services: " + ", ".join(
                f"{k}={'/'.join(v)}" for k, v in sorted(self.network.catalog.services.items()))
        except (OSError, RuntimeError, SandboxError) as e:  # sandboxes still run, without network
            self.network_status = f"unavailable: {e}"
            log.warning("sandbox networking unavailable: %s", e)
        await self._recover()
        self._ttl_task = asyncio.create_task(self._ttl_loop())

    async def close(self) -> None:
        """Stop serving; running sandboxes keep running and are re-adopted next start
        (FnCall pool containers are stopped: they hold no one's state)."""
        await self.fncall_service.close()
        await self._close_command_log()
        if self._ttl_task:
            self._ttl_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ttl_task
        if self._teardowns:  # bounded: a teardown stuck on the kernel must not hold the shutdown forever
            await asyncio.wait(list(self._teardowns), timeout=60)
        for sb in self.sandboxes.values():
            if sb.watch:
                sb.watch.cancel()
            if sb.agent:
                sb.agent.detach()
            self.backend_of(sb).detach(sb)
        self._flush_activity()
        self.containers.close(sandboxes_left=bool(self.sandboxes))
        await self.network.close(keep=bool(self.sandboxes))
        self.procwatch.close()
        self.audit.close()
        if not self.sandboxes:
            self.volume.close()
        await self.release_layers()
        await self.node_layers.close(sandboxes_left=bool(self.sandboxes))
        if not self.sandboxes:  # per-boot sockets and runtime state: nothing left to find again
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # ---- create -------------------------------------------------------------
    def _new_id(self) -> str:
        return f"{self.name}-{''.join(secrets.choice(ID_ALPHABET) for _ in range(12))}"

    def _resolve_layers(self, args: ContainerArgs | MicroVMArgs | VMArgs) -> list[str]:
        """Digests bottom to top, each checked against its slot's kind. From a cluster's
        catalog (a remote database: three queries a layer) a ref's blobs are kept for
        RESOLVE_TTL_S: a published ref never moves to other blobs, so what that risks is a
        create a moment after the layer was removed elsewhere, as a create racing the removal
        would. Under a burst the lookups were a fifth of the edges' CPU (bench/scale.py)."""
        refs = [args.image, *args.layers]
        digests = []
        now = time.monotonic()
        if len(self._resolved) > 4096:
            self._resolved.clear()
        for i, ref in enumerate(refs):
            fieldname = "image" if i == 0 else f"layers[{i - 1}]"
            try:
                kind = layer_kind(ref)
                kept = None if self.node_layers.catalog_local else self._resolved.get(ref)
                if kept is not None and now - kept[0] < RESOLVE_TTL_S:
                    blobs = kept[1]
                else:
                    blobs = self.layers.get(ref).all_blobs
                    if not self.node_layers.catalog_local:
                        self._resolved[ref] = (now, blobs)
            except NotFound:
                raise NotFound(f"unknown layer {ref!r}", field=fieldname) from None
            except InvalidRequest as e:
                raise InvalidRequest(e.message, field=fieldname) from None
            if (i == 0) != (kind == "base"):
                want = "a base layer" if i == 0 else "a workspace or toolkit layer"
                raise InvalidRequest(f"{fieldname} must be {want}, got {ref!r} ({kind})", field=fieldname)
            digests.extend(blobs)
        return digests

    async def create(self, args: ContainerArgs | MicroVMArgs | VMArgs) -> SandboxInfo:
        return await self._create(args)

    async def branch(self, sandbox_id: str, n: int = 1) -> list[SandboxInfo]:
        """``n`` live branches of a running sandbox (dsec.node.edge.branching)."""
        return await self.brancher.branch(sandbox_id, n)

    async def _create(self, args: ContainerArgs | MicroVMArgs | VMArgs, sandbox_id: str | None = None,
                      extra: list[str] | None = None, origin: SandboxInfo | None = None,
                      restored_from: str | None = None, base: list[str] | None = None,
                      restore: dict[str, str] | None = None, branched_from: str | None = None) -> SandboxInfo:
        """A new sandbox, or (``sandbox_id`` given) one restored here from a checkpoint: the
        ``extra`` blobs stacked over its layers (``base``: their blobs as recorded then), its
        creation time and lifetime those of ``origin``. ``branched_from``: a live branch's
        child, started from ``restore`` (a branch image of that sandbox)."""
        t0 = time.monotonic()
        if base is None:
            base = (self._resolve_layers(args) if self.node_layers.catalog_local else
                    await self.node_layers.store_io("the layer catalog", self._resolve_layers, args))
        digests = base + (extra or [])
        if isinstance(args, ContainerArgs) and args.network_rules is not None:
            self.network.validate(args.network_rules)
        try:
            self._admit(args)
        except AdmissionRejected:
            self.metrics.rejected.inc()
            self.signals.admission_refusals += 1
            raise
        # the edge names its sandboxes (an id is a path on this host); a restored one keeps its id
        sid = sandbox_id or self._new_id()
        if sandbox_id is not None and sandbox_id in self.sandboxes:
            raise SandboxBusy(f"sandbox {sandbox_id} is already on edge {self.name}")
        now = time.time()
        born = origin.created_at if origin else now
        info = SandboxInfo(
            sandbox_id=sid, edge=self.name, backend=Backend(args.backend), state=SandboxState.creating,
            image=args.image, layers=args.layers, created_at=born, last_active_at=now, labels=args.labels,
            job=args.job, memory_limit_mb=args.memory_limit_mb, cpu_cores_limit=args.cpu_cores_limit,
            disk_limit_mb=args.disk_limit_mb if isinstance(args, ContainerArgs) else None,
            expires_at=born + args.max_lifetime_s if args.max_lifetime_s else None,
            checkpoint_every_s=args.checkpoint_every_s,
            restored_from=restored_from, branched_from=branched_from)
        sb = Sandbox(Record(info, args, 0, digests), os.path.join(self.sandbox_root, sid))
        sb.keep_checkpoints = sandbox_id is not None  # a failed restore leaves the checkpoint for the next try
        self.sandboxes[sid] = sb  # reserves its share before the first await
        self.held.update(sb)
        sb.creator = asyncio.current_task()
        try:
            # on record before anything is built: an edge killed mid-create finds it on
            # restart and tears down what was built (it ends failed, with the reason)
            self.state.put(sb.rec)
            await failpoint("create.recorded")
            backend = self.backend_of(sb)
            with tracing.span("backend.prepare", backend=args.backend, sandbox_id=sid, layers=len(digests)):
                for kind, message in await backend.prepare(sb, digests, restore):
                    self.on_event(sid, kind, message)
            with tracing.span("backend.start", backend=args.backend, sandbox_id=sid):
                await self._start(sb, backend, digests)
            await failpoint("create.attached")
            self._still_wanted(sb)
            info.state = SandboxState.running
            if isinstance(args, ContainerArgs) and args.protected_paths:
                await self.protect(sid, args.protected_paths)
            sb.keep_checkpoints = False
            self.state.put(sb.rec)
        except BaseException as e:
            sb.creator = None
            if not sb.stopping:  # (a create its caller stopped is no failure of this edge's)
                self.signals.create_failures += 1
            if sb.teardown is None:  # else a stop is already tearing it down (and waits for us)
                await self._teardown(sb, SandboxState.failed, f"create failed: {explain(e)}")
            task = asyncio.current_task()
            if isinstance(e, asyncio.CancelledError) and sb.stopping and task and task.cancelling() == 1:
                task.uncancel()  # the stop's own cancel: the caller hears why, the request goes on
                raise SandboxNotRunning(f"sandbox {sid} was stopped while it was being created") from None
            if out_of_space(e):
                raise InsufficientStorage(f"edge {self.name} has no space left in its data dir: {explain(e)}",
                                          sandbox_id=sid, operation="create") from e
            raise
        finally:
            sb.creator = None
        self.metrics.created.inc()
        self.metrics.create_seconds.observe(time.monotonic() - t0)
        self.signals.created(time.monotonic() - t0)
        self._still_wanted(sb)
        self.on_event(sid, "created", f"{args.image} {args.layers}")
        return info

    async def _start(self, sb: Sandbox, backend: SandboxRuntime, digests: list[str]) -> None:
        """Launch it, record its init, wire its network, and bind its agent over the
        channel its backend connects."""
        launched = await backend.launch(sb, digests)
        sb.rec.init_pid = launched.init_pid
        if launched.vm is not None:
            sb.rec.info.vm = launched.vm
        if launched.init_pid:
            self.state.put(sb.rec)  # its init pid: a restart finds what to kill
            await failpoint("create.started")
        args = sb.rec.args
        if isinstance(args, ContainerArgs) and args.network_rules is not None:
            await self.wire_network(sb, args.network_rules)
        with tracing.span("agent.attach", sandbox_id=sb.id):
            await self.bind_agent(sb, await backend.connect(sb))

    def _still_wanted(self, sb: Sandbox) -> None:
        if sb.stopping:
            raise SandboxNotRunning(f"sandbox {sb.id} was stopped while it was being created")

    async def wire_network(self, sb: Sandbox, rules: dict[str, bool]) -> NetworkInfo:
        """Give a container its link (NetworkManager.wire), in the namespaces of its init."""
        pid = self.backend_of(sb).host_pid(sb)
        if pid is None:
            raise InvalidRequest(f"sandbox {sb.id} runs no host process to link (network rules apply to "
                                 "containers)", field="sandbox_id")
        info = sb.rec.info.network = await self.network.wire(sb.id, pid, rules)
        return info

    async def set_network_rules(self, sandbox_id: str, changes: dict[str, bool]) -> NetworkInfo:
        """Change a container's egress rules while it runs (wiring its link on first use)."""
        sb, _ = await self._ready(sandbox_id)
        if not isinstance(sb.rec.args, ContainerArgs):
            raise InvalidRequest("VM sandboxes have no network interface; network rules apply to containers",
                                 field="sandbox_id")
        async with sb.lock:
            if self.network.has(sb.id):
                info = sb.rec.info.network = await self.network.update(sb.id, changes)
            else:
                self.network.validate(changes)
                info = await self.wire_network(sb, changes)
            self.state.put(sb.rec)
        self.on_event(sb.id, "network", "allowed: " + (", ".join(sorted(info.rules)) or "nothing"))
        return info

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
            why = self.backend_of(sb).agent_lost(sb)
            await self._teardown(sb, SandboxState.failed, why)

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        """VM: guest RAM and devices to a snapshot file, QEMU ends. Container: frozen
        and its memory pushed out to swap."""
        live = self._get_live(sandbox_id)
        if live is not None and live.rec.info.state == SandboxState.paused:
            return live.rec.info
        sb, _ = self._running(sandbox_id)
        async with sb.lock:
            info = sb.rec.info
            if info.state == SandboxState.paused:
                return info
            if sb.ops:
                raise SandboxBusy(f"sandbox {sandbox_id} has {sb.ops} request(s) in flight; pause after they end")
            t0 = time.monotonic()
            cg = self._cgroup(sb)
            before = memory.cgroup_memory(cg)
            msg = await self.backend_of(sb).pause(sb)
            after = memory.cgroup_memory(cg)
            info.pause = PauseInfo(memory_before_bytes=before.get("total", 0), memory_after_bytes=after.get("total", 0),
                                   swap_bytes=after.get("swap", 0), pause_s=time.monotonic() - t0)
            info.state = SandboxState.paused
            info.paused_at = time.time()
            self.held.update(sb)
            self.state.put(sb.rec)
        self.on_event(sb.id, "paused", f"{msg}; memory {info.pause.memory_before_bytes >> 20} -> "
                      f"{info.pause.memory_after_bytes >> 20} MiB in {info.pause.pause_s * 1000:.0f} ms")
        return info

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        sb = self._get_live(sandbox_id)
        if sb is None:
            return await self.get(sandbox_id)
        await self._resume(sb)
        return sb.rec.info

    async def _resume(self, sb: Sandbox) -> None:
        async with sb.lock:
            info = sb.rec.info
            if info.state != SandboxState.paused or sb.stopping:
                return
            t0 = time.monotonic()
            try:
                msg, link = await self.backend_of(sb).resume(sb)
            except SandboxLost as e:
                self.on_event(sb.id, "snapshot_error", e.message)
                asyncio.create_task(self._teardown(sb, SandboxState.failed, f"resume failed: {e.message}"))
                raise
            if link is not None:  # paused across an edge restart: its agent bound now that it runs
                await self.bind_agent(sb, link)
            if info.pause:
                info.pause.resume_s = time.monotonic() - t0
            info.state = SandboxState.running
            info.paused_at = None
            info.last_active_at = time.time()
            self.held.update(sb)
            self.state.put(sb.rec)
        self.on_event(sb.id, "resumed", msg)

    async def _ready(self, sandbox_id: str) -> tuple[Sandbox, Aether]:
        """The sandbox and its agent, resumed first if it is paused (any request resumes)."""
        sb = self._get_live(sandbox_id)
        if sb is not None and sb.rec.info.state == SandboxState.paused:
            await self._resume(sb)
        return self._running(sandbox_id)

    def _display(self, sandbox_id: str) -> Display:
        sb, _ = self._running(sandbox_id)
        display = self.backend_of(sb).display(sb)
        if display is None:
            raise InvalidRequest(f"sandbox {sandbox_id} has no display (a VMArgs sandbox with display=True has)",
                                 field="sandbox_id")
        return display

    async def screenshot(self, sandbox_id: str) -> bytes:
        await self._ready(sandbox_id)
        return await self._display(sandbox_id).screenshot()

    async def send_keys(self, sandbox_id: str, keys: str) -> None:
        await self._ready(sandbox_id)
        await self._display(sandbox_id).send_keys(keys)

    async def click(self, sandbox_id: str, x: int, y: int, button: str = "left") -> None:
        await self._ready(sandbox_id)
        await self._display(sandbox_id).click(x, y, button)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        self._get_live(sandbox_id)  # validates the id and its edge
        sb = self.sandboxes.get(sandbox_id)
        return sb.rec.info if sb else self._tombstone(sandbox_id)

    async def list_sandboxes(self, job: str | None = None, labels: dict[str, str] | None = None,
                             usage: bool = False) -> list[SandboxInfo]:
        out = []
        for sb in list(self.sandboxes.values()):
            info = sb.rec.info
            if job is not None and info.job != job:
                continue
            if labels and any(info.labels.get(k) != v for k, v in labels.items()):
                continue
            if usage:
                info = info.model_copy(update={"usage": await asyncio.to_thread(self._usage, sb)})
            out.append(info)
        return out

    # ---- requests into the sandbox -------------------------------------------
    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await self._exec(sandbox_id, req, None)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        with self.streams.hold(sandbox_id, "streamed command"):
            async for ev in exec_events(lambda on_data: self._exec(sandbox_id, req, on_data)):
                yield ev

    async def _exec(self, sandbox_id: str, req: ExecRequest, on_data: OnData | None) -> ExecResult:
        with tracing.span("edge.exec", sandbox_id=sandbox_id, session=req.session, keyed=req.key is not None):
            if req.key is not None:
                return await self._keyed_exec(sandbox_id, req, on_data)
            sb, agent = await self._ready(sandbox_id)
            return await self._run_exec(sb, agent, req, on_data)

    async def _run_exec(self, sb: Sandbox, agent: Aether, req: ExecRequest, on_data: OnData | None) -> ExecResult:
        sandbox_id = sb.id
        cmd = req.cmd if req.cmd is not None else " ".join(req.argv or [])
        self.audit.record(sb.id, "exec", f"[{req.session}] {cmd}" if req.session else cmd)
        self.detectors.command(sb.id, cmd)
        sb.ops += 1
        self.signals.execs += 1
        try:
            res = await agent.exec(req, on_data)
            if res.stdout_truncated or res.stderr_truncated:
                self.on_event(sb.id, "output_truncated", f"output past {req.max_output_bytes} bytes was dropped "
                              f"(the command went on{', until its timeout' if res.timed_out else ''})")
            self.metrics.exec_seconds.labels(self.name, "session" if req.session else "exec").observe(
                res.duration_ms / 1000)
            return res
        except DeadlineExceeded:  # the sandbox's init did not answer in time
            self.signals.agent_deadline_misses += 1
            self.signals.exec_failures += 1
            raise
        except ChannelLost:
            if sb.stopping:  # stopped while the command ran
                raise SandboxNotRunning(f"sandbox {sandbox_id} was stopped while the command ran") from None
            self.signals.exec_failures += 1
            raise
        finally:
            sb.ops -= 1

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        check_path(path)
        _, agent = await self._ready(sandbox_id)
        return await agent.files.read_file(path, self.cfg.max_file_bytes)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644,
                         owner: Owner | None = None) -> None:
        if len(data) > self.cfg.max_file_bytes:
            raise PayloadTooLarge(f"file body of {len(data)} bytes exceeds the {self.cfg.max_file_bytes}-byte limit",
                                  field="body")
        check_path(path)
        sb, agent = await self._ready(sandbox_id)
        self.audit.record(sb.id, "file_write", f"{path} ({len(data)} bytes, mode {mode:o})")
        await agent.files.write_file(path, data, mode, owner)

    async def make_dir(self, sandbox_id: str, path: str, owner: Owner | None = None) -> bool:
        """Make ``path`` and its parents; False if it already existed."""
        check_path(path)
        sb, agent = await self._ready(sandbox_id)
        if await agent.files.exists(path):
            return False
        self.audit.record(sb.id, "file_write", f"{path} (directory)")
        await agent.files.mkdirs(path, owner)
        return True

    async def set_xattrs(self, sandbox_id: str, path: str, prefix: str, values: dict[str, str]) -> None:
        """The user.* extended attributes under ``prefix`` on ``path`` become ``values``."""
        check_path(path)
        sb, agent = await self._ready(sandbox_id)
        self.audit.record(sb.id, "file_write", f"{path} (xattrs {prefix}*)")
        await agent.files.set_xattrs(path, prefix, values)

    async def move(self, sandbox_id: str, source: str, destination: str) -> FileStat:
        check_path(source, "source")
        check_path(destination, "destination")
        sb, agent = await self._ready(sandbox_id)
        self.audit.record(sb.id, "file_write", f"{source} moved to {destination}")
        await agent.files.move(source, destination)
        return await agent.files.stat(destination)

    async def set_deadline(self, sandbox_id: str, seconds: int) -> SandboxInfo:
        """End the sandbox ``seconds`` from now (its maximum lifetime, moved)."""
        sb = self._get_live(sandbox_id)
        if sb is None:
            self._tombstone(sandbox_id)
            raise SandboxNotRunning(f"sandbox {sandbox_id} has ended", field="sandbox_id")
        lifetime = int(time.time() - sb.rec.info.created_at) + max(1, seconds)
        sb.rec.args = sb.rec.args.model_copy(update={"max_lifetime_s": lifetime})
        sb.rec.info.expires_at = sb.rec.info.created_at + lifetime
        self.state.put(sb.rec)
        return sb.rec.info

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileStat]:
        check_path(path)
        _, agent = await self._ready(sandbox_id)
        return await agent.files.list_dir(path)

    async def stat(self, sandbox_id: str, path: str) -> FileStat:
        check_path(path)
        _, agent = await self._ready(sandbox_id)
        return await agent.files.stat(path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        check_path(path)
        sb, agent = await self._ready(sandbox_id)
        self.audit.record(sb.id, "file_remove", f"{path}{' (recursive)' if recursive else ''}")
        await agent.files.remove(path, recursive)

    async def http(self, sandbox_id: str, port: int, method: str, path: str,
                   headers: list[tuple[str, str]], body: bytes, timeout: float = 60.0) -> HttpResponse:
        sb, agent = await self._ready(sandbox_id)
        self.audit.record(sb.id, "http", f"{method} :{port}{path[:512]}")
        return await agent.http_request(port, method, path, headers, body, timeout)

    # ---- FnCall -------------------------------------------------------------
    async def fncall(self, args: FnCallArgs) -> FnCallResult:
        return await self.fncall_service.call(args)

    async def fncall_languages(self, image: str) -> list[str]:
        return await self.fncall_service.languages(image, self.layers.has)

    async def spawn_worker(self, sandbox_id: str, argv: list[str], files: dict[str, bytes]
                           ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Put ``files`` (root-owned, read-only to others) into a sandbox and start ``argv``
        as root with a socketpair for stdin and stdout: the FnCall pool's worker channel."""
        _, agent = await self._ready(sandbox_id)
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
