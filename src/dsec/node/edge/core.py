"""The edge's shared state and lookups (see EdgeCore)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time

from dsec.node.agent.aether import Aether
from dsec.node.agent.native import ensure_init_binary
from dsec.node.backends.api import InitLink, SandboxRuntime
from dsec.node.backends.container.sandboxes import ContainerSandboxes
from dsec.node.backends.fncall.pool import FnCallService
from dsec.node.backends.hollow.runtime import HollowSandboxes
from dsec.node.backends.vm.sandboxes import VMSandboxes
from dsec.node.edge.auditlog import AuditLog, Detectors
from dsec.node.edge.cmdlog import CommandLog
from dsec.node.edge.config import EdgeConfig
from dsec.node.edge.hostload import HostLoadReader
from dsec.node.edge.interactive import InteractiveOps, StreamSlots, Watchers
from dsec.node.edge.metrics import EdgeMetrics
from dsec.node.edge.network import NetworkManager
from dsec.node.edge.procwatch import ProcWatch
from dsec.node.edge.ratelimit import Buckets
from dsec.node.edge.reservations import Reservations
from dsec.node.edge.sandbox import (
    Sandbox,
    mem_total_mb,
)
from dsec.node.edge.signals import Signals
from dsec.node.edge.state import EdgeState
from dsec.node.host import memory
from dsec.node.host.volume import SandboxVolume
from dsec.node.layers.store import LayerStore
from dsec.node.storage.node import NodeLayers
from dsec.shared.errors import (
    InvalidRequest,
    NotFound,
    SandboxNotRunning,
)
from dsec.shared.wire.models import (
    ContainerArgs,
    MicroVMArgs,
    NetworkInfo,
    SandboxEvent,
    SandboxInfo,
    SandboxState,
    SandboxUsage,
    StorageStats,
    VMArgs,
    parse_sandbox_id,
)

log = logging.getLogger("dsec.edge")


DENIALS_PER_S, DENIALS_BURST = 10.0, 100.0  # denied connections kept (events, audit, log) per sandbox
ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


# events that also go to the audit log (the rest are lifecycle noise there)
AUDITED_EVENTS = frozenset({"egress_denied", "oom_killed", "disk_quota", "network", "created", "stopped", "failed",
                            "paused", "resumed"})



class EdgeCore(InteractiveOps):
    """The edge's state (its sandboxes, records, runtimes, network, audit) and the
    lookups every part of it uses; the parts (capacity, teardown, recovery, sweepers,
    snapshots, auditing) are mixins over it, and :class:`~dsec.node.edge.service.Edge` is
    their facade."""

    def __init__(self, cfg: EdgeConfig, layers: LayerStore) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.layers = layers
        root = self.root = os.path.join(cfg.data_dir, "edges", cfg.name)
        os.makedirs(root, exist_ok=True)
        self.volume = SandboxVolume(root, 0 if cfg.hollow else cfg.sandbox_volume_gb)
        self.volume.setup()
        self.sandbox_root = os.path.join(self.volume.mnt if self.volume.available else root, "sandboxes")
        os.makedirs(self.sandbox_root, exist_ok=True)
        # sockets and crun state are per boot: on tmpfs, with a path short enough for AF_UNIX
        tag = hashlib.sha1(os.path.abspath(cfg.data_dir).encode()).hexdigest()[:8]
        self.run_dir = f"/run/dsec/{tag}-{cfg.name}"
        os.makedirs(os.path.join(self.run_dir, "s"), exist_ok=True)
        self.state = EdgeState(os.path.join(root, "state.db"))
        self.cmdlog = CommandLog(os.path.join(root, "commands.db"))  # keyed commands (node/edge/keyed.py)
        # (a hollow edge starts no init: dsec.node.backends.hollow)
        self.init_binary = "" if cfg.hollow else ensure_init_binary(os.path.join(cfg.data_dir, "bin", "dsec-init"))
        self.sandboxes: dict[str, Sandbox] = {}
        self.held = Reservations()  # what they reserve, summed as they change (node/edge/reservations.py)
        self.signals = Signals()  # what the fleet's health detector reads (node/edge/signals.py)
        self.host_load = HostLoadReader()
        self.watchers = Watchers()  # polled directory watchers clients hold here
        self.streams = StreamSlots()  # open streams per sandbox, bounded
        self.node_layers = NodeLayers(layers, cfg.data_dir, self.run_dir, cfg.fetch_mode, cfg.chunk_cache_bytes,
                                      cfg.fetch_timeout_s, on_error=self._storage_error)
        self.layer_mnt = self.node_layers.mnt_dir
        self.fncall_service = FnCallService(self, os.cpu_count() or 1)
        # the backends: how a container or a VM exists on this node (node/backends/api.py)
        # (built with what they need; they never call back into the edge)
        self.containers = ContainerSandboxes(self.node_layers, self.volume, self.run_dir, f"dsec-{tag}",
                                             self.init_binary)
        self.vm_sandboxes = VMSandboxes(self.node_layers, cfg.data_dir, self.run_dir, f"dsec-{tag}")
        self.runtime, self.vms = self.containers.runtime, self.vm_sandboxes.vms  # node-level questions
        self.hollow = HollowSandboxes(f"/sys/fs/cgroup/dsec-hollow-{tag}") if cfg.hollow else None
        self.audit = AuditLog(os.path.join(root, "audit.db"))
        self.detectors = Detectors(self._flag)
        self.procwatch = ProcWatch(f"dsec-{tag}", self._on_exec)
        self.denials = Buckets(DENIALS_PER_S, DENIALS_BURST)
        self.network = NetworkManager(root, self.run_dir, cfg.egress_services, cfg.sandbox_subnet, self.on_event)
        self.network_status = "not started"
        core = memory.has_core_scheduling()
        self.density: dict[str, object] = {
            "disk_quota": self.volume.status,
            "swap": "not set up yet", "sched_idle": True, "core_scheduling": core,
            "qos": "best_effort: SCHED_IDLE + minimal CPU shares; latency_sensitive: normal" + (
                ", core-scheduled" if core else "; no core scheduling in this kernel (CONFIG_SCHED_CORE), "
                "so latency-sensitive sandboxes are not isolated from sibling hyperthreads")}
        self._ttl_task: asyncio.Task[None] | None = None
        self._quota_checked = 0.0
        self._audit_swept = 0.0
        self._teardowns: set[asyncio.Task[None]] = set()
        self.cpus = cfg.hollow_cpus if cfg.hollow else os.cpu_count() or 1
        self.memory_mb = cfg.hollow_memory_mb if cfg.hollow else mem_total_mb()
        self.metrics = EdgeMetrics(self.name, lambda: [
            (sb.id, sb.rec.info.state.value, sb.rec.info.job, self._usage(sb))
            for sb in list(self.sandboxes.values()) if not sb.stopping], self._storage_stats)

    def on_event(self, sandbox_id: str, kind: str, message: str) -> None:
        """Something a sandbox's owner should know: kept with the sandbox (``GET .../events``) and logged.
        Denied connections come at the sandbox's pace (a flood of DNS queries): past
        DENIALS_PER_S, burst DENIALS_BURST, they are counted and said in the next one kept;
        the burst detector still sees every one."""
        if kind == "egress_denied":
            self.detectors.denial(sandbox_id)
            ok, dropped = self.denials.admit(sandbox_id)
            if not ok:
                return
            if dropped:
                message += f" (and {dropped} more denials not recorded: over {DENIALS_PER_S:g}/s)"
        log.info("%s %s: %s", sandbox_id, kind, message)
        if sb := self.sandboxes.get(sandbox_id):
            sb.events.append(SandboxEvent(t=time.time(), kind=kind, message=message))
        if kind in AUDITED_EVENTS:
            self.audit.record(sandbox_id, kind, message)

    def _flag(self, sandbox_id: str, detector: str, message: str) -> None:
        self.audit.record(sandbox_id, "flag", message, flag=detector)
        self.on_event(sandbox_id, "flagged", f"{detector}: {message}")

    def _on_exec(self, sandbox_id: str, pid: int, cmdline: str) -> None:
        if sandbox_id in self.sandboxes:
            self.audit.record(sandbox_id, "process", f"[{pid}] {cmdline}" if pid else cmdline)
            self.detectors.command(sandbox_id, cmdline)

    def _storage_error(self, data: str, message: str) -> None:
        """A read from the shared store failed (``data``: the blob or what was read)."""
        self.signals.store_errors += 1
        blobs = self.node_layers.data_blob
        for sb in list(self.sandboxes.values()):
            if any(blobs.get(d) == data for d in sb.rec.digests):
                self.on_event(sb.id, "storage_error", message)

    def _cgroup(self, sb: Sandbox) -> str:
        return self.backend_of(sb).cgroup_path(sb.id)

    def backend_of(self, sb: Sandbox) -> SandboxRuntime:
        if self.hollow is not None:  # every sandbox of a hollow edge, whatever it asked for
            return self.hollow
        return self.containers if sb.rec.args.backend == "container" else self.vm_sandboxes

    def _tombstone(self, sandbox_id: str) -> SandboxInfo:
        rec = self.state.get(sandbox_id)
        if rec is None:
            raise NotFound(f"no sandbox {sandbox_id!r} on edge {self.name}", field="sandbox_id")
        return rec.info

    def _get_live(self, sandbox_id: str) -> Sandbox | None:
        try:
            home = parse_sandbox_id(sandbox_id)
        except ValueError as e:
            raise InvalidRequest(str(e), field="sandbox_id") from None
        sb = self.sandboxes.get(sandbox_id)
        # an id names the edge that made it; a sandbox restored here from another keeps its id
        if home != self.name and sb is None and self.state.get(sandbox_id) is None:
            raise NotFound(f"sandbox {sandbox_id!r} does not live on edge {self.name}", field="sandbox_id")
        if sb is None or sb.stopping:
            return None
        return sb

    def _running(self, sandbox_id: str) -> tuple[Sandbox, Aether]:
        sb = self._get_live(sandbox_id)
        if sb is None or sb.agent is None:
            current = self.sandboxes.get(sandbox_id)
            info = current.rec.info if current else self._tombstone(sandbox_id)
            raise SandboxNotRunning(f"sandbox {sandbox_id} is {info.state.value}"
                                    + (f" ({info.error})" if info.error else ""))
        sb.rec.info.last_active_at = time.time()
        sb.dirty = True
        return sb, sb.agent

    def _audit(self, sandbox_id: str, kind: str, detail: str) -> None:
        self.audit.record(sandbox_id, kind, detail)

    async def touch(self, sandbox_id: str) -> None:
        sb = self.sandboxes.get(sandbox_id)
        if sb:
            sb.rec.info.last_active_at = time.time()
            sb.dirty = True

    # ---- provided by the parts; the facade's MRO finds the real ones -----------------
    async def create(self, args: ContainerArgs | MicroVMArgs | VMArgs) -> SandboxInfo:
        raise NotImplementedError

    async def stop(self, sandbox_id: str) -> SandboxInfo:
        raise NotImplementedError

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        raise NotImplementedError

    async def spawn_worker(self, sandbox_id: str, argv: list[str], files: dict[str, bytes]
                           ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        raise NotImplementedError

    async def _teardown(self, sb: Sandbox, final: SandboxState, reason: str, record: bool = True) -> None:
        raise NotImplementedError

    async def bind_agent(self, sb: Sandbox, link: InitLink) -> None:
        raise NotImplementedError

    async def wire_network(self, sb: Sandbox, rules: dict[str, bool]) -> NetworkInfo:
        raise NotImplementedError

    async def _save_access_lists(self, sb: Sandbox, forget: bool = False) -> dict[str, int]:
        raise NotImplementedError

    async def _run_detectors(self, sb: Sandbox) -> None:
        raise NotImplementedError

    def _usage(self, sb: Sandbox, disk_max_age: float = 30.0) -> SandboxUsage:
        raise NotImplementedError

    def _storage_stats(self) -> StorageStats:
        raise NotImplementedError

    def _forget_checkpoints(self, sb: Sandbox, keep: bool) -> None:
        raise NotImplementedError

    def _schedule_checkpoint(self, sb: Sandbox, now: float) -> None:
        raise NotImplementedError
