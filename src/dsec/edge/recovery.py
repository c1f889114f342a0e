"""An edge's restart: take back the sandboxes the previous edge left (each bounded, all
at once), finish the stops it died in, and sweep what no record owns."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from dsec.agent.aether import (
    Aether,
    AgentContext,
)
from dsec.backends.vm.channel import GuestChannel, GuestFiles
from dsec.edge.core import EdgeCore
from dsec.edge.sandbox import KILL_TIMEOUT_S, READOPT_CONCURRENCY, READOPT_TIMEOUT_S, Sandbox, alive, explain
from dsec.edge.state import Record
from dsec.errors import (
    DsecError,
    SandboxError,
)
from dsec.host import linux
from dsec.host.cgroup import Cgroup
from dsec.wire.models import SandboxState

log = logging.getLogger("dsec.edge")


class Recovery(EdgeCore):
    """Re-adoption after a restart."""

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
                    why = f"lost while the edge was down: {explain(e)}"
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
        if not in_crun or not alive(rec.init_pid):
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
