"""VM sandboxes on an edge (microVM and full VM): QEMU booting the guest kernel with the
layer images as read-only disks and an ext4 upper disk, or cloned from a template's
shared RAM; pause writes guest RAM and devices to a snapshot and ends QEMU; the agent is
reached over the VM's channel. Implements :class:`dsec.node.backends.api.SandboxRuntime`; its
state of a sandbox is a :class:`VMState`."""

from __future__ import annotations

import asyncio
import os
import shutil
from dataclasses import dataclass

from dsec.node.backends.api import Adopted, BackendState, InitLink, Launched, Sandbox, SandboxLost
from dsec.node.backends.vm.channel import GuestChannel, GuestFiles
from dsec.node.backends.vm.display import VMDisplay
from dsec.node.backends.vm.runtime import SnapshotError, VMInstance, VMRuntime
from dsec.node.storage.node import NodeLayers
from dsec.shared import tracing
from dsec.shared.errors import SandboxError
from dsec.shared.wire.models import MicroVMArgs, SandboxState, VMArgs, VMInfo

BOOT_TIMEOUT_S = 180


@dataclass
class VMState(BackendState):
    vm: VMInstance
    restore: dict[str, str] | None = None  # restored from a checkpoint (state, meta, disk) or a branch image
    channel: GuestChannel | None = None  # the guest agent's, from its launch until connect takes it


class VMSandboxes:
    def __init__(self, node_layers: NodeLayers, data_dir: str, run_dir: str, cgroup_parent: str) -> None:
        self.node_layers = node_layers
        self.vms = VMRuntime(data_dir, run_dir, cgroup_parent)

    def cgroup_path(self, sandbox_id: str) -> str:
        return self.vms.cgroup_path(sandbox_id)

    @staticmethod
    def _args(sb: Sandbox) -> MicroVMArgs | VMArgs:
        assert isinstance(sb.rec.args, MicroVMArgs | VMArgs)
        return sb.rec.args

    @staticmethod
    def _state(sb: Sandbox) -> VMState:
        assert isinstance(sb.state, VMState)
        return sb.state

    @staticmethod
    def _vm(sb: Sandbox) -> VMInstance:
        return VMSandboxes._state(sb).vm

    async def prepare(self, sb: Sandbox, digests: list[str], restore: dict[str, str] | None = None
                      ) -> list[tuple[str, str]]:
        args = self._args(sb)
        os.makedirs(sb.dir, exist_ok=True)
        machine = "microvm" if isinstance(args, MicroVMArgs) else "q35"
        with tracing.span("vm.spec", sandbox_id=sb.id, machine=machine, layers=len(digests)):
            files = [await self.node_layers.image_files(d) for d in digests]
            display = isinstance(args, VMArgs) and args.display
            spec = await self.vms.make_spec(machine, args.vcpus, args.memory_mb, files,
                                            os.path.join(sb.dir, "upper.img"), display)
        sb.state = VMState(VMInstance(sb.id, sb.dir, self.vms.sock_dir, spec), restore)
        return []

    async def launch(self, sb: Sandbox, digests: list[str]) -> Launched:
        args, state = self._args(sb), self._state(sb)
        vm = state.vm
        if state.restore is not None and "branch" in state.restore:
            with tracing.span("vm.branch_child", sandbox_id=sb.id):
                ch = await self.vms.branch_child(vm, state.restore, sb.id)
            state.channel = ch
            self.vms.save_spec(vm)
            return Launched(vm.pid, VMInfo(
                machine=vm.spec.machine, accelerator=vm.spec.accel, vcpus=args.vcpus, memory_mb=args.memory_mb,
                disk_mb=args.disk_mb, started_from="branch", clone_s=vm.timings.get("clone_s")))
        if state.restore is not None:
            return await self._from_checkpoint(sb, vm, args, digests, state.restore)
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
        state.channel = ch
        self.vms.save_spec(vm)
        return Launched(vm.pid, VMInfo(
            machine=vm.spec.machine, accelerator=vm.spec.accel, vcpus=args.vcpus, memory_mb=args.memory_mb,
            disk_mb=args.disk_mb, started_from="template" if args.template else "boot",
            boot_s=vm.timings.get("boot_s"), clone_s=vm.timings.get("clone_s")))

    async def connect(self, sb: Sandbox) -> InitLink:
        state = self._state(sb)
        ch, state.channel = state.channel, None
        assert ch is not None, "connect before launch"
        return InitLink(ch, GuestFiles(ch))

    async def _from_checkpoint(self, sb: Sandbox, vm: VMInstance, args: MicroVMArgs | VMArgs, digests: list[str],
                               files: dict[str, str]) -> Launched:
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
        self._state(sb).channel = vm.channel
        self.vms.save_spec(vm)
        return Launched(vm.pid, VMInfo(
            machine=vm.spec.machine, accelerator=vm.spec.accel, vcpus=args.vcpus, memory_mb=args.memory_mb,
            disk_mb=args.disk_mb, started_from="checkpoint", restore_s=vm.timings.get("restore_s")))

    async def pause(self, sb: Sandbox) -> str:
        vm = self._vm(sb)
        meta = await self.vms.pause(vm)
        if sb.rec.info.vm:
            sb.rec.info.vm.pause_s = vm.timings.get("pause_s")
            sb.rec.info.vm.snapshot_bytes = meta["size"]
        return f"snapshot {meta['size'] >> 20} MiB in {vm.timings.get('pause_s', 0):.2f} s; QEMU ended"

    async def resume(self, sb: Sandbox) -> tuple[str, InitLink | None]:
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
        link = None
        if fresh and vm.channel:  # paused across an edge restart: a new agent binding
            link = InitLink(vm.channel, GuestFiles(vm.channel))
        return f"restored in {vm.timings.get('restore_s', 0):.2f} s", link

    async def branch_image(self, sb: Sandbox, work: str) -> dict[str, str]:
        """The running VM captured into ``work`` (VMRuntime.branch_image): children share
        its RAM copy on write; it runs on."""
        os.makedirs(work)
        try:
            return await self.vms.branch_image(self._vm(sb), work)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, work, True))
            raise

    async def released(self, restore: dict[str, str]) -> None:
        # each child holds its own link to the RAM file and its own disk: the image's go
        await asyncio.to_thread(shutil.rmtree, restore["branch"], True)

    async def kill(self, sb: Sandbox) -> None:
        if isinstance(sb.state, VMState):  # (none: a record taken back only to be torn down)
            await self.vms.destroy(sb.state.vm)

    async def destroy(self, sb: Sandbox) -> None:
        return None  # QEMU is gone with its sockets; its files go with the sandbox's dir

    async def known(self) -> set[str]:
        return set()  # each VM's spec file, read at adopt, says whether it can be taken back

    async def adopt(self, sb: Sandbox, known_to_runtime: bool) -> Adopted:
        """A running QEMU is reconnected (the guest's agent drops the old edge's channels,
        so sessions start afresh); a paused one stays paused with its snapshot."""
        vm = self.vms.load(sb.id, sb.dir)
        sb.state = VMState(vm)
        if sb.rec.info.state == SandboxState.paused:
            if not os.path.exists(vm.snapshot):
                raise SandboxError("paused VM's snapshot is gone")
            ch = GuestChannel(vm.agent_sock)
            return Adopted(running=False, link=InitLink(ch, GuestFiles(ch)))
        if not self.vms.is_qemu(sb.rec.init_pid):
            raise SandboxError("its QEMU is gone")
        ch = await self.vms.adopt(vm, sb.rec.init_pid)
        return Adopted(running=True, link=InitLink(ch, GuestFiles(ch)))

    async def reap_strays(self, known: set[str]) -> list[str]:
        return list(await self.vms.reap_strays(known))

    def detach(self, sb: Sandbox) -> None:
        if isinstance(sb.state, VMState) and sb.state.vm.qmp is not None:
            sb.state.vm.qmp.close()
            sb.state.vm.qmp = None

    # ---- questions ---------------------------------------------------------------------
    def host_pid(self, sb: Sandbox) -> int | None:
        return None  # QEMU's root is the host's; the guest's processes are the guest kernel's

    def writable_dir(self, sb: Sandbox) -> str | None:
        return None  # its writes are on its own ext4 disk

    def disk_path(self, sb: Sandbox) -> str:
        return sb.state.vm.spec.disks[0].path if isinstance(sb.state, VMState) else os.path.join(sb.dir, "upper")

    def disk_quota(self, sb: Sandbox) -> int | None:
        return None

    def snapshot_files(self, sb: Sandbox) -> dict[str, str] | None:
        vm = self._vm(sb)
        return {"state": vm.snapshot, "meta": vm.snapshot_meta, "disk": vm.spec.disks[0].path}

    def display(self, sb: Sandbox) -> VMDisplay | None:
        if not isinstance(sb.state, VMState) or not sb.state.vm.spec.display:
            return None
        return VMDisplay(sb.state.vm)

    def agent_lost(self, sb: Sandbox) -> str:
        return "VM agent channel lost (QEMU or the guest's agent ended)"
