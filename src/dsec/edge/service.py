"""The edge: one per node. Final admission, storage provisioning, runtime launch,
lifecycle and TTLs, cleanup, and recovery after its own restart.

It implements :class:`dsec.edge.api.EdgeAPI`; the apiserver reaches it only through
that interface (in-process in embedded mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import secrets
import shutil
import socket
import sqlite3
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client import generate_latest
from pydantic import BaseModel

from dsec.agent.aether import (
    DEFAULT_PATH,
    Aether,
    AgentContext,
    InitChannel,
    OnData,
    ProcRootFiles,
    SandboxFiles,
)
from dsec.agent.initclient import ChannelLost, InitClient
from dsec.agent.native import ensure_init_binary
from dsec.agent.watch import ensure_instances as ensure_inotify_instances
from dsec.backends.container.runtime import CrunRuntime, Limits, oci_config
from dsec.backends.fncall.pool import FnCallService
from dsec.backends.vm.channel import GuestChannel, GuestFiles
from dsec.backends.vm.display import click, screenshot, send_keys
from dsec.backends.vm.runtime import SnapshotError, VMInstance, VMRuntime
from dsec.edge import memory
from dsec.edge.audit import AuditLog, Detectors
from dsec.edge.interactive import InteractiveOps, Watchers, exec_events
from dsec.edge.metrics import EdgeMetrics, cgroup_usage
from dsec.edge.network import NetworkManager
from dsec.edge.procwatch import ProcWatch
from dsec.edge.state import EdgeState, Record
from dsec.edge.volume import SandboxVolume
from dsec.errors import (
    AdmissionRejected,
    DsecError,
    InsufficientStorage,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    SandboxBusy,
    SandboxError,
    SandboxNotRunning,
)
from dsec.faults import failpoint
from dsec.host import linux
from dsec.host.cgroup import Cgroup
from dsec.layers.store import ImportOptions, Layer, LayerStore, layer_kind
from dsec.placement.admission import Room, refusal
from dsec.storage.node import FetchMode, NodeLayers
from dsec.wire.models import (
    AuditRecord,
    Backend,
    ContainerArgs,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileStat,
    FnCallArgs,
    FnCallResult,
    HttpResponse,
    LayerFetchStats,
    MicroVMArgs,
    NetworkInfo,
    NodeStats,
    Owner,
    PauseInfo,
    SandboxEvent,
    SandboxInfo,
    SandboxState,
    SandboxUsage,
    StorageStats,
    VMArgs,
    VMInfo,
    parse_sandbox_id,
)

log = logging.getLogger("dsec.edge")
T = TypeVar("T")
# teardown: SIGKILL through the cgroup for at most this long, then every other step
# (agent, network, crun, unmounts) bounded on its own
KILL_TIMEOUT_S = 10.0
STEP_TIMEOUT_S = 10.0
# an edge restart re-adopts sandboxes concurrently, each within this bound
READOPT_TIMEOUT_S = 15.0
READOPT_CONCURRENCY = 32
# build residue that pack_diff leaves out unless told otherwise (regexes on paths
# relative to the sandbox root)
DEFAULT_SCRUB = [
    r"^tmp/.+", r"^var/tmp/.+", r"^root/\.(bash|python|sh|ash)_history$", r"^root/\.(lesshst|viminfo|wget-hsts)$",
    r"^root/\.cache/.+", r"^var/cache/apt/.+", r"^var/lib/apt/lists/.+", r"^var/log/.+",
]


def scrub_regexes(paths: list[str], defaults: bool) -> list[str]:
    """Regexes for mkfs.erofs --exclude-regex: the defaults plus each absolute path
    given (the path itself and everything below it)."""
    import re

    out = list(DEFAULT_SCRUB) if defaults else []
    for p in paths:
        if not p.startswith("/") or p == "/":
            raise InvalidRequest(f"scrub path {p!r} must be absolute and not /", field="scrub_paths")
        out.append(f"^{re.escape(os.path.normpath(p).lstrip('/'))}(/.*)?$")
    return out
_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


# events that also go to the audit log (the rest are lifecycle noise there)
AUDITED_EVENTS = frozenset({"egress_denied", "oom_killed", "disk_quota", "network", "created", "stopped", "failed",
                            "paused", "resumed"})

class EdgeConfig(BaseModel):
    name: str = "edge0"
    data_dir: str
    cpu_overcommit: float = 8.0
    memory_overcommit: float = 1.5
    max_sandboxes: int = 4096
    max_file_bytes: int = 256 * 1024 * 1024
    ttl_check_interval_s: float = 1.0
    # how a shared layer store reaches this node: see dsec.storage.node
    fetch_mode: FetchMode = "ondemand"
    chunk_cache_bytes: int = 10 << 30
    fetch_timeout_s: float = 20.0
    # memory pressure: below this much available memory, idle best-effort sandboxes are
    # paused (longest idle first); above this PSI "full" share, creations are refused
    pause_below_mb: int = 1024
    admit_max_psi: float = 20.0
    # sandbox networking: services beyond the built-in ones (name=host,*.suffix), and the
    # subnet for sandbox addresses (default: a free /19 of 10.211.0.0/16)
    egress_services: list[str] = []
    sandbox_subnet: str | None = None
    # writable layers with quotas live on a btrfs volume (None: sized from free space; 0: off)
    sandbox_volume_gb: int | None = None


@dataclass
class Sandbox:
    rec: Record
    dir: str
    agent: Aether | None = None
    stopping: bool = False
    watch: asyncio.Task[None] | None = None
    ops: int = 0
    dirty: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    events: deque[SandboxEvent] = field(default_factory=lambda: deque(maxlen=200))
    teardown: asyncio.Task[None] | None = None
    vm: VMInstance | None = None
    oom_seen: int = 0
    pids_seen: int = 0
    pids_reported: float = 0.0
    cpu_seen: tuple[float, float] = (0.0, 0.0)  # (when, throttled seconds) at the last look
    cpu_reported: float = 0.0
    qgroup: int | None = None  # its subvolume on the sandbox volume (disk quota)
    quota_full: bool = False
    disk: tuple[float, int] = (0.0, 0)  # (when measured, bytes): a tree walk, so cached
    creator: asyncio.Task[SandboxInfo] | None = None  # the create under way, which a stop cancels
    memory_held_mb: int = 0  # charged to its cgroup at the last look (admission counts it)
    memfail_seen: int = 0
    memfail_reported: float = 0.0

    @property
    def id(self) -> str:
        return self.rec.info.sandbox_id


class Edge(InteractiveOps):
    def __init__(self, cfg: EdgeConfig, layers: LayerStore) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.layers = layers
        root = os.path.join(cfg.data_dir, "edges", cfg.name)
        os.makedirs(root, exist_ok=True)
        self.volume = SandboxVolume(root, cfg.sandbox_volume_gb)
        self.volume.setup()
        self.sandbox_root = os.path.join(self.volume.mnt if self.volume.available else root, "sandboxes")
        os.makedirs(self.sandbox_root, exist_ok=True)
        # sockets and crun state are per boot: on tmpfs, with a path short enough for AF_UNIX
        tag = hashlib.sha1(os.path.abspath(cfg.data_dir).encode()).hexdigest()[:8]
        self.run_dir = f"/run/dsec/{tag}-{cfg.name}"
        os.makedirs(os.path.join(self.run_dir, "s"), exist_ok=True)
        self.state = EdgeState(os.path.join(root, "state.db"))
        self.runtime = CrunRuntime(os.path.join(self.run_dir, "crun"), cgroup_parent=f"dsec-{tag}")
        self.init_binary = ensure_init_binary(os.path.join(cfg.data_dir, "bin", "dsec-init"))
        self.sandboxes: dict[str, Sandbox] = {}
        self.watchers = Watchers()  # polled directory watchers clients hold here
        self.node_layers = NodeLayers(layers, cfg.data_dir, self.run_dir, cfg.fetch_mode, cfg.chunk_cache_bytes,
                                      cfg.fetch_timeout_s, on_error=self._storage_error)
        self.layer_mnt = self.node_layers.mnt_dir
        self.fncall_service = FnCallService(self, os.cpu_count() or 1)
        self.vms = VMRuntime(cfg.data_dir, self.run_dir, f"dsec-{tag}")
        self.audit = AuditLog(os.path.join(root, "audit.db"))
        self.detectors = Detectors(self._flag)
        self.procwatch = ProcWatch(f"dsec-{tag}", self._on_exec)
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
        self.cpus = os.cpu_count() or 1
        self.memory_mb = _mem_total_mb()
        self.metrics = EdgeMetrics(self.name, lambda: [
            (sb.id, sb.rec.info.state.value, sb.rec.info.job, self._usage(sb))
            for sb in list(self.sandboxes.values()) if not sb.stopping], self._storage_stats)

    # ---- lifecycle of the edge itself ---------------------------------------
    async def start(self) -> None:
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
        self._flush_activity()
        if not self.sandboxes:
            self.runtime.remove_cgroup_parent()
        await self.network.close(keep=bool(self.sandboxes))
        self.procwatch.close()
        self.audit.close()
        if not self.sandboxes:
            self.volume.close()
        await self.release_layers()
        await self.node_layers.close(sandboxes_left=bool(self.sandboxes))
        if not self.sandboxes:  # per-boot sockets and runtime state: nothing left to find again
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def on_event(self, sandbox_id: str, kind: str, message: str) -> None:
        """Something a sandbox's owner should know: kept with the sandbox (``GET .../events``) and logged."""
        log.info("%s %s: %s", sandbox_id, kind, message)
        if sb := self.sandboxes.get(sandbox_id):
            sb.events.append(SandboxEvent(t=time.time(), kind=kind, message=message))
        if kind in AUDITED_EVENTS:
            self.audit.record(sandbox_id, kind, message)
        if kind == "egress_denied":
            self.detectors.denial(sandbox_id)

    def _flag(self, sandbox_id: str, detector: str, message: str) -> None:
        self.audit.record(sandbox_id, "flag", message, flag=detector)
        self.on_event(sandbox_id, "flagged", f"{detector}: {message}")

    def _on_exec(self, sandbox_id: str, pid: int, cmdline: str) -> None:
        if sandbox_id in self.sandboxes:
            self.audit.record(sandbox_id, "process", f"[{pid}] {cmdline}" if pid else cmdline)
            self.detectors.command(sandbox_id, cmdline)

    async def audit_log(self, sandbox_id: str, kind: str | None = None, flagged: bool = False,
                        limit: int = 1000) -> list[AuditRecord]:
        """The sandbox's audit records (also after it ended), detectors brought up to date first."""
        sb = self._get_live(sandbox_id)
        if sb is None:
            self._tombstone(sandbox_id)
        elif not sb.stopping and sb.rec.info.state == SandboxState.running:
            await self._run_detectors(sb)
        return await asyncio.to_thread(self.audit.query, sandbox_id, kind, flagged, limit)

    async def protect(self, sandbox_id: str, paths: list[str]) -> int:
        """Fingerprint the files under ``paths`` now; later changes are flagged."""
        sb, _ = await self._ready(sandbox_id)
        if sb.vm:
            raise InvalidRequest("protected paths are watched in container sandboxes", field="sandbox_id")
        files = ProcRootFiles(sb.rec.init_pid)
        try:
            n = await asyncio.to_thread(self.detectors.protect, sb.id, paths, files.tree, files.read_bytes)
        except ValueError as e:
            raise InvalidRequest(str(e), field="paths") from None
        self.audit.record(sb.id, "protect", f"{n} files under {', '.join(paths)}")
        return n

    async def _run_detectors(self, sb: Sandbox) -> None:
        if sb.vm or not sb.rec.init_pid:
            return
        files = ProcRootFiles(sb.rec.init_pid)
        lowers = [p if os.path.isdir(p := os.path.join(sb.dir, "lower", str(i))) else
                  os.path.join(self.layer_mnt, d) for i, d in enumerate(sb.rec.digests)]

        def go() -> None:
            self.detectors.check_protected(sb.id, files.tree, files.read_bytes)
            self.detectors.check_replaced(sb.id, os.path.join(sb.dir, "upper"), lowers)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(go)

    def _storage_error(self, data: str, message: str) -> None:
        for sb in list(self.sandboxes.values()):
            if any(self.layers.data_of(d) == data for d in sb.rec.digests):
                self.on_event(sb.id, "storage_error", message)

    async def events(self, sandbox_id: str) -> list[SandboxEvent]:
        self._get_live(sandbox_id)
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            self._tombstone(sandbox_id)
            return []
        return list(sb.events)

    async def _recover(self) -> None:
        """Take back the sandboxes a previous edge left, all at once, each bounded: one that
        cannot be re-adopted in time is torn down as failed with the reason, and never
        holds the others or the edge's start."""
        live = {r.info.sandbox_id: r for r in self.state.live()}
        running = set(await self.runtime.list())
        gate = asyncio.Semaphore(READOPT_CONCURRENCY)

        async def one(sid: str, rec: Record) -> None:
            sb = self.sandboxes[sid] = Sandbox(rec, os.path.join(self.sandbox_root, sid))
            if rec.info.state == SandboxState.stopping:  # the edge died in its stop: finish it
                await self._teardown(sb, SandboxState.stopped, "stopped (finished after an edge restart)")
                return
            async with gate:
                try:
                    async with asyncio.timeout(READOPT_TIMEOUT_S):
                        await self._readopt(sb, sid in running)
                    return
                except TimeoutError:
                    why = f"not re-adopted within {READOPT_TIMEOUT_S:g} s after an edge restart"
                except (DsecError, OSError, ValueError) as e:
                    why = f"lost while the edge was down: {_why(e)}"
            log.warning("sandbox %s: %s", sid, why)
            await self._teardown(sb, SandboxState.failed, why)

        await asyncio.gather(*(one(sid, rec) for sid, rec in live.items()))
        for sid in running - set(self.sandboxes):  # a container no record owns (killed mid-create)
            cg = Cgroup(self.runtime.cgroup_path(sid))
            await asyncio.to_thread(cg.kill, KILL_TIMEOUT_S)
            await asyncio.to_thread(cg.remove, True)
            with contextlib.suppress(DsecError):
                await self.runtime.delete(sid)
            await asyncio.to_thread(cg.remove)
        for name in await self.vms.reap_strays(set(self.sandboxes)):
            log.warning("killed a QEMU no sandbox owns: %s", name)
        for mp in linux.mounted_under(self.sandbox_root):
            sid = os.path.basename(os.path.dirname(mp))
            if sid not in self.sandboxes or self.sandboxes[sid].stopping:
                with contextlib.suppress(OSError):
                    linux.umount(mp, detach=True)
        for name in os.listdir(self.sandbox_root):
            if name not in self.sandboxes:
                await asyncio.to_thread(self.volume.remove, os.path.join(self.sandbox_root, name))
        for sb in self.sandboxes.values():
            sb.qgroup = self.volume.subvolume_id(sb.dir)
        self.state.prune()

    async def _readopt(self, sb: Sandbox, in_crun: bool) -> None:
        """Re-adopt one sandbox, or raise why it cannot be. The kernel's freezer, not the
        record, says whether a container is paused: an edge killed in the middle of a
        pause, resume or pack_diff left the record one step behind."""
        sid, rec = sb.id, sb.rec
        if rec.info.state == SandboxState.creating:
            raise SandboxError("the edge restarted while it was being created")
        if rec.args.backend != "container":
            await self._recover_vm(sb)
            log.info("re-adopted VM sandbox %s (%s)", sid, rec.info.state.value)
            return
        if not in_crun or not _alive(rec.init_pid):
            raise SandboxError("its container is gone")
        if rec.info.network is not None:
            await self.network.readopt(sid, rec.info.network)
        cg = Cgroup(self.runtime.cgroup_path(sid))
        if rec.info.state == SandboxState.paused and rec.info.pause is not None:
            if not cg.frozen():  # killed mid-resume: thawed already, so it runs
                rec.info.state = SandboxState.running
            else:
                log.info("re-adopted paused sandbox %s", sid)
                return
        elif cg.frozen():  # killed mid-pause or mid-pack_diff: the record says running
            await self.runtime.resume(sid)
        await self._attach(sb)
        rec.info.state = SandboxState.running
        rec.info.paused_at = None
        self.state.put(rec)
        log.info("re-adopted sandbox %s", sid)

    # ---- admission ----------------------------------------------------------
    def _reserved(self) -> tuple[float, int, int]:
        """CPU and memory reserved by the sandboxes here: each one's request (by default a
        share of its limit for best-effort work, the limit for latency-sensitive work and
        VMs), or the memory it holds now if that is more. A paused one reserves no CPU and
        only what it still holds (its memory is in swap, or a VM's in a file): that is what
        lets idle sandboxes be packed far beyond the running ones. Resuming many at once is
        what the pressure policy and swap are for."""
        cpu, mem, n = 0.0, 0, 0
        for sb in self.sandboxes.values():
            if sb.stopping:
                continue
            n += 1
            info = sb.rec.info
            if info.state == SandboxState.paused and info.pause is not None:
                mem += max(1, info.pause.memory_after_bytes >> 20)
                continue
            cpu += sb.rec.args.cpu_admitted
            mem += max(sb.rec.args.memory_admitted_mb, sb.memory_held_mb)
        return cpu, int(mem), n

    def _admit(self, args: ContainerArgs | MicroVMArgs | VMArgs) -> None:
        # node-wide memory stalls refuse new work only while the node is also short of
        # memory: one sandbox thrashing inside its own limit stalls itself, not the node
        mem_state = memory.pressure()
        psi, avail = mem_state.get("full", 0.0), mem_state.get("available_mb", float("inf"))
        if psi > self.cfg.admit_max_psi and avail < 2 * self.cfg.pause_below_mb:
            raise AdmissionRejected(f"edge {self.name} is under memory pressure ({psi:.1f}% of the last 10 s "
                                    f"fully stalled on memory, limit {self.cfg.admit_max_psi:g}%; {avail:.0f} MiB "
                                    "available)")
        cpu, mem, n = self._reserved()
        room = Room(self.cpus, self.cfg.cpu_overcommit, self.memory_mb, self.cfg.memory_overcommit,
                    self.cfg.max_sandboxes, cpu, mem, n)
        if (why := refusal(room, args)) is not None:
            raise AdmissionRejected(f"edge {self.name} {why.message}", field=why.field)

    async def stats(self) -> NodeStats:
        cpu, mem, n = self._reserved()
        per_job: dict[str, int] = {}
        for sb in self.sandboxes.values():
            if sb.rec.info.job and not sb.stopping:
                per_job[sb.rec.info.job] = per_job.get(sb.rec.info.job, 0) + 1
        return NodeStats(
            edge=self.name, healthy=True, cpus=self.cpus, vm=self.vms.node_info(), network=self.network_status,
            density={**self.density, "pressure": memory.pressure(), "pause_below_mb": self.cfg.pause_below_mb,
                     "admit_max_psi": self.cfg.admit_max_psi},
            backends=[Backend.container, *([Backend.microvm, Backend.vm] if self.vms.available else [])],
            memory_mb=self.memory_mb, cpu_overcommit=self.cfg.cpu_overcommit,
            memory_overcommit=self.cfg.memory_overcommit, sandboxes=n, cpu_reserved=cpu,
            memory_reserved_mb=mem, max_sandboxes=self.cfg.max_sandboxes, per_job=per_job)

    # ---- create -------------------------------------------------------------
    def _new_id(self) -> str:
        return f"{self.name}-{''.join(secrets.choice(_ALPHABET) for _ in range(12))}"

    def _resolve_layers(self, args: ContainerArgs | MicroVMArgs | VMArgs) -> list[str]:
        """Digests bottom to top, each checked against its slot's kind."""
        refs = [args.image, *args.layers]
        digests = []
        for i, ref in enumerate(refs):
            fieldname = "image" if i == 0 else f"layers[{i - 1}]"
            try:
                kind = layer_kind(ref)
                layer = self.layers.get(ref)
            except NotFound:
                raise NotFound(f"unknown layer {ref!r}", field=fieldname) from None
            except InvalidRequest as e:
                raise InvalidRequest(e.message, field=fieldname) from None
            if (i == 0) != (kind == "base"):
                want = "a base layer" if i == 0 else "a workspace or toolkit layer"
                raise InvalidRequest(f"{fieldname} must be {want}, got {ref!r} ({kind})", field=fieldname)
            digests.extend(layer.all_blobs)
        return digests

    async def create(self, args: ContainerArgs | MicroVMArgs | VMArgs, sandbox_id: str | None = None) -> SandboxInfo:
        t0 = time.monotonic()
        digests = self._resolve_layers(args)
        if isinstance(args, ContainerArgs) and args.network_rules is not None:
            self.network.validate(args.network_rules)
        try:
            self._admit(args)
        except AdmissionRejected:
            self.metrics.rejected.inc()
            raise
        sid = sandbox_id or self._new_id()
        now = time.time()
        info = SandboxInfo(
            sandbox_id=sid, edge=self.name, backend=Backend(args.backend), state=SandboxState.creating,
            image=args.image, layers=args.layers, created_at=now, last_active_at=now, labels=args.labels,
            job=args.job, memory_limit_mb=args.memory_limit_mb, cpu_cores_limit=args.cpu_cores_limit,
            disk_limit_mb=args.disk_limit_mb if isinstance(args, ContainerArgs) else None,
            expires_at=now + args.max_lifetime_s if args.max_lifetime_s else None)
        sb = Sandbox(Record(info, args, 0, digests), os.path.join(self.sandbox_root, sid))
        self.sandboxes[sid] = sb  # reserves its share before the first await
        sb.creator = asyncio.current_task()
        try:
            # on record before anything is built: an edge killed mid-create finds it on
            # restart and tears down what was built (it ends failed, with the reason)
            self.state.put(sb.rec)
            await failpoint("create.recorded")
            if not isinstance(args, ContainerArgs):
                await self._create_vm(sb, args, digests)
            else:
                await self._create_container(sb, args, digests)
            await failpoint("create.attached")
            self._still_wanted(sb)
            info.state = SandboxState.running
            if isinstance(args, ContainerArgs) and args.protected_paths:
                await self.protect(sid, args.protected_paths)
            self.state.put(sb.rec)
        except BaseException as e:
            sb.creator = None
            if sb.teardown is None:  # else a stop is already tearing it down (and waits for us)
                await self._teardown(sb, SandboxState.failed, f"create failed: {_why(e)}")
            task = asyncio.current_task()
            if isinstance(e, asyncio.CancelledError) and sb.stopping and task and task.cancelling() == 1:
                task.uncancel()  # the stop's own cancel: the caller hears why, the request goes on
                raise SandboxNotRunning(f"sandbox {sid} was stopped while it was being created") from None
            if _out_of_space(e):
                raise InsufficientStorage(f"edge {self.name} has no space left in its data dir: {_why(e)}",
                                          sandbox_id=sid, operation="create") from e
            raise
        finally:
            sb.creator = None
        self.metrics.created.inc()
        self.metrics.create_seconds.observe(time.monotonic() - t0)
        self._still_wanted(sb)
        self.on_event(sid, "created", f"{args.image} {args.layers}")
        return info

    def _still_wanted(self, sb: Sandbox) -> None:
        if sb.stopping:
            raise SandboxNotRunning(f"sandbox {sb.id} was stopped while it was being created")

    async def _create_container(self, sb: Sandbox, args: ContainerArgs, digests: list[str]) -> None:
        sid = sb.id
        if args.record_access and not self.node_layers.on_demand:
            raise InvalidRequest("record_access needs a shared layer store read on demand", field="record_access")
        if self.volume.available:
            self.volume.create(sb.dir, args.disk_limit_mb)
            sb.qgroup = self.volume.subvolume_id(sb.dir)
        if queued := await self.node_layers.prefetch(digests):
            self.on_event(sid, "prefetch", f"{queued} chunks of recorded access lists queued")
        if args.record_access:
            lowers = [await self.node_layers.mount(d, os.path.join(sb.dir, "lower", str(i)), record_tag=sid)
                      for i, d in reversed(list(enumerate(digests)))]
        else:
            lowers = [await self.node_layers.mount(d) for d in reversed(digests)]
        for sub in ("upper", "work", "rootfs"):
            os.makedirs(os.path.join(sb.dir, sub), exist_ok=True)
        rootfs = os.path.join(sb.dir, "rootfs")
        linux.mount("overlay", rootfs, "overlay", 0,
                    f"lowerdir={':'.join(lowers)},upperdir={sb.dir}/upper,workdir={sb.dir}/work")
        await failpoint("create.mounted")
        limits = Limits(args.memory_limit_mb, args.cpu_cores_limit, args.pids_limit,
                        cpu_shares=2 if args.qos == "best_effort" else 1024)
        with open(os.path.join(sb.dir, "config.json"), "w") as f:
            json.dump(oci_config(sid, rootfs, limits, self.runtime.cgroup_path(sid), args.tmpfs), f)
        sock_path = self._sock_path(sid)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock_path)
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        init_fd = os.open(self.init_binary, os.O_RDONLY | os.O_CLOEXEC)
        try:
            lsock.bind(sock_path)
            os.chmod(sock_path, 0o600)
            lsock.listen(64)
            sb.rec.init_pid = await self.runtime.run(sid, sb.dir, init_fd, lsock.fileno())
        finally:
            lsock.close()
            os.close(init_fd)
        self.state.put(sb.rec)  # its init pid: a restart finds the container to kill
        await failpoint("create.started")
        idle = args.qos == "best_effort"
        # the workload's limits on its own child cgroup; init keeps a reserve beside it
        procs = await asyncio.to_thread(Cgroup(self.runtime.cgroup_path(sid)).split_workload, args.memory_limit_mb,
                                        args.cpu_cores_limit, args.pids_limit, limits.cpu_shares, idle)
        if args.network_rules is not None:
            await self._wire_network(sb, args.network_rules)
        await self._attach(sb, (procs, idle))

    async def _wire_network(self, sb: Sandbox, rules: dict[str, bool]) -> NetworkInfo:
        """Give a container its link; its resolver is the edge's, and it trusts the CAs
        the node's package managers trust (an egress proxy's among them)."""
        info = sb.rec.info.network = await self.network.attach(sb.id, sb.rec.init_pid, rules)
        files = ProcRootFiles(sb.rec.init_pid)
        await files.write_file("/etc/resolv.conf", f"nameserver {info.gateway}\noptions timeout:2\n".encode())
        if self.network.catalog.ca_bundle:
            await files.write_file("/etc/ssl/certs/ca-certificates.crt", self.network.catalog.ca_bundle)
        return info

    async def set_network_rules(self, sandbox_id: str, changes: dict[str, bool]) -> NetworkInfo:
        """Change a container's egress rules while it runs (wiring its link on first use)."""
        sb, _ = await self._ready(sandbox_id)
        if sb.vm:
            raise InvalidRequest("VM sandboxes have no network interface; network rules apply to containers",
                                 field="sandbox_id")
        async with sb.lock:
            if self.network.has(sb.id):
                info = sb.rec.info.network = await self.network.update(sb.id, changes)
            else:
                self.network.validate(changes)
                info = await self._wire_network(sb, changes)
            self.state.put(sb.rec)
        self.on_event(sb.id, "network", "allowed: " + (", ".join(sorted(info.rules)) or "nothing"))
        return info

    def _sock_path(self, sid: str) -> str:
        return os.path.join(self.run_dir, "s", sid)

    async def _attach(self, sb: Sandbox, workload: tuple[list[int], bool] | None = None) -> None:
        """Connect to the container's init (``workload``: at create, the cgroup.procs fds
        its children join, and whether they run SCHED_IDLE)."""
        init = InitClient(self._sock_path(sb.id))
        try:
            await init.connect()
            if workload is not None:
                await init.configure(*workload)
            await self._bind_agent(sb, init, None)
        except BaseException:
            init.close()
            raise
        finally:
            for fd in workload[0] if workload else []:
                os.close(fd)

    async def _bind_agent(self, sb: Sandbox, init: InitChannel, files: SandboxFiles | None) -> None:
        args = sb.rec.args
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": sb.id, "LANG": "C.UTF-8", **args.env}
        ctx = AgentContext(sandbox_id=sb.id, init_pid=sb.rec.init_pid, env=env, workdir="/")
        agent = Aether(ctx, init, files)
        ctx.shell = "/bin/bash" if await agent.files.exists("/bin/bash") else "/bin/sh"
        if not await agent.files.exists(args.workdir):
            await agent.files.mkdirs(args.workdir)
        ctx.workdir = args.workdir
        recovered = await agent.recover_sessions()
        if recovered:
            log.info("sandbox %s: took back sessions %s", sb.id, recovered)
        sb.agent = agent
        sb.watch = asyncio.create_task(self._watch(sb, init))

    async def _watch(self, sb: Sandbox, init: InitChannel) -> None:
        await init.closed.wait()
        if not sb.stopping:
            why = "VM agent channel lost (QEMU or the guest's agent ended)" if sb.vm else "sandbox init exited"
            await self._teardown(sb, SandboxState.failed, why)

    # ---- VM sandboxes -------------------------------------------------------------
    async def _create_vm(self, sb: Sandbox, args: MicroVMArgs | VMArgs, digests: list[str]) -> None:
        os.makedirs(sb.dir, exist_ok=True)
        machine = "microvm" if isinstance(args, MicroVMArgs) else "q35"
        files = [await self.node_layers.image_files(d) for d in digests]
        upper = os.path.join(sb.dir, "upper.img")
        display = isinstance(args, VMArgs) and args.display
        spec = await self.vms.make_spec(machine, args.vcpus, args.memory_mb, files, upper, display)
        vm = sb.vm = VMInstance(sb.id, sb.dir, self.vms.sock_dir, spec)
        if args.template:
            key = self.vms.template_key(spec, digests, args.disk_mb)
            tdir = await self.vms.ensure_template(key, spec, args.disk_mb, timeout=180)
            ch = await self.vms.clone(vm, tdir, sb.id)
        else:
            await self.vms.make_upper(upper, args.disk_mb)
            ch = await self.vms.boot(vm, sb.id, timeout=180)
        sb.rec.init_pid = vm.pid
        self.vms.save_spec(vm)
        sb.rec.info.vm = VMInfo(
            machine=machine, accelerator=spec.accel, vcpus=args.vcpus, memory_mb=args.memory_mb,
            disk_mb=args.disk_mb, started_from="template" if args.template else "boot",
            boot_s=vm.timings.get("boot_s"), clone_s=vm.timings.get("clone_s"))
        await self._bind_agent(sb, ch, GuestFiles(ch))

    async def _recover_vm(self, sb: Sandbox) -> None:
        """Take back a VM left by a previous edge: a running QEMU is reconnected (the
        guest's agent drops the old edge's channels, so sessions start afresh); a paused
        one stays paused with its snapshot."""
        vm = sb.vm = self.vms.load(sb.id, sb.dir)
        if sb.rec.info.state == SandboxState.paused:
            if not os.path.exists(vm.snapshot):
                raise SandboxError("paused VM's snapshot is gone")
            ch = GuestChannel(vm.agent_sock)
            sb.agent = Aether(AgentContext(sb.id, 0, {}, sb.rec.args.workdir), ch, GuestFiles(ch))
            return
        if not self.vms.is_qemu(sb.rec.init_pid):
            raise SandboxError("its QEMU is gone")
        ch = await self.vms.adopt(vm, sb.rec.init_pid)
        await self._bind_agent(sb, ch, GuestFiles(ch))

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
            if sb.vm:
                meta = await self.vms.pause(sb.vm)
                if info.vm:
                    info.vm.pause_s = sb.vm.timings.get("pause_s")
                    info.vm.snapshot_bytes = meta["size"]
                msg = f"snapshot {meta['size'] >> 20} MiB in {sb.vm.timings.get('pause_s', 0):.2f} s; QEMU ended"
            else:
                await self.runtime.pause(sb.id)  # frozen first: nothing touches the memory we push out
                await failpoint("pause.frozen")
                await asyncio.to_thread(memory.page_out, cg)
                await failpoint("pause.paged")
                msg = "frozen, memory pushed out to swap"
            after = memory.cgroup_memory(cg)
            info.pause = PauseInfo(memory_before_bytes=before.get("total", 0), memory_after_bytes=after.get("total", 0),
                                   swap_bytes=after.get("swap", 0), pause_s=time.monotonic() - t0)
            info.state = SandboxState.paused
            info.paused_at = time.time()
            self.state.put(sb.rec)
        self.on_event(sb.id, "paused", f"{msg}; memory {info.pause.memory_before_bytes >> 20} -> "
                      f"{info.pause.memory_after_bytes >> 20} MiB in {info.pause.pause_s * 1000:.0f} ms")
        return info

    def _cgroup(self, sb: Sandbox) -> str:
        return (self.vms if sb.vm else self.runtime).cgroup_path(sb.id)

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
            if sb.vm:
                try:
                    fresh = sb.vm.channel is None
                    await self.vms.resume(sb.vm)
                except SnapshotError as e:
                    self.on_event(sb.id, "snapshot_error", str(e))
                    asyncio.create_task(self._teardown(sb, SandboxState.failed, f"resume failed: {e}"))
                    raise
                sb.rec.init_pid = sb.vm.pid
                if info.vm:
                    info.vm.restore_s = sb.vm.timings.get("restore_s")
                    info.vm.snapshot_bytes = None
                    info.vm.started_from = "snapshot"
                if fresh and sb.vm.channel:  # paused across an edge restart: a new agent binding
                    await self._bind_agent(sb, sb.vm.channel, GuestFiles(sb.vm.channel))
                msg = f"restored in {sb.vm.timings.get('restore_s', 0):.2f} s"
            else:
                # swap-in starts (asynchronously) before the processes run and fault it in one page at a time
                await asyncio.to_thread(memory.prefetch, self.runtime.cgroup_path(sb.id))
                await self.runtime.resume(sb.id)
                await failpoint("resume.thawed")
                if sb.agent is None:  # paused across an edge restart: bound now that init answers
                    await self._attach(sb)
                msg = "memory prefetch started, thawed"
            if info.pause:
                info.pause.resume_s = time.monotonic() - t0
            info.state = SandboxState.running
            info.paused_at = None
            info.last_active_at = time.time()
            self.state.put(sb.rec)
        self.on_event(sb.id, "resumed", msg)

    async def _ready(self, sandbox_id: str) -> tuple[Sandbox, Aether]:
        """The sandbox and its agent, resumed first if it is paused (any request resumes)."""
        sb = self._get_live(sandbox_id)
        if sb is not None and sb.rec.info.state == SandboxState.paused:
            await self._resume(sb)
        return self._running(sandbox_id)

    def _display_vm(self, sandbox_id: str) -> VMInstance:
        sb, _ = self._running(sandbox_id)
        if sb.vm is None or not sb.vm.spec.display:
            raise InvalidRequest(f"sandbox {sandbox_id} has no display (a VMArgs sandbox with display=True has)",
                                 field="sandbox_id")
        return sb.vm

    async def screenshot(self, sandbox_id: str) -> bytes:
        await self._ready(sandbox_id)
        return await screenshot(self._display_vm(sandbox_id))

    async def send_keys(self, sandbox_id: str, keys: str) -> None:
        await self._ready(sandbox_id)
        await send_keys(self._display_vm(sandbox_id), keys)

    async def click(self, sandbox_id: str, x: int, y: int, button: str = "left") -> None:
        await self._ready(sandbox_id)
        await click(self._display_vm(sandbox_id), x, y, button)

    # ---- stop and cleanup ---------------------------------------------------
    async def stop(self, sandbox_id: str) -> SandboxInfo:
        self._get_live(sandbox_id)  # validates the id and its edge
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            return self._tombstone(sandbox_id)
        # a teardown already under way (TTL, init exit) is waited for, not raced
        await self._teardown(sb, SandboxState.stopped, "stopped")
        return sb.rec.info

    async def _teardown(self, sb: Sandbox, final: SandboxState, reason: str, record: bool = True) -> None:
        """Release everything of a sandbox, once. The work runs in its own task, shielded:
        a caller that is cancelled (an edge shutdown, a dropped request) cannot leave it
        half done, and :meth:`close` waits for it."""
        if sb.teardown is None:
            sb.teardown = asyncio.create_task(self._release(sb, final, reason, record))
            self._teardowns.add(sb.teardown)
            sb.teardown.add_done_callback(self._teardowns.discard)
        await asyncio.shield(sb.teardown)

    async def _release(self, sb: Sandbox, final: SandboxState, reason: str, record: bool) -> None:
        """Kill first, through the cgroup (or QEMU's pid), asking nothing inside the sandbox;
        then let whatever held the sandbox (a pause, a pack_diff, a create) fall through;
        then release each resource, every step bounded and on its own: one that fails or
        hangs is reported and the rest still happen."""
        if sb.stopping and sb.rec.info.state in (SandboxState.stopped, SandboxState.failed):
            return
        t0 = time.monotonic()
        sb.stopping = True
        sb.rec.info.state = SandboxState.stopping
        if record:
            await self._bounded(sb, "record", asyncio.to_thread(self.state.put, sb.rec))
            await failpoint("stop.recorded")
        if sb.watch and sb.watch is not asyncio.current_task():
            sb.watch.cancel()
        if sb.vm:
            await self._bounded(sb, "kill QEMU", self.vms.destroy(sb.vm), KILL_TIMEOUT_S + 5)
        else:
            cg = Cgroup(self.runtime.cgroup_path(sb.id))
            if not await self._bounded(sb, "kill", asyncio.to_thread(cg.kill, KILL_TIMEOUT_S), KILL_TIMEOUT_S + 5):
                self.on_event(sb.id, "teardown_error", f"processes left in its cgroup after {KILL_TIMEOUT_S} s "
                              f"of SIGKILL: {sorted(cg.procs())[:10]}")
        await failpoint("stop.killed")
        if sb.creator is not None and sb.creator is not asyncio.current_task():
            sb.creator.cancel()  # a create under way stops where it is; what it built is released below
            await asyncio.wait([sb.creator], timeout=STEP_TIMEOUT_S)
        locked = False
        try:
            async with asyncio.timeout(STEP_TIMEOUT_S):  # the holder's init is dead: it ends soon
                await sb.lock.acquire()
                locked = True
        except TimeoutError:
            log.warning("sandbox %s: tearing down without its lock (held for %s s)", sb.id, STEP_TIMEOUT_S)
        try:
            self.watchers.release(sb.id)
            if sb.agent:
                await self._bounded(sb, "close the agent", sb.agent.close())
                sb.agent = None
            await self._bounded(sb, "detach the network", self.network.detach(sb.id))
            if not sb.vm:
                cg = Cgroup(self.runtime.cgroup_path(sb.id))
                await asyncio.to_thread(cg.remove, True)  # crun removes the cgroup it made, not ours below it
                await self._bounded(sb, "crun delete", self.runtime.delete(sb.id))
                await failpoint("stop.deleted")
                if sb.rec.init_pid:
                    await _wait_gone(sb.rec.init_pid)
                left = await asyncio.to_thread(cg.remove)
                if left:
                    self.on_event(sb.id, "teardown_error", f"cgroups not removed: {left}")
            if isinstance(sb.rec.args, ContainerArgs) and sb.rec.args.record_access:
                await self._bounded(sb, "save access lists", self._save_access_lists(sb, forget=True))
            await self._bounded(sb, "unmount", asyncio.to_thread(_unmount_all, sb.dir))
            await self._bounded(sb, "remove its files", asyncio.to_thread(self.volume.remove, sb.dir), 60)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._sock_path(sb.id))
            self.detectors.forget(sb.id)
            self.procwatch.forget(sb.id)
            sb.rec.info.state = final
            sb.rec.info.error = None if final == SandboxState.stopped else reason
            if record:
                await self._bounded(sb, "record", asyncio.to_thread(self.state.put, sb.rec))
            self.sandboxes.pop(sb.id, None)
        finally:
            if locked:
                sb.lock.release()
        if record:
            self.metrics.stopped.labels(self.name, final.value).inc()
        self.on_event(sb.id, final.value, f"{reason} (released in {time.monotonic() - t0:.2f} s)")

    async def _bounded(self, sb: Sandbox, step: str, aw: Awaitable[T], timeout: float = STEP_TIMEOUT_S) -> T | None:
        """One teardown step with a deadline; a failure is the sandbox's event, not the caller's."""
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                return await aw
        except TimeoutError:
            self.on_event(sb.id, "teardown_error", f"{step}: no answer within {timeout:g} s")
        except Exception as e:  # noqa: BLE001 - reported; the other steps still run
            self.on_event(sb.id, "teardown_error", f"{step}: {_why(e)}")
        finally:
            if time.monotonic() - t0 > 0.5:
                log.info("sandbox %s: teardown step %r took %.2f s", sb.id, step, time.monotonic() - t0)
        return None

    # ---- lookup -------------------------------------------------------------
    def _tombstone(self, sandbox_id: str) -> SandboxInfo:
        rec = self.state.get(sandbox_id)
        if rec is None:
            raise NotFound(f"no sandbox {sandbox_id!r} on edge {self.name}", field="sandbox_id")
        return rec.info

    def _get_live(self, sandbox_id: str) -> Sandbox | None:
        try:
            if parse_sandbox_id(sandbox_id) != self.name:
                raise NotFound(f"sandbox {sandbox_id!r} does not live on edge {self.name}", field="sandbox_id")
        except ValueError as e:
            raise InvalidRequest(str(e), field="sandbox_id") from None
        sb = self.sandboxes.get(sandbox_id)
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

    async def usage(self, sandbox_id: str) -> SandboxUsage:
        self._get_live(sandbox_id)
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            self._tombstone(sandbox_id)
            raise SandboxNotRunning(f"sandbox {sandbox_id} has ended: it uses nothing")
        return await asyncio.to_thread(self._usage, sb, 0.0)

    def _usage(self, sb: Sandbox, disk_max_age: float = 30.0) -> SandboxUsage:
        cg = self._cgroup(sb)
        use = cgroup_usage(cg)
        mem = memory.cgroup_memory(cg)
        when, disk = sb.disk
        if sb.qgroup is not None and disk_max_age > 0:  # the qgroup: cheap, at most 5 s old (scrapes)
            disk = self.volume.referenced(sb.qgroup, sb.qgroup).get(sb.qgroup, disk)
        elif time.monotonic() - when > disk_max_age:  # asked for now: walk the tree
            target = sb.vm.spec.disks[0].path if sb.vm else os.path.join(sb.dir, "upper")
            disk = memory.disk_usage(target)
            sb.disk = (time.monotonic(), disk)
        return SandboxUsage(cpu_s=use.get("cpu_ns", 0) / 1e9, memory_bytes=mem.get("total", 0),
                            anon_bytes=mem.get("anon", 0), file_bytes=mem.get("file", 0),
                            swap_bytes=mem.get("swap", 0), pids=use.get("pids", 0), disk_bytes=disk,
                            oom_kills=memory.oom_kills(cg))

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

    def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        return exec_events(lambda on_data: self._exec(sandbox_id, req, on_data))

    async def _exec(self, sandbox_id: str, req: ExecRequest, on_data: OnData | None) -> ExecResult:
        sb, agent = await self._ready(sandbox_id)
        cmd = req.cmd if req.cmd is not None else " ".join(req.argv or [])
        self.audit.record(sb.id, "exec", f"[{req.session}] {cmd}" if req.session else cmd)
        self.detectors.command(sb.id, cmd)
        sb.ops += 1
        try:
            res = await agent.exec(req, on_data)
            if res.stdout_truncated or res.stderr_truncated:
                self.on_event(sb.id, "output_truncated", f"output past {req.max_output_bytes} bytes was dropped "
                              f"(the command went on{', until its timeout' if res.timed_out else ''})")
            self.metrics.exec_seconds.labels(self.name, "session" if req.session else "exec").observe(
                res.duration_ms / 1000)
            return res
        except ChannelLost:
            if sb.stopping:  # stopped while the command ran
                raise SandboxNotRunning(f"sandbox {sandbox_id} was stopped while the command ran") from None
            raise
        finally:
            sb.ops -= 1

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        _, agent = await self._ready(sandbox_id)
        return await agent.files.read_file(path, self.cfg.max_file_bytes)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644,
                         owner: Owner | None = None) -> None:
        if len(data) > self.cfg.max_file_bytes:
            raise PayloadTooLarge(f"file body of {len(data)} bytes exceeds the {self.cfg.max_file_bytes}-byte limit",
                                  field="body")
        sb, agent = await self._ready(sandbox_id)
        self.audit.record(sb.id, "file_write", f"{path} ({len(data)} bytes, mode {mode:o})")
        await agent.files.write_file(path, data, mode, owner)

    async def make_dir(self, sandbox_id: str, path: str, owner: Owner | None = None) -> bool:
        """Make ``path`` and its parents; False if it already existed."""
        sb, agent = await self._ready(sandbox_id)
        if await agent.files.exists(path):
            return False
        self.audit.record(sb.id, "file_write", f"{path} (directory)")
        await agent.files.mkdirs(path, owner)
        return True

    async def set_xattrs(self, sandbox_id: str, path: str, prefix: str, values: dict[str, str]) -> None:
        """The user.* extended attributes under ``prefix`` on ``path`` become ``values``."""
        sb, agent = await self._ready(sandbox_id)
        self.audit.record(sb.id, "file_write", f"{path} (xattrs {prefix}*)")
        await agent.files.set_xattrs(path, prefix, values)

    async def move(self, sandbox_id: str, source: str, destination: str) -> FileStat:
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
        _, agent = await self._ready(sandbox_id)
        return await agent.files.list_dir(path)

    async def stat(self, sandbox_id: str, path: str) -> FileStat:
        _, agent = await self._ready(sandbox_id)
        return await agent.files.stat(path)

    async def remove(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
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
        return await self.fncall_service.languages(image)

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

    # ---- layers: pack_diff, in-use ------------------------------------------------
    async def pack_diff(self, sandbox_id: str, ref: str, scrub_paths: list[str] | None = None,
                        default_scrub: bool = True, source: str | None = None) -> Layer:
        """Publish the sandbox's writes (its overlay upper dir: new and changed files,
        whiteouts for deletions, opaque dirs) as workspace layer ``ref``, incremental
        over the stack it runs on. The sandbox is frozen while the image is built."""
        sb, _ = await self._ready(sandbox_id)
        if sb.vm:
            raise InvalidRequest("pack_diff works on container sandboxes; a VM's writes are on its own ext4 disk",
                                 field="sandbox_id")
        try:
            kind = layer_kind(ref)
        except InvalidRequest as e:
            raise InvalidRequest(e.message, field="ref") from None
        if kind == "base":
            raise InvalidRequest(f"pack_diff makes workspace (ws/...) or toolkit (tk/...) layers, not {ref!r}",
                                 field="ref")
        if self.layers.has(ref):
            raise InvalidRequest(f"layer {ref!r} already exists; layers are immutable", field="ref")
        opts = ImportOptions(exclude_regex=scrub_regexes(scrub_paths or [], default_scrub))
        async with sb.lock:
            await self.runtime.pause(sb.id)
            try:
                await failpoint("pack_diff.frozen")
                layer = await asyncio.to_thread(
                    self.layers.import_dir, os.path.join(sb.dir, "upper"), ref, kind, opts,
                    sb.rec.args.image, sb.rec.args.layers, source or f"pack_diff of {sb.id}")
                await failpoint("pack_diff.built")
            finally:
                await self.runtime.resume(sb.id)
        self.on_event(sb.id, "pack_diff", f"{layer.ref} {layer.digest[:12]} {layer.size} bytes")
        return layer

    async def save_access_lists(self, sandbox_id: str) -> dict[str, int]:
        """Save what a ``record_access`` sandbox read so far as its layers' access lists."""
        sb, _ = self._running(sandbox_id)
        if not isinstance(sb.rec.args, ContainerArgs) or not sb.rec.args.record_access:
            raise InvalidRequest(f"sandbox {sandbox_id} was not created with record_access", field="record_access")
        return await self._save_access_lists(sb)

    async def _save_access_lists(self, sb: Sandbox, forget: bool = False) -> dict[str, int]:
        saved: dict[str, int] = {}
        for d in sb.rec.digests:
            try:
                got = await self.node_layers.recorded(d, sb.id, forget=forget)
            except (TimeoutError, OSError, RuntimeError) as e:
                log.warning("sandbox %s: access list of %s not saved: %s", sb.id, d[:12], e)
                continue
            if got and got[1]:
                data, chunks = got
                self.layers.set_access_list(data, chunks, f"recorded by {sb.id}")
                saved[data] = len(chunks)
        if saved:
            self.on_event(sb.id, "access_list", f"saved {sum(saved.values())} chunks for {len(saved)} blob(s)")
        return saved

    async def storage_stats(self) -> StorageStats:
        return self._storage_stats()

    def _storage_stats(self) -> StorageStats:
        snap = self.node_layers.snapshot
        cache = snap.get("cache", {})
        refs: dict[str, list[str]] = {}
        for layer in self.layers.list():
            for d in layer.data.values():
                refs.setdefault(d, []).append(layer.ref)
        blobs = []
        for data, st in sorted(snap.get("blobs", {}).items()):
            fetches = sum(st["latency_buckets"])
            blobs.append(LayerFetchStats(
                data=data, layers=refs.get(data, []), remote_bytes=st["remote_bytes"],
                remote_chunks=st["remote_chunks"], hits=st["hits"], misses=st["misses"],
                prefetched=st["prefetched"], errors=st["errors"],
                chunk_latency_s=st["latency_sum"] / fetches if fetches else 0.0))
        return StorageStats(
            edge=self.name, backend=self.layers.backend.kind, mode=self.cfg.fetch_mode,
            cache_bytes=cache.get("bytes", 0), cache_max_bytes=cache.get("max_bytes", 0),
            cache_entries=cache.get("entries", 0), cache_evictions=cache.get("evictions", 0),
            cache_corrupt=cache.get("corrupt", 0), cache_written_bytes=cache.get("written_bytes", 0),
            copied_bytes=self.node_layers.copied_bytes, blobs=blobs)

    async def layers_in_use(self) -> set[str]:
        return {d for sb in self.sandboxes.values() if not sb.stopping for d in sb.rec.digests}

    async def release_layers(self) -> None:
        """Unmount layer images no sandbox on this edge uses any more."""
        await self.node_layers.release(await self.layers_in_use())

    async def metrics_text(self) -> bytes:
        return await asyncio.to_thread(generate_latest, self.metrics.registry)

    def _audit(self, sandbox_id: str, kind: str, detail: str) -> None:
        self.audit.record(sandbox_id, kind, detail)

    async def touch(self, sandbox_id: str) -> None:
        sb = self.sandboxes.get(sandbox_id)
        if sb:
            sb.rec.info.last_active_at = time.time()
            sb.dirty = True

    # ---- TTLs -----------------------------------------------------------------
    def _flush_activity(self) -> None:
        for sb in self.sandboxes.values():
            if sb.dirty and not sb.stopping:
                sb.dirty = False
                self.state.touch(sb.id, sb.rec.info.last_active_at)

    async def _relieve_pressure(self) -> None:
        """Below ``pause_below_mb`` available, pause the longest-idle best-effort container
        (idle: no request for 5 s) before the kernel's OOM killer has to pick something.
        Latency-sensitive sandboxes, busy ones and VMs are left alone. One per tick."""
        avail = memory.pressure().get("available_mb", float("inf"))
        if avail >= self.cfg.pause_below_mb:
            return
        now = time.time()
        idle = sorted((sb for sb in self.sandboxes.values()
                       if isinstance(sb.rec.args, ContainerArgs) and sb.rec.args.qos == "best_effort"
                       and sb.rec.info.state == SandboxState.running and not sb.stopping and sb.agent
                       and not sb.ops and now - sb.rec.info.last_active_at > 5
                       and sb.rec.args.labels.get("dsec-role") != "fncall"),
                      key=lambda sb: sb.rec.info.last_active_at)
        if idle:
            sb = idle[0]
            with contextlib.suppress(SandboxBusy, SandboxError):
                await self.pause(sb.id)
                self.on_event(sb.id, "pressure", f"paused: the node had {avail:.0f} MiB available, "
                              f"below {self.cfg.pause_below_mb} MiB")

    def _limit_events(self, sb: Sandbox) -> None:
        """Events for a sandbox running into its own limits (memory, pids, CPU quota)."""
        cg, args = self._cgroup(sb), sb.rec.args
        sb.memory_held_mb = memory.cgroup_memory(cg).get("total", 0) >> 20
        # pressure inside its own limit is its own business: an event, never a node-wide refusal
        fails = memory.memory_failures(cg)
        if fails > sb.memfail_seen and time.monotonic() - sb.memfail_reported > 60 and sb.memfail_seen:
            self.on_event(sb.id, "memory_pressure", f"at its {args.memory_limit_mb} MiB limit: the kernel "
                          f"reclaimed its memory {fails - sb.memfail_seen} time(s) since the last look")
            sb.memfail_reported = time.monotonic()
        sb.memfail_seen = fails
        kills = memory.oom_kills(cg)
        if kills > sb.oom_seen:
            self.on_event(sb.id, "oom_killed", f"{kills - sb.oom_seen} process(es) killed at the "
                          f"{args.memory_limit_mb} MiB limit (OOM inside the sandbox only)")
            sb.oom_seen = kills
        refused = memory.pids_limit_hits(cg)
        if refused > sb.pids_seen:
            if isinstance(args, ContainerArgs) and time.monotonic() - sb.pids_reported > 10:
                self.on_event(sb.id, "pids_limit", f"{refused - sb.pids_seen} fork(s) refused at the "
                              f"{args.pids_limit}-process limit")
                sb.pids_reported = time.monotonic()
            sb.pids_seen = refused
        now, throttled = time.monotonic(), memory.cpu_throttled_s(cg)
        then, before = sb.cpu_seen
        if now - then >= 10:
            if then and throttled - before > 0.3 * (now - then) and now - sb.cpu_reported > 60:
                self.on_event(sb.id, "cpu_throttled", f"held at its {args.cpu_cores_limit} CPU limit "
                              f"{100 * (throttled - before) / (now - then):.0f}% of the last {now - then:.0f} s")
                sb.cpu_reported = now
            sb.cpu_seen = (now, throttled)

    async def _audit_sweep(self) -> None:
        """Every 10 s: write buffered audit records, run the file detectors."""
        since, now = self._audit_swept - 1, time.time()
        if now - self._audit_swept < 10:
            return
        self._audit_swept = now
        await asyncio.to_thread(self.audit.flush)
        # only sandboxes that served requests since the last sweep: an idle fleet costs
        # nothing here (an audit query runs the detectors of its sandbox in any case)
        for sb in list(self.sandboxes.values()):
            info = sb.rec.info
            if info.state == SandboxState.running and not sb.stopping and (sb.ops or info.last_active_at >= since):
                await self._run_detectors(sb)
        if random.random() < 0.01:
            await asyncio.to_thread(self.audit.prune)

    async def _check_disk_quotas(self) -> None:
        """Report a sandbox whose writable layer reached its quota (once per filling)."""
        quota = [sb for sb in self.sandboxes.values() if sb.qgroup is not None and not sb.stopping]
        if not quota or time.monotonic() - self._quota_checked < 5:
            return
        self._quota_checked = time.monotonic()
        used = await asyncio.to_thread(self.volume.referenced)
        for sb in quota:
            limit = sb.rec.args.disk_limit_mb << 20 if isinstance(sb.rec.args, ContainerArgs) else 0
            n = used.get(sb.qgroup or 0, 0)
            if not sb.quota_full and limit and n >= limit * 0.95:
                sb.quota_full = True
                self.on_event(sb.id, "disk_quota", f"writable layer full: {n >> 20} of {limit >> 20} MiB "
                              "(writes fail with EDQUOT)")
            elif sb.quota_full and n < limit * 0.8:
                sb.quota_full = False

    async def _ttl_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.ttl_check_interval_s)
            try:
                self._flush_activity()
                await self._relieve_pressure()
                await self._check_disk_quotas()
                await self._audit_sweep()
                now = time.time()
                for sb in list(self.sandboxes.values()):
                    args, info = sb.rec.args, sb.rec.info
                    if sb.stopping or (sb.agent is None and info.state != SandboxState.paused):
                        continue
                    if info.state == SandboxState.running:
                        self._limit_events(sb)
                    if info.state == SandboxState.paused:  # idle by definition: lifetime and paused TTL only
                        if args.max_lifetime_s and now - info.created_at > args.max_lifetime_s \
                                and args.on_expiry == "stop":
                            await self._teardown(sb, SandboxState.stopped, "max lifetime reached")
                        elif args.ttl_paused_stop and now - (info.paused_at or now) > args.ttl_paused_stop:
                            await self._teardown(sb, SandboxState.stopped, "paused too long (ttl_paused_stop)")
                        continue
                    if sb.ops:
                        info.last_active_at = now
                    if args.max_lifetime_s and now - info.created_at > args.max_lifetime_s:
                        if args.on_expiry == "pause":
                            with contextlib.suppress(SandboxBusy, SandboxError):
                                await self.pause(sb.id)
                        else:
                            await self._teardown(sb, SandboxState.stopped, "max lifetime reached")
                    elif args.ttl_running_stop and now - info.last_active_at > args.ttl_running_stop:
                        await self._teardown(sb, SandboxState.stopped, "idle timeout (ttl_running_stop)")
                    elif args.ttl_running_pause and now - info.last_active_at > args.ttl_running_pause:
                        with contextlib.suppress(SandboxBusy, SandboxError):
                            await self.pause(sb.id)
            except Exception:
                log.exception("TTL sweep failed")


def _why(e: BaseException) -> str:
    if isinstance(e, asyncio.CancelledError):
        return "cancelled"
    return (e.message if isinstance(e, DsecError) else str(e)) or type(e).__name__


def _unmount_all(root: str) -> None:
    for mp in linux.mounted_under(root):
        try:
            linux.umount(mp)
        except OSError:
            linux.umount(mp, detach=True)


def _alive(pid: int) -> bool:
    """Running, not a zombie: a killed init waits for whoever reaps it (the host's init,
    which may take its time), but holds nothing of the sandbox any more."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _out_of_space(e: BaseException) -> bool:
    """ENOSPC or EDQUOT from the node's own disk, or SQLite saying the same."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, sqlite3.OperationalError) and "disk is full" in str(e)


async def _wait_gone(pid: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.002)
    # the edge is the child subreaper of the inits it started: reap this one (only this
    # one: a wait for any child would take asyncio's subprocesses' statuses)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks


def _mem_total_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024
