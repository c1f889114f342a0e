"""VM sandboxes on an edge (microVM and full VM): QEMU booting the guest kernel with the
layer images as read-only disks and an ext4 upper disk, or cloned from a template's
shared RAM; pause writes guest RAM and devices to a snapshot and ends QEMU; the agent is
reached over the VM's channel. Implements :class:`dsec.backends.api.SandboxRuntime`."""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

from dsec import tracing
from dsec.agent.aether import Aether, AgentContext
from dsec.backends.api import SandboxLost
from dsec.backends.vm.channel import GuestChannel, GuestFiles
from dsec.backends.vm.runtime import SnapshotError, VMInstance, VMRuntime
from dsec.errors import SandboxError
from dsec.wire.models import MicroVMArgs, SandboxState, VMArgs, VMInfo

if TYPE_CHECKING:
    from dsec.backends.api import BackendHost
    from dsec.edge.sandbox import Sandbox

BOOT_TIMEOUT_S = 180


class VMSandboxes:
    def __init__(self, host: BackendHost, data_dir: str, run_dir: str, cgroup_parent: str) -> None:
        self.host = host
        self.vms = VMRuntime(data_dir, run_dir, cgroup_parent)

    def cgroup_path(self, sandbox_id: str) -> str:
        return self.vms.cgroup_path(sandbox_id)

    @staticmethod
    def _args(sb: Sandbox) -> MicroVMArgs | VMArgs:
        assert isinstance(sb.rec.args, MicroVMArgs | VMArgs)
        return sb.rec.args

    @staticmethod
    def _vm(sb: Sandbox) -> VMInstance:
        assert sb.vm is not None
        return sb.vm

    async def prepare(self, sb: Sandbox, digests: list[str]) -> None:
        args = self._args(sb)
        os.makedirs(sb.dir, exist_ok=True)
        machine = "microvm" if isinstance(args, MicroVMArgs) else "q35"
        with tracing.span("vm.spec", sandbox_id=sb.id, machine=machine, layers=len(digests)):
            files = [await self.host.node_layers.image_files(d) for d in digests]
            display = isinstance(args, VMArgs) and args.display
            spec = await self.vms.make_spec(machine, args.vcpus, args.memory_mb, files,
                                            os.path.join(sb.dir, "upper.img"), display)
        sb.vm = VMInstance(sb.id, sb.dir, self.vms.sock_dir, spec)

    async def start(self, sb: Sandbox, digests: list[str]) -> None:
        args, vm = self._args(sb), self._vm(sb)
        if sb.from_vm is not None:
            await self._from_checkpoint(sb, vm, args, digests, sb.from_vm)
            return
        if args.template:
            key = self.vms.template_key(vm.spec, digests, args.disk_mb)
            with tracing.span("vm.template", sandbox_id=sb.id, template=key[:12]):  # booted once per shape
                tdir = await self.vms.ensure_template(key, vm.spec, args.disk_mb, timeout=BOOT_TIMEOUT_S)
            with tracing.span("vm.clone", sandbox_id=sb.id):
                ch = await self.vms.clone(vm, tdir, sb.id)
        else:
            with tracing.span("vm.upper", sandbox_id=sb.id, disk_mb=args.disk_mb):
                await self.vms.make_upper(os.path.join(sb.dir, "upper.img"), args.disk_mb)
            with tracing.span("vm.boot", sandbox_id=sb.id):
                ch = await self.vms.boot(vm, sb.id, timeout=BOOT_TIMEOUT_S)
        sb.rec.init_pid = vm.pid
        self.vms.save_spec(vm)
        sb.rec.info.vm = VMInfo(
            machine=vm.spec.machine, accelerator=vm.spec.accel, vcpus=args.vcpus, memory_mb=args.memory_mb,
            disk_mb=args.disk_mb, started_from="template" if args.template else "boot",
            boot_s=vm.timings.get("boot_s"), clone_s=vm.timings.get("clone_s"))
        with tracing.span("agent.attach", sandbox_id=sb.id):
            await self.host.bind_agent(sb, ch, GuestFiles(ch))

    async def _from_checkpoint(self, sb: Sandbox, vm: VMInstance, args: MicroVMArgs | VMArgs, digests: list[str],
                               files: dict[str, str]) -> None:
        """Start a VM from another edge's checkpoint: its disk and memory snapshot copied
        here, a clone's RAM file mapped from this edge's template of the same shape (the
        stream carries every page), QEMU restored from the snapshot, the guest running on."""
        if args.template:  # the snapshot was taken of a clone: the same memory backend here
            key = self.vms.template_key(vm.spec, digests, args.disk_mb)
            tdir = await self.vms.ensure_template(key, vm.spec, args.disk_mb, timeout=BOOT_TIMEOUT_S)
            vm.spec.mem_path, vm.spec.mem_shared = os.path.join(tdir, "ram"), False
        for src, dst in ((files["disk"], vm.spec.disks[0].path), (files["state"], vm.snapshot)):
            # a sparse tar of the file under the name the VM's dir gives it (edge.checkpointing)
            proc = await asyncio.create_subprocess_exec("tar", "-xSf", src, "-C", os.path.dirname(dst),
                                                        os.path.basename(dst), stderr=asyncio.subprocess.PIPE)
            _, err = await proc.communicate()
            if proc.returncode != 0 or not os.path.exists(dst):
                raise SandboxError(f"checkpoint file not copied here: {err.decode(errors='replace').strip()}")
        with open(vm.snapshot_meta, "w") as f:
            f.write(files["meta"])
        try:
            await self.vms.resume(vm)
        except SnapshotError as e:
            raise SandboxError(f"the checkpoint does not restore here: {e}") from None
        assert vm.channel is not None
        sb.rec.init_pid = vm.pid
        self.vms.save_spec(vm)
        sb.rec.info.vm = VMInfo(
            machine=vm.spec.machine, accelerator=vm.spec.accel, vcpus=args.vcpus, memory_mb=args.memory_mb,
            disk_mb=args.disk_mb, started_from="checkpoint", restore_s=vm.timings.get("restore_s"))
        await self.host.bind_agent(sb, vm.channel, GuestFiles(vm.channel))

    async def pause(self, sb: Sandbox) -> str:
        vm = self._vm(sb)
        meta = await self.vms.pause(vm)
        if sb.rec.info.vm:
            sb.rec.info.vm.pause_s = vm.timings.get("pause_s")
            sb.rec.info.vm.snapshot_bytes = meta["size"]
        return f"snapshot {meta['size'] >> 20} MiB in {vm.timings.get('pause_s', 0):.2f} s; QEMU ended"

    async def resume(self, sb: Sandbox) -> str:
        vm = self._vm(sb)
        fresh = vm.channel is None
        try:
            await self.vms.resume(vm)
        except SnapshotError as e:
            raise SandboxLost(str(e)) from e
        sb.rec.init_pid = vm.pid
        if info := sb.rec.info.vm:
            info.restore_s = vm.timings.get("restore_s")
            info.snapshot_bytes = None
            info.started_from = "snapshot"
        if fresh and vm.channel:  # paused across an edge restart: a new agent binding
            await self.host.bind_agent(sb, vm.channel, GuestFiles(vm.channel))
        return f"restored in {vm.timings.get('restore_s', 0):.2f} s"

    async def kill(self, sb: Sandbox) -> None:
        if sb.vm is not None:
            await self.vms.destroy(sb.vm)

    async def destroy(self, sb: Sandbox) -> None:
        return None  # QEMU is gone with its sockets; its files go with the sandbox's dir

    async def known(self) -> set[str]:
        return set()  # each VM's spec file, read at adopt, says whether it can be taken back

    async def adopt(self, sb: Sandbox, known_to_runtime: bool) -> bool:
        """A running QEMU is reconnected (the guest's agent drops the old edge's channels,
        so sessions start afresh); a paused one stays paused with its snapshot."""
        vm = sb.vm = self.vms.load(sb.id, sb.dir)
        if sb.rec.info.state == SandboxState.paused:
            if not os.path.exists(vm.snapshot):
                raise SandboxError("paused VM's snapshot is gone")
            ch = GuestChannel(vm.agent_sock)
            sb.agent = Aether(AgentContext(sb.id, 0, {}, sb.rec.args.workdir), ch, GuestFiles(ch))
            return False
        if not self.vms.is_qemu(sb.rec.init_pid):
            raise SandboxError("its QEMU is gone")
        ch = await self.vms.adopt(vm, sb.rec.init_pid)
        await self.host.bind_agent(sb, ch, GuestFiles(ch))
        return True

    async def reap_strays(self, known: set[str]) -> list[str]:
        return list(await self.vms.reap_strays(known))
