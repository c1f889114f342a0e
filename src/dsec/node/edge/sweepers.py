"""The edge's periodic work: TTLs and lifetimes, memory pressure, disk quotas, limit
events, and the audit sweep."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

from dsec.node.edge.auditing import Auditing
from dsec.node.edge.checkpointing import Checkpointing
from dsec.node.edge.cmdlog import CommandLog
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.lifecycle import Lifecycle
from dsec.node.edge.sandbox import Sandbox
from dsec.node.edge.table import SandboxTable
from dsec.node.edge.teardown import Teardown
from dsec.node.host import memory
from dsec.shared.errors import (
    SandboxBusy,
    SandboxError,
)
from dsec.shared.wire.models import (
    ContainerArgs,
    SandboxState,
)

LIMITS_ACTIVE_S, LIMITS_IDLE_S = 10.0, 5.0
RECOUNT_S = 600.0  # the reservations summed from scratch, against a missed update
log = logging.getLogger("dsec.edge")


class Sweepers:
    """One loop, every ttl_check_interval_s (:meth:`start` and :meth:`close`)."""

    def __init__(self, node: EdgeNode, table: SandboxTable, lifecycle: Lifecycle, teardown: Teardown,
                 auditing: Auditing, checkpointing: Checkpointing, cmdlog: CommandLog) -> None:
        self.node = node
        self.table = table
        self.lifecycle = lifecycle
        self.teardown = teardown
        self.auditing = auditing
        self.checkpointing = checkpointing
        self.cmdlog = cmdlog
        self._task: asyncio.Task[None] | None = None
        self._recounted = 0.0
        self._quota_checked = 0.0
        self._audit_swept = 0.0

    def start(self) -> None:
        self._task = asyncio.create_task(self._ttl_loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def flush_activity(self) -> None:
        """Every sandbox's last activity to its record (at close; the sweep does it per visit)."""
        for sb in self.table.sandboxes.values():
            if sb.dirty and not sb.stopping:
                sb.dirty = False
                self.table.state.touch(sb.id, sb.rec.info.last_active_at)

    async def _relieve_pressure(self) -> None:
        """Below ``pause_below_mb`` available, pause the longest-idle best-effort container
        (idle: no request for 5 s) before the kernel's OOM killer has to pick something.
        Latency-sensitive sandboxes (FnCall's pool containers among them), busy ones and
        VMs are left alone; not by a label, which a tenant could set too. One per tick."""
        avail = memory.pressure().get("available_mb", float("inf"))
        if avail >= self.node.cfg.pause_below_mb:
            return
        now = time.time()
        idle = sorted((sb for sb in self.table.sandboxes.values()
                       if isinstance(sb.rec.args, ContainerArgs) and sb.rec.args.qos == "best_effort"
                       and sb.rec.info.state == SandboxState.running and not sb.stopping and sb.agent
                       and not sb.ops and now - sb.rec.info.last_active_at > 5),
                      key=lambda sb: sb.rec.info.last_active_at)
        if idle:
            sb = idle[0]
            with contextlib.suppress(SandboxBusy, SandboxError):
                await self.lifecycle.pause(sb.id)
                self.node.on_event(sb.id, "pressure", f"paused: the node had {avail:.0f} MiB available, "
                              f"below {self.node.cfg.pause_below_mb} MiB")

    def _limit_events(self, sb: Sandbox) -> None:
        """Events for a sandbox running into its own limits (memory, pids, CPU quota)."""
        cg, args = self.node.cgroup(sb), sb.rec.args
        sb.memory_held_mb = memory.cgroup_memory(cg).get("total", 0) >> 20
        self.table.held.update(sb)
        # pressure inside its own limit is its own business: an event, never a node-wide refusal
        fails = memory.memory_failures(cg)
        if fails > sb.memfail_seen and time.monotonic() - sb.memfail_reported > 60 and sb.memfail_seen:
            self.node.on_event(sb.id, "memory_pressure", f"at its {args.memory_limit_mb} MiB limit: the kernel "
                          f"reclaimed its memory {fails - sb.memfail_seen} time(s) since the last look")
            sb.memfail_reported = time.monotonic()
        sb.memfail_seen = fails
        kills = memory.oom_kills(cg)
        if kills > sb.oom_seen:
            self.node.on_event(sb.id, "oom_killed", f"{kills - sb.oom_seen} process(es) killed at the "
                          f"{args.memory_limit_mb} MiB limit (OOM inside the sandbox only)")
            sb.oom_seen = kills
        refused = memory.pids_limit_hits(cg)
        if refused > sb.pids_seen:
            if isinstance(args, ContainerArgs) and time.monotonic() - sb.pids_reported > 10:
                self.node.on_event(sb.id, "pids_limit", f"{refused - sb.pids_seen} fork(s) refused at the "
                              f"{args.pids_limit}-process limit")
                sb.pids_reported = time.monotonic()
            sb.pids_seen = refused
        now, throttled = time.monotonic(), memory.cpu_throttled_s(cg)
        then, before = sb.cpu_seen
        if now - then >= 10:
            if then and throttled - before > 0.3 * (now - then) and now - sb.cpu_reported > 60:
                self.node.on_event(sb.id, "cpu_throttled", f"held at its {args.cpu_cores_limit} CPU limit "
                              f"{100 * (throttled - before) / (now - then):.0f}% of the last {now - then:.0f} s")
                sb.cpu_reported = now
            sb.cpu_seen = (now, throttled)

    async def _audit_sweep(self) -> float | None:
        """Every 10 s: write buffered audit records; returns since when a sandbox that served
        requests is due for the file detectors (the round's pass runs them), or None when no
        audit is due. An idle fleet costs nothing there (an audit query runs the detectors
        of its sandbox in any case)."""
        since, now = self._audit_swept - 1, time.time()
        if now - self._audit_swept < 10:
            return None
        self._audit_swept = now
        await asyncio.to_thread(self.node.audit.flush)
        self.cmdlog.sweep(set(self.table.sandboxes))  # ended sandboxes' command logs go with their tombstones
        if random.random() < 0.01:
            await asyncio.to_thread(self.node.audit.prune)
        return since

    async def _check_disk_quotas(self) -> None:
        """Report a sandbox whose writable layer reached its quota (once per filling)."""
        if time.monotonic() - self._quota_checked < 5:
            return
        self._quota_checked = time.monotonic()
        quota = [(sb, q) for sb in self.table.sandboxes.values()
                 if not sb.stopping and (q := self.node.backend_of(sb).disk_quota(sb)) is not None]
        if not quota:
            return
        used = await asyncio.to_thread(self.node.volume.referenced)
        for sb, qgroup in quota:
            limit = sb.rec.args.disk_limit_mb << 20 if isinstance(sb.rec.args, ContainerArgs) else 0
            n = used.get(qgroup, 0)
            if not sb.quota_full and limit and n >= limit * 0.95:
                sb.quota_full = True
                self.node.on_event(sb.id, "disk_quota", f"writable layer full: {n >> 20} of {limit >> 20} MiB "
                              "(writes fail with EDQUOT)")
            elif sb.quota_full and n < limit * 0.8:
                sb.quota_full = False

    async def _ttl_loop(self) -> None:
        while True:
            await asyncio.sleep(self.node.cfg.ttl_check_interval_s)
            try:
                await self._sweep_round()
            except Exception:
                log.exception("TTL sweep failed")

    async def _sweep_round(self) -> None:
        await self._relieve_pressure()
        await self._check_disk_quotas()
        audit_since = await self._audit_sweep()
        if time.monotonic() - self._recounted >= RECOUNT_S:
            self._recounted = time.monotonic()
            self.table.held.recount(self.table.sandboxes.values())
        # one pass a round over the sandboxes (activity, limits, checkpoints, TTLs), one clock
        # read, names bound once: at a node's density this loop visits thousands of mostly
        # idle sandboxes (~1-3 us each; five passes a round were most of the hollow fleet's
        # CPU at 230K sandboxes, bench/scale.py)
        now, mono, limits = time.time(), time.monotonic(), self.node.hollow is None
        paused, running = SandboxState.paused, SandboxState.running
        for sb in list(self.table.sandboxes.values()):
            if sb.stopping:
                continue
            args, info = sb.rec.args, sb.rec.info
            if sb.dirty:  # its last activity, to its record
                sb.dirty = False
                self.table.state.touch(sb.id, info.last_active_at)
            state = info.state
            if sb.agent is None and state != paused:
                continue
            if audit_since is not None and state == running and (sb.ops or info.last_active_at >= audit_since):
                await self.auditing.run_detectors(sb)
            # its limit events (five cgroup reads): every round while it was active in the last
            # LIMITS_ACTIVE_S, else every LIMITS_IDLE_S. At a node's density most sandboxes idle,
            # and reading every one every second cost more than the rest of the edge (bench/scale.py)
            # (a hollow edge's sandboxes have no cgroup to read: docs/scale.md)
            if limits and state == running and (
                    now - info.last_active_at < LIMITS_ACTIVE_S or mono - sb.limits_at >= LIMITS_IDLE_S):
                sb.limits_at = mono
                self._limit_events(sb)
            if state == running:
                self.checkpointing.schedule(sb, now)
            if state == paused:  # idle by definition: lifetime and paused TTL only
                if args.max_lifetime_s and now - info.created_at > args.max_lifetime_s \
                        and args.on_expiry == "stop":
                    await self.teardown.teardown(sb, SandboxState.stopped, "max lifetime reached")
                elif args.ttl_paused_stop and now - (info.paused_at or now) > args.ttl_paused_stop:
                    await self.teardown.teardown(sb, SandboxState.stopped, "paused too long (ttl_paused_stop)")
                continue
            if sb.ops:
                info.last_active_at = now
            if args.max_lifetime_s and now - info.created_at > args.max_lifetime_s:
                if args.on_expiry == "pause":
                    with contextlib.suppress(SandboxBusy, SandboxError):
                        await self.lifecycle.pause(sb.id)
                else:
                    await self.teardown.teardown(sb, SandboxState.stopped, "max lifetime reached")
            elif args.ttl_running_stop and now - info.last_active_at > args.ttl_running_stop:
                await self.teardown.teardown(sb, SandboxState.stopped, "idle timeout (ttl_running_stop)")
            elif args.ttl_running_pause and now - info.last_active_at > args.ttl_running_pause:
                with contextlib.suppress(SandboxBusy, SandboxError):
                    await self.lifecycle.pause(sb.id)
