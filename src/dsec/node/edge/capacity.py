"""Capacity: what the edge admits (against the reservations it holds, node/edge/reservations.py), its
stats for the watcher, usage per sandbox, storage and metrics."""

from __future__ import annotations

import asyncio
import logging
import time

from dsec.node.edge.core import EdgeNode
from dsec.node.edge.lifecycle import Lifecycle, Op
from dsec.node.edge.metrics import cgroup_usage
from dsec.node.edge.sandbox import Sandbox
from dsec.node.edge.table import SandboxTable
from dsec.node.host import memory
from dsec.shared.admission import Room, refusal
from dsec.shared.errors import (
    AdmissionRejected,
)
from dsec.shared.query import answer, matches, needs_usage
from dsec.shared.wire.console import MAX_PAGE, SandboxPage, SandboxQuery
from dsec.shared.wire.models import (
    Backend,
    ContainerArgs,
    LayerFetchStats,
    MicroVMArgs,
    NodeStats,
    SandboxInfo,
    SandboxUsage,
    StorageStats,
    VMArgs,
)

log = logging.getLogger("dsec.edge")
RANK_TTL_S = 1.0


class Capacity:
    """Admission, stats, usage, storage."""

    def __init__(self, node: EdgeNode, table: SandboxTable, lifecycle: Lifecycle) -> None:
        self.node = node
        self.table = table
        self.lifecycle = lifecycle
        self._rank_lock: asyncio.Lock | None = None
        self._rank_at = 0.0
        self._rank: dict[str, SandboxUsage] = {}  # replaced, never mutated

    async def set_cordon(self, cordoned: bool, reason: str = "") -> None:
        """Take no new sandboxes (``cordoned``), or take them again. Kept in memory only:
        the fleet's records hold the cordon and assert it again every round."""
        if cordoned and self.node.signals.cordon != (reason or "cordoned"):
            log.info("cordoned: %s", reason or "no reason given")
        self.node.signals.cordon = (reason or "cordoned") if cordoned else None

    def admit(self, args: ContainerArgs | MicroVMArgs | VMArgs) -> None:
        if self.node.signals.cordon is not None:
            raise AdmissionRejected(f"edge {self.node.name} is cordoned ({self.node.signals.cordon}): it takes no new "
                                    "sandboxes")
        # node-wide memory stalls refuse new work only while the node is also short of
        # memory: one sandbox thrashing inside its own limit stalls itself, not the node
        mem_state = memory.pressure()
        psi, avail = mem_state.get("full", 0.0), mem_state.get("available_mb", float("inf"))
        if psi > self.node.cfg.admit_max_psi and avail < 2 * self.node.cfg.pause_below_mb:
            raise AdmissionRejected(f"edge {self.node.name} is under memory pressure ({psi:.1f}% of the last 10 s "
                                    f"fully stalled on memory, limit {self.node.cfg.admit_max_psi:g}%; {avail:.0f} MiB "
                                    "available)")
        cpu, mem, n = self.table.held.totals()
        room = Room(self.node.cpus, self.node.cfg.cpu_overcommit, self.node.memory_mb, self.node.cfg.memory_overcommit,
                    self.node.cfg.max_sandboxes, cpu, mem, n)
        if (why := refusal(room, args)) is not None:
            raise AdmissionRejected(f"edge {self.node.name} {why.message}", field=why.field)

    def admit_many(self, args: ContainerArgs | MicroVMArgs | VMArgs, n: int) -> None:
        """Room for ``n`` sandboxes of ``args`` at once (a live branch's children), or the
        refusal naming what is short; each is still admitted as it is made."""
        self.admit(args)
        if n > 1:
            node = self.node
            cpu, mem, count = self.table.held.totals()
            more = n - 1
            room = Room(node.cpus, node.cfg.cpu_overcommit, node.memory_mb, node.cfg.memory_overcommit,
                        node.cfg.max_sandboxes, cpu + args.cpu_admitted * more, mem + args.memory_admitted_mb * more,
                        count + more)
            if (why := refusal(room, args)) is not None:
                raise AdmissionRejected(f"edge {node.name} {why.message} (for {n} sandboxes at once)", field=why.field)

    async def stats(self) -> NodeStats:
        cpu, mem, n = self.table.held.totals()
        node, cfg = self.node, self.node.cfg
        return NodeStats(
            edge=node.name, healthy=True, cpus=node.cpus, vm=node.vms.node_info(), network=node.network_status,
            density={**node.density, "pressure": memory.pressure(), "pause_below_mb": cfg.pause_below_mb,
                     "admit_max_psi": cfg.admit_max_psi},
            backends=[Backend.container, *([Backend.microvm, Backend.vm] if node.vms.available and not node.hollow
                                           else [])],
            hollow=node.hollow is not None,
            memory_mb=node.memory_mb, cpu_overcommit=cfg.cpu_overcommit,
            memory_overcommit=cfg.memory_overcommit, sandboxes=n, cpu_reserved=cpu,
            memory_reserved_mb=mem, max_sandboxes=cfg.max_sandboxes, per_job=self.table.held.per_job(),
            signals=node.signals.read(node.volume.mnt if node.volume.available else cfg.data_dir),
            cordoned=node.signals.cordon is not None, host=node.host_load.read())

    async def usage(self, sandbox_id: str) -> SandboxUsage:
        sb = self.lifecycle.check(Op.USAGE, sandbox_id)
        assert sb is not None
        return await asyncio.to_thread(self.usage_of, sb, 0.0)

    async def list_sandboxes(self, job: str | None = None, labels: dict[str, str] | None = None,
                             usage: bool = False) -> list[SandboxInfo]:
        out = []
        for sb in list(self.table.sandboxes.values()):
            info = sb.rec.info
            if job is not None and info.job != job:
                continue
            if labels and any(info.labels.get(k) != v for k, v in labels.items()):
                continue
            if usage:
                info = info.model_copy(update={"usage": await asyncio.to_thread(self.usage_of, sb)})
            out.append(info)
        return out

    async def usage_many(self, sandbox_ids: list[str]) -> dict[str, SandboxUsage]:
        """The usage of those of ``sandbox_ids`` that live here, read in one go (a console
        page's); the others are left out."""
        live = self.table.sandboxes
        sbs = [sb for sid in sandbox_ids[:MAX_PAGE] if (sb := live.get(sid)) is not None and not sb.stopping]
        return await asyncio.to_thread(lambda: {sb.id: self.usage_of(sb) for sb in sbs})

    def usage_of(self, sb: Sandbox, disk_max_age: float = 30.0) -> SandboxUsage:
        cg = self.node.cgroup(sb)
        use = cgroup_usage(cg)
        mem = memory.cgroup_memory(cg)
        when, disk = sb.disk
        backend = self.node.backend_of(sb)
        if (qgroup := backend.disk_quota(sb)) is not None and disk_max_age > 0:  # cheap, at most 5 s old (scrapes)
            disk = self.node.volume.referenced(qgroup, qgroup).get(qgroup, disk)
        elif time.monotonic() - when > disk_max_age:  # asked for now: walk the tree
            disk = memory.disk_usage(backend.disk_path(sb))
            sb.disk = (time.monotonic(), disk)
        return SandboxUsage(cpu_s=use.get("cpu_ns", 0) / 1e9, memory_bytes=mem.get("total", 0),
                            anon_bytes=mem.get("anon", 0), file_bytes=mem.get("file", 0),
                            swap_bytes=mem.get("swap", 0), pids=use.get("pids", 0), disk_bytes=disk,
                            oom_kills=memory.oom_kills(cg))

    async def query_sandboxes(self, query: SandboxQuery) -> SandboxPage:
        """This edge's answer to a console query (dsec.shared.query). An order by CPU or
        memory ranks by the two cgroup files of each match (the items carry those values, which
        the merge orders by); the usage shown is read by the apiserver for its final page alone."""
        live = list(self.table.sandboxes.values())
        if needs_usage(query):  # ranked by CPU time and memory alone: two cgroup files per sandbox
            hits = [sb for sb in live if matches(sb.rec.info, query)]
            ranked = await self._ranked(hits)
            page = answer([sb.rec.info.model_copy(update={"usage": ranked.get(sb.id)}) for sb in hits], query)
        else:
            page = answer([sb.rec.info for sb in live], query)
        return page

    async def _ranked(self, hits: list[Sandbox]) -> dict[str, SandboxUsage]:
        """CPU time and memory of ``hits``, read at most once a second whoever asks (every
        ``dsec top`` and console sorting by CPU shares one read of the node's cgroups)."""
        if self._rank_lock is None:
            self._rank_lock = asyncio.Lock()
        async with self._rank_lock:
            fresh = time.monotonic() - self._rank_at < RANK_TTL_S
            missing = [sb for sb in hits if not fresh or sb.id not in self._rank]
            if missing:
                read = await asyncio.to_thread(lambda: {sb.id: self._rank_usage(sb) for sb in missing})
                self._rank = {**self._rank, **read} if fresh else read
                if not fresh:
                    self._rank_at = time.monotonic()
            return self._rank

    def _rank_usage(self, sb: Sandbox) -> SandboxUsage:
        use = cgroup_usage(self.node.cgroup(sb))
        return SandboxUsage(cpu_s=use.get("cpu_ns", 0) / 1e9, memory_bytes=use.get("memory_bytes", 0), disk_bytes=0,
                            oom_kills=0)

    async def storage_stats(self) -> StorageStats:
        await self.node.node_layers.fresh_snapshot()
        return self.storage_stats_now()

    def storage_stats_now(self) -> StorageStats:
        snap = self.node.node_layers.snapshot
        cache = snap.get("cache", {})
        refs: dict[str, list[str]] = {}
        for layer in self.node.layers.list():
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
            edge=self.node.name, backend=self.node.layers.backend.kind, mode=self.node.cfg.fetch_mode,
            cache_bytes=cache.get("bytes", 0), cache_max_bytes=cache.get("max_bytes", 0),
            cache_entries=cache.get("entries", 0), cache_evictions=cache.get("evictions", 0),
            cache_corrupt=cache.get("corrupt", 0), cache_written_bytes=cache.get("written_bytes", 0),
            copied_bytes=self.node.node_layers.copied_bytes, blobs=blobs)

    async def layers_in_use(self) -> set[str]:
        return {d for sb in self.table.sandboxes.values() if not sb.stopping for d in sb.rec.digests}

    async def release_layers(self) -> None:
        """Unmount layer images no sandbox on this edge uses any more."""
        await self.node.node_layers.release(await self.layers_in_use())
