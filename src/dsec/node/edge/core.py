"""The node an edge runs on, as its parts share it: the volume and directories, the
layer mounts, the backends (container, VM, hollow), the network, the audit log and its
detectors, the health signals; the event sink (:meth:`EdgeNode.on_event`) and which
backend runs a sandbox. It holds no sandbox operation: those are the parts' (see
dsec.node.edge.service)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time

from dsec.node.agent.native import ensure_init_binary
from dsec.node.agent.watch import ensure_instances as ensure_inotify_instances
from dsec.node.backends.api import SandboxRuntime
from dsec.node.backends.container.sandboxes import ContainerSandboxes
from dsec.node.backends.hollow.runtime import HollowSandboxes
from dsec.node.backends.vm.sandboxes import VMSandboxes
from dsec.node.edge.auditlog import AuditLog, Detectors
from dsec.node.edge.config import EdgeConfig
from dsec.node.edge.hostload import HostLoadReader
from dsec.node.edge.network import NetworkManager
from dsec.node.edge.procwatch import ProcWatch
from dsec.node.edge.ratelimit import Buckets
from dsec.node.edge.sandbox import Sandbox, mem_total_mb
from dsec.node.edge.signals import Signals
from dsec.node.edge.streams import StreamSlots, Watchers
from dsec.node.edge.table import SandboxTable
from dsec.node.host import linux, memory
from dsec.node.host.volume import SandboxVolume
from dsec.node.layers.store import LayerStore
from dsec.node.storage.node import NodeLayers
from dsec.shared.errors import SandboxError
from dsec.shared.wire.models import SandboxEvent

log = logging.getLogger("dsec.edge")


DENIALS_PER_S, DENIALS_BURST = 10.0, 100.0  # denied connections kept (events, audit, log) per sandbox


# events that also go to the audit log (the rest are lifecycle noise there)
AUDITED_EVENTS = frozenset({"egress_denied", "oom_killed", "disk_quota", "network", "created", "stopped", "failed",
                            "paused", "resumed"})



class EdgeNode:
    """What the edge's parts share of the node (built once, by the edge's constructor)."""

    def __init__(self, cfg: EdgeConfig, layers: LayerStore, table: SandboxTable) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.layers = layers
        self.table = table
        root = self.root = os.path.join(cfg.data_dir, "edges", cfg.name)
        os.makedirs(root, exist_ok=True)
        self.volume = SandboxVolume(root, 0 if cfg.hollow else cfg.sandbox_volume_gb)
        self.volume.setup()
        self.sandbox_root = os.path.join(self.volume.mnt if self.volume.available else root, "sandboxes")
        os.makedirs(self.sandbox_root, exist_ok=True)
        # sockets and crun state are per boot: on tmpfs, with a path short enough for AF_UNIX
        tag = self.tag = hashlib.sha1(os.path.abspath(cfg.data_dir).encode()).hexdigest()[:8]
        self.run_dir = f"/run/dsec/{tag}-{cfg.name}"
        os.makedirs(os.path.join(self.run_dir, "s"), exist_ok=True)
        # (a hollow edge starts no init: dsec.node.backends.hollow)
        self.init_binary = "" if cfg.hollow else ensure_init_binary(os.path.join(cfg.data_dir, "bin", "dsec-init"))
        self.signals = Signals()  # what the fleet's health detector reads (node/edge/signals.py)
        self.host_load = HostLoadReader()
        self.watchers = Watchers()  # polled directory watchers clients hold here
        self.streams = StreamSlots()  # open streams per sandbox, bounded
        self.node_layers = NodeLayers(layers, cfg.data_dir, self.run_dir, cfg.fetch_mode, cfg.chunk_cache_bytes,
                                      cfg.fetch_timeout_s, on_error=self._storage_error)
        self.layer_mnt = self.node_layers.mnt_dir
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
        self.cpus = cfg.hollow_cpus if cfg.hollow else os.cpu_count() or 1
        self.memory_mb = cfg.hollow_memory_mb if cfg.hollow else mem_total_mb()

    async def start(self) -> None:
        """Set the node up for sandboxes: reaping, swap, inotify, layer mounts, process
        events, the network (a hollow edge has none of its own)."""
        if self.hollow is not None:  # no process, mount or link of its own (dsec.node.backends.hollow)
            self.network_status = "hollow edge: no network"
            self.density["hollow"] = "a load instrument: its sandboxes run nothing (docs/scale.md)"
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
        if sb := self.table.sandboxes.get(sandbox_id):
            sb.events.append(SandboxEvent(t=time.time(), kind=kind, message=message))
        if kind in AUDITED_EVENTS:
            self.audit.record(sandbox_id, kind, message)

    def _flag(self, sandbox_id: str, detector: str, message: str) -> None:
        self.audit.record(sandbox_id, "flag", message, flag=detector)
        self.on_event(sandbox_id, "flagged", f"{detector}: {message}")

    def _on_exec(self, sandbox_id: str, pid: int, cmdline: str) -> None:
        if sandbox_id in self.table.sandboxes:
            self.audit.record(sandbox_id, "process", f"[{pid}] {cmdline}" if pid else cmdline)
            self.detectors.command(sandbox_id, cmdline)

    def _storage_error(self, data: str, message: str) -> None:
        """A read from the shared store failed (``data``: the blob or what was read)."""
        self.signals.store_errors += 1
        blobs = self.node_layers.data_blob
        for sb in list(self.table.sandboxes.values()):
            if any(blobs.get(d) == data for d in sb.rec.digests):
                self.on_event(sb.id, "storage_error", message)

    def cgroup(self, sb: Sandbox) -> str:
        return self.backend_of(sb).cgroup_path(sb.id)

    def backend_of(self, sb: Sandbox) -> SandboxRuntime:
        if self.hollow is not None:  # every sandbox of a hollow edge, whatever it asked for
            return self.hollow
        return self.containers if sb.rec.args.backend == "container" else self.vm_sandboxes
