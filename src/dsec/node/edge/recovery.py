"""An edge's restart: take back the sandboxes the previous edge left (each bounded, all
at once), finish the stops it died in, and sweep what no record owns."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from dsec.node.agent.aether import Aether, AgentContext
from dsec.node.edge.cmdlog import CommandLog
from dsec.node.edge.core import EdgeNode
from dsec.node.edge.inplace import sweep as inplace_sweep
from dsec.node.edge.lifecycle import Lifecycle
from dsec.node.edge.sandbox import READOPT_CONCURRENCY, READOPT_TIMEOUT_S, Sandbox, explain
from dsec.node.edge.state import Record
from dsec.node.edge.table import SandboxTable
from dsec.node.edge.teardown import Teardown
from dsec.node.host import linux
from dsec.shared.errors import (
    DsecError,
    SandboxError,
)
from dsec.shared.wire.models import SandboxState

log = logging.getLogger("dsec.edge")


class Recovery:
    """Re-adoption after a restart."""

    def __init__(self, node: EdgeNode, table: SandboxTable, lifecycle: Lifecycle, teardown: Teardown,
                 cmdlog: CommandLog) -> None:
        self.node = node
        self.volume, self.layers = node.volume, node.layers
        self.table = table
        self.lifecycle = lifecycle
        self.teardown = teardown
        self.cmdlog = cmdlog

    async def recover(self) -> None:
        """Take back the sandboxes a previous edge left, all at once, each bounded: one that
        cannot be re-adopted in time is torn down as failed with the reason, and never
        holds the others or the edge's start."""
        if n := self.cmdlog.interrupt_all():
            log.warning("%d keyed command(s) were running when the edge went down: recorded as interrupted", n)
        live = {r.info.sandbox_id: r for r in self.table.state.live()}
        known = await self.node.containers.known() | await self.node.vm_sandboxes.known()
        gate = asyncio.Semaphore(READOPT_CONCURRENCY)

        async def one(sid: str, rec: Record) -> None:
            sb = self.table.sandboxes[sid] = Sandbox(rec, os.path.join(self.node.sandbox_root, sid))
            self.table.held.update(sb)
            if rec.info.state == SandboxState.stopping:  # the edge died in its stop: finish it
                await self.teardown.teardown(sb, SandboxState.stopped, "stopped (finished after an edge restart)")
                return
            async with gate:
                try:
                    async with asyncio.timeout(READOPT_TIMEOUT_S):
                        await self._readopt(sb, sid in known)
                    return
                except TimeoutError:
                    why = f"not re-adopted within {READOPT_TIMEOUT_S:g} s after an edge restart"
                except (DsecError, OSError, ValueError) as e:
                    why = f"lost while the edge was down: {explain(e)}"
            log.warning("sandbox %s: %s", sid, why)
            await self.teardown.teardown(sb, SandboxState.failed, why)

        await asyncio.gather(*(one(sid, rec) for sid, rec in live.items()))
        for name in await self.node.containers.reap_strays(set(self.table.sandboxes)):
            log.warning("removed a container no sandbox owns: %s", name)
        for name in await self.node.vm_sandboxes.reap_strays(set(self.table.sandboxes)):
            log.warning("killed a QEMU no sandbox owns: %s", name)
        for mp in linux.mounted_under(self.node.sandbox_root):
            sid = os.path.basename(os.path.dirname(mp))
            if sid not in self.table.sandboxes or self.table.sandboxes[sid].stopping:
                with contextlib.suppress(OSError):
                    linux.umount(mp, detach=True)
        for name in os.listdir(self.node.sandbox_root):
            if name not in self.table.sandboxes:
                await asyncio.to_thread(self.volume.remove, os.path.join(self.node.sandbox_root, name))
        left = set(self.table.sandboxes)
        if self.volume.available and (n := await asyncio.to_thread(inplace_sweep, self.volume, left)):
            log.warning("dropped %d in-place snapshot(s) of sandboxes that ended while the edge was down", n)
        self.table.state.prune()

    async def _readopt(self, sb: Sandbox, known_to_runtime: bool) -> None:
        """Re-adopt one sandbox through its backend, or raise why it cannot be."""
        sid, rec = sb.id, sb.rec
        if rec.info.state == SandboxState.creating:
            raise SandboxError("the edge restarted while it was being created")
        adopted = await self.node.backend_of(sb).adopt(sb, known_to_runtime)
        if adopted.running and adopted.link is not None:
            await self.lifecycle.bind_agent(sb, adopted.link)
        elif adopted.link is not None:  # paused with a link (a VM's guest channel): bound when it resumes
            sb.agent = Aether(AgentContext(sb.id, 0, {}, rec.args.workdir), adopted.link.init, adopted.link.files)
        if rec.info.network is not None:
            await self.node.network.readopt(sid, rec.info.network)
        if not adopted.running:
            log.info("re-adopted paused sandbox %s", sid)
            return
        rec.info.state = SandboxState.running
        rec.info.paused_at = None
        self.table.held.update(sb)
        self.table.state.put(rec)
        log.info("re-adopted %s sandbox %s", rec.args.backend, sid)
