"""Ending a sandbox, the part every stop, TTL, lost agent and failed create goes through:
kill through the cgroup (or QEMU's pid) asking nothing inside it, then release each
resource as a bounded step of its own."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable
from typing import TypeVar

from dsec.node.edge.accesslists import AccessLists
from dsec.node.edge.chains import CheckpointChains
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.inplace import drop_all, inplace_dir
from dsec.node.edge.metrics import EdgeMetrics
from dsec.node.edge.sandbox import KILL_TIMEOUT_S, STEP_TIMEOUT_S, Sandbox, explain
from dsec.node.edge.table import SandboxTable
from dsec.node.host.linux import unmount_all
from dsec.shared import tracing
from dsec.shared.faults import failpoint
from dsec.shared.wire.models import (
    ContainerArgs,
    SandboxState,
)

log = logging.getLogger("dsec.edge")
MOVED_TO = "moved to edge "  # an evicted sandbox's tombstone error: it runs there now
T = TypeVar("T")


class Teardown:
    """The one teardown every end of a sandbox goes through (a stop, a TTL, a lost agent, a
    failed create, an eviction)."""

    def __init__(self, node: EdgeNode, table: SandboxTable, chains: CheckpointChains, access: AccessLists,
                 metrics: EdgeMetrics) -> None:
        self.node = node
        self.table = table
        self.chains = chains
        self.access = access
        self.metrics = metrics
        self.tasks: set[asyncio.Task[None]] = set()  # under way: the edge's close waits for them

    async def teardown(self, sb: Sandbox, final: SandboxState, reason: str, record: bool = True) -> None:
        """Release everything of a sandbox, once. The work runs in its own task, shielded:
        a caller that is cancelled (an edge shutdown, a dropped request) cannot leave it
        half done, and :meth:`close` waits for it."""
        if sb.teardown is None:
            sb.teardown = asyncio.create_task(self._traced_release(sb, final, reason, record))
            self.tasks.add(sb.teardown)
            sb.teardown.add_done_callback(self.tasks.discard)
        await asyncio.shield(sb.teardown)

    async def _traced_release(self, sb: Sandbox, final: SandboxState, reason: str, record: bool) -> None:
        # a child of the caller's span (edge.stop) when there is one, else a trace of its own (a TTL)
        with tracing.span("edge.teardown", sandbox_id=sb.id, backend=sb.rec.args.backend, reason=reason):
            await self._release(sb, final, reason, record)

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
        self.table.held.drop(sb.id)
        if record:
            await self._bounded(sb, "record", asyncio.to_thread(self.table.state.put, sb.rec))
            await failpoint("stop.recorded")
        if sb.watch and sb.watch is not asyncio.current_task():
            sb.watch.cancel()
        await self._bounded(sb, "kill", self.node.backend_of(sb).kill(sb), KILL_TIMEOUT_S + 5)
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
            self.node.watchers.release(sb.id)
            if sb.agent:
                await self._bounded(sb, "close the agent", sb.agent.close())
                sb.agent = None
            await self._bounded(sb, "detach the network", self.node.network.detach(sb.id))
            # nothing runs in it any more: the runtime's record, the mounts and files, and the
            # checkpoints are released side by side (a stop waited for each in turn: 9 ms of 14)
            await asyncio.gather(
                self._bounded(sb, "release its runtime", self.node.backend_of(sb).destroy(sb), 2 * STEP_TIMEOUT_S),
                self._release_files(sb),
                self._bounded(sb, "forget checkpoints", asyncio.to_thread(
                    self.chains.forget, sb, sb.keep_checkpoints)))
            self.node.detectors.forget(sb.id)
            self.node.procwatch.forget(sb.id)
            self.node.denials.forget(sb.id)
            sb.rec.info.state = final
            sb.rec.info.error = None if final == SandboxState.stopped else reason
            if record:
                await self._bounded(sb, "record", asyncio.to_thread(self.table.state.put, sb.rec))
            self.table.sandboxes.pop(sb.id, None)
        finally:
            if locked:
                sb.lock.release()
        if record:
            self.metrics.stopped.labels(self.node.name, final.value).inc()
        self.node.on_event(sb.id, final.value, f"{reason} (released in {time.monotonic() - t0:.2f} s)")

    async def _release_files(self, sb: Sandbox) -> None:
        if isinstance(sb.rec.args, ContainerArgs) and sb.rec.args.record_access:
            await self._bounded(sb, "save access lists", self.access.save(sb, forget=True))
        await self._bounded(sb, "unmount", asyncio.to_thread(unmount_all, sb.dir))
        await self._bounded(sb, "remove its files", asyncio.to_thread(self.node.volume.remove, sb.dir), 60)
        if self.node.volume.available and os.path.isdir(inplace_dir(self.node.volume, sb.id)):  # (only if it took any)
            await self._bounded(sb, "drop its snapshots", asyncio.to_thread(drop_all, self.node.volume, sb.id), 60)

    async def _bounded(self, sb: Sandbox, step: str, aw: Awaitable[T], timeout: float = STEP_TIMEOUT_S) -> T | None:
        """One teardown step with a deadline; a failure is the sandbox's event, not the caller's."""
        t0 = time.monotonic()
        with tracing.span(f"teardown {step}", sandbox_id=sb.id) as span:
            try:
                async with asyncio.timeout(timeout):
                    return await aw
            except TimeoutError:
                self.node.on_event(sb.id, "teardown_error", f"{step}: no answer within {timeout:g} s")
                tracing.failed(span, f"no answer within {timeout:g} s")
            except Exception as e:  # noqa: BLE001 - reported; the other steps still run
                self.node.on_event(sb.id, "teardown_error", f"{step}: {explain(e)}")
                tracing.failed(span, explain(e))
            finally:
                if time.monotonic() - t0 > 0.5:
                    log.info("sandbox %s: teardown step %r took %.2f s", sb.id, step, time.monotonic() - t0)
        return None
