"""Creating a sandbox on the edge: its layers resolved, admission, its record first, then
its backend's prepare and launch, its network and its agent, each step traced; a create
stopped or failed under way is torn down (dsec.node.edge.teardown). Also a container's
network rules, which a create may set and a request may change."""

from __future__ import annotations

import asyncio
import os
import time
import weakref

from dsec.node.backends.api import SandboxRuntime
from dsec.node.edge.auditing import Auditing
from dsec.node.edge.capacity import Capacity
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.lifecycle import Lifecycle, Op, State, state_of
from dsec.node.edge.metrics import EdgeMetrics
from dsec.node.edge.sandbox import Sandbox, explain, out_of_space
from dsec.node.edge.state import Record
from dsec.node.edge.table import SandboxTable
from dsec.node.edge.teardown import Teardown
from dsec.node.layers.store import LayerStore, layer_kind
from dsec.shared import tracing
from dsec.shared.errors import (
    AdmissionRejected,
    InsufficientStorage,
    InvalidRequest,
    NotFound,
    SandboxBusy,
    SandboxNotRunning,
)
from dsec.shared.faults import failpoint
from dsec.shared.wire.models import (
    Backend,
    ContainerArgs,
    MicroVMArgs,
    NetworkInfo,
    SandboxInfo,
    SandboxState,
    VMArgs,
)

RESOLVE_TTL_S = 2.0  # a ref's blobs kept this long when the catalog is a cluster's
# ... for every edge of this process over the same store (one on a node; a hollow fleet's 160
# share it: each alone saw too few creates to hit its own within 2 s, bench/scale.py)
_RESOLVED: weakref.WeakKeyDictionary[LayerStore, dict[str, tuple[float, list[str]]]] = weakref.WeakKeyDictionary()


class Creation:
    """create (and :meth:`create_sandbox`, its internal form), and network rules."""

    def __init__(self, node: EdgeNode, table: SandboxTable, lifecycle: Lifecycle, capacity: Capacity,
                 auditing: Auditing, teardown: Teardown, metrics: EdgeMetrics) -> None:
        self.node = node
        self.table = table
        self.lifecycle = lifecycle
        self.capacity = capacity
        self.auditing = auditing
        self.teardown = teardown
        self.metrics = metrics
        self._resolved = _RESOLVED.setdefault(node.layers, {})  # ref -> (when, its blobs)

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
                kept = None if self.node.node_layers.catalog_local else self._resolved.get(ref)
                if kept is not None and now - kept[0] < RESOLVE_TTL_S:
                    blobs = kept[1]
                else:
                    blobs = self.node.layers.get(ref).all_blobs
                    if not self.node.node_layers.catalog_local:
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
        return await self.create_sandbox(args)

    async def create_sandbox(self, args: ContainerArgs | MicroVMArgs | VMArgs, sandbox_id: str | None = None,
                             extra: list[str] | None = None, origin: SandboxInfo | None = None,
                             restored_from: str | None = None, base: list[str] | None = None,
                             restore: dict[str, str] | None = None, branched_from: str | None = None
                             ) -> SandboxInfo:
        """A new sandbox, or (``sandbox_id`` given) one restored here from a checkpoint: the
        ``extra`` blobs stacked over its layers (``base``: their blobs as recorded then), its
        creation time and lifetime those of ``origin``; ``restore``: files its backend's
        launch starts from (a VM's memory and disk, a branch image); ``branched_from``: a live
        branch's child, started from ``restore`` (dsec.node.edge.branching). The internal entry
        point of every create on this edge (a restore's, a branch's)."""
        t0 = time.monotonic()
        if base is None:
            base = (self._resolve_layers(args) if self.node.node_layers.catalog_local else
                    await self.node.node_layers.store_io("the layer catalog", self._resolve_layers, args))
        digests = base + (extra or [])
        if isinstance(args, ContainerArgs) and args.network_rules is not None:
            self.node.network.validate(args.network_rules)
        try:
            self.capacity.admit(args)
        except AdmissionRejected:
            self.metrics.rejected.inc()
            self.node.signals.admission_refusals += 1
            raise
        # the edge names its sandboxes (an id is a path on this host); a restored one keeps its id
        sid = sandbox_id or self.table.new_id()
        if sandbox_id is not None and sandbox_id in self.table.sandboxes:
            raise SandboxBusy(f"sandbox {sandbox_id} is already on edge {self.node.name}")
        now = time.time()
        born = origin.created_at if origin else now
        info = SandboxInfo(
            sandbox_id=sid, edge=self.node.name, backend=Backend(args.backend), state=SandboxState.creating,
            image=args.image, layers=args.layers, created_at=born, last_active_at=now, labels=args.labels,
            job=args.job, memory_limit_mb=args.memory_limit_mb, cpu_cores_limit=args.cpu_cores_limit,
            disk_limit_mb=args.disk_limit_mb if isinstance(args, ContainerArgs) else None,
            expires_at=born + args.max_lifetime_s if args.max_lifetime_s else None,
            checkpoint_every_s=args.checkpoint_every_s,
            restored_from=restored_from, branched_from=branched_from)
        sb = Sandbox(Record(info, args, 0, digests), os.path.join(self.node.sandbox_root, sid))
        sb.keep_checkpoints = sandbox_id is not None  # a failed restore leaves the checkpoint for the next try
        self.table.sandboxes[sid] = sb  # reserves its share before the first await
        self.table.held.update(sb)
        sb.creator = asyncio.current_task()
        try:
            # on record before anything is built: an edge killed mid-create finds it on
            # restart and tears down what was built (it ends failed, with the reason)
            self.table.state.put(sb.rec)
            await failpoint("create.recorded")
            backend = self.node.backend_of(sb)
            with tracing.span("backend.prepare", backend=args.backend, sandbox_id=sid, layers=len(digests)):
                for kind, message in await backend.prepare(sb, digests, restore):
                    self.node.on_event(sid, kind, message)
            with tracing.span("backend.start", backend=args.backend, sandbox_id=sid):
                await self._start(sb, backend, digests)
            await failpoint("create.attached")
            self._still_wanted(sb)
            info.state = SandboxState.running
            if isinstance(args, ContainerArgs) and args.protected_paths:
                await self.auditing.protect(sid, args.protected_paths)
            sb.keep_checkpoints = False
            self.table.state.put(sb.rec)
        except BaseException as e:
            sb.creator = None
            if not sb.stopping:  # (a create its caller stopped is no failure of this edge's)
                self.node.signals.create_failures += 1
            if sb.teardown is None:  # else a stop is already tearing it down (and waits for us)
                await self.teardown.teardown(sb, SandboxState.failed, f"create failed: {explain(e)}")
            task = asyncio.current_task()
            if isinstance(e, asyncio.CancelledError) and sb.stopping and task and task.cancelling() == 1:
                task.uncancel()  # the stop's own cancel: the caller hears why, the request goes on
                raise SandboxNotRunning(f"sandbox {sid} was stopped while it was being created") from None
            if out_of_space(e):
                raise InsufficientStorage(f"edge {self.node.name} has no space left in its data dir: {explain(e)}",
                                          sandbox_id=sid, operation="create") from e
            raise
        finally:
            sb.creator = None
        self.metrics.created.inc()
        self.metrics.create_seconds.observe(time.monotonic() - t0)
        self.node.signals.created(time.monotonic() - t0)
        self._still_wanted(sb)
        self.node.on_event(sid, "created", f"{args.image} {args.layers}")
        return info

    async def _start(self, sb: Sandbox, backend: SandboxRuntime, digests: list[str]) -> None:
        """Launch it, record its init, wire its network, and bind its agent over the
        channel its backend connects."""
        launched = await backend.launch(sb, digests)
        sb.rec.init_pid = launched.init_pid
        if launched.vm is not None:
            sb.rec.info.vm = launched.vm
        if launched.init_pid:
            self.table.state.put(sb.rec)  # its init pid: a restart finds what to kill
            await failpoint("create.started")
        args = sb.rec.args
        if isinstance(args, ContainerArgs) and args.network_rules is not None:
            await self.wire_network(sb, args.network_rules)
        with tracing.span("agent.attach", sandbox_id=sb.id):
            await self.lifecycle.bind_agent(sb, await backend.connect(sb))

    def _still_wanted(self, sb: Sandbox) -> None:
        if state_of(sb) == State.STOPPING:
            raise SandboxNotRunning(f"sandbox {sb.id} was stopped while it was being created")

    async def wire_network(self, sb: Sandbox, rules: dict[str, bool]) -> NetworkInfo:
        """Give a container its link (NetworkManager.wire), in the namespaces of its init."""
        pid = self.node.backend_of(sb).host_pid(sb)
        if pid is None:
            raise InvalidRequest(f"sandbox {sb.id} runs no host process to link (network rules apply to "
                                 "containers)", field="sandbox_id")
        info = sb.rec.info.network = await self.node.network.wire(sb.id, pid, rules)
        return info

    async def set_network_rules(self, sandbox_id: str, changes: dict[str, bool]) -> NetworkInfo:
        """Change a container's egress rules while it runs (wiring its link on first use)."""
        sb, _ = await self.lifecycle.ready(Op.SET_NETWORK_RULES, sandbox_id)
        if not isinstance(sb.rec.args, ContainerArgs):
            raise InvalidRequest("VM sandboxes have no network interface; network rules apply to containers",
                                 field="sandbox_id")
        async with sb.lock:
            if self.node.network.has(sb.id):
                info = sb.rec.info.network = await self.node.network.update(sb.id, changes)
            else:
                self.node.network.validate(changes)
                info = await self.wire_network(sb, changes)
            self.table.state.put(sb.rec)
        self.node.on_event(sb.id, "network", "allowed: " + (", ".join(sorted(info.rules)) or "nothing"))
        return info

