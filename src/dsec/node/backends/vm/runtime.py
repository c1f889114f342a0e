"""VM sandboxes' lifecycle on one node: disks, the QEMU process in the sandbox's
cgroup, cold boot, snapshots (pause to a checksummed file, restore), templates
(a booted VM snapshotted once per guest shape, cloned with its RAM file mapped
copy-on-write), and teardown.

The edge owns the sandbox record and the agent; this module owns only QEMU and its
files. Design notes: docs/vm.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsec.node.agent.initclient import SpawnFailed
from dsec.node.backends.vm.channel import GuestChannel
from dsec.node.backends.vm.guest import KERNEL_CMDLINE, GuestImage, ensure_guest
from dsec.node.backends.vm.qemu import DEFAULT_RAM_ID, QMP, Disk, QMPError, VMSpec, probe_accel, qemu_version
from dsec.shared import tracing
from dsec.shared.errors import SandboxError
from dsec.shared.wire.models import VM_OVERHEAD_MB

log = logging.getLogger("dsec.vm")
CGROUP_ROOT = "/sys/fs/cgroup"
SNAPSHOT_VERSION = 1


# what a clone's first commands run: the shells and a plain program, run once in the template
# before its snapshot so their files are in the guest's page cache that every clone maps
WARM_COMMANDS = (["/bin/bash", "-c", "true"], ["/bin/sh", "-c", "true"], ["true"])
WARM_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
WARM_TIMEOUT_S = 30.0


async def _warm(ch: GuestChannel) -> None:
    """Run WARM_COMMANDS in a template's guest (a missing one is skipped). Under TCG a
    clone's first exec was 225 ms, most of it reading bash and its libraries from the
    virtual disk; only the translation of their code is left to the clone."""
    for argv in WARM_COMMANDS:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            _, exited = await ch.spawn(argv, WARM_ENV, "/", [null, null, null])
        except SpawnFailed:
            continue
        finally:
            os.close(null)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(exited, WARM_TIMEOUT_S)


class SnapshotError(SandboxError):
    """A snapshot file is missing, corrupt, or made for another QEMU or machine shape."""


@dataclass
class VMInstance:
    """One VM sandbox's QEMU: its spec, files and (while it runs) process."""

    sid: str
    dir: str
    sock_dir: str
    spec: VMSpec
    pid: int = 0
    qmp: QMP | None = None
    channel: GuestChannel | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    expected_exit: bool = False
    on_exit: Callable[[VMInstance], None] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def qmp_sock(self) -> str:
        return os.path.join(self.sock_dir, f"{self.sid}.q")

    @property
    def agent_sock(self) -> str:
        return os.path.join(self.sock_dir, f"{self.sid}.a")

    @property
    def snapshot(self) -> str:
        return os.path.join(self.dir, "snapshot.state")

    @property
    def snapshot_meta(self) -> str:
        return os.path.join(self.dir, "snapshot.json")

    @property
    def running(self) -> bool:
        return self.pid != 0 and not self.exited.is_set()


class VMRuntime:
    def __init__(self, data_dir: str, run_dir: str, cgroup_parent: str) -> None:
        self.data_dir = data_dir
        self.sock_dir = os.path.join(run_dir, "v")
        os.makedirs(self.sock_dir, exist_ok=True)
        self.cgroup_parent = cgroup_parent
        self.templates_dir = os.path.join(data_dir, "vm", "templates")
        self._guests: dict[str, GuestImage] = {}
        self._accel: dict[str, Any] | None = None
        self._version: str | None = None
        self._tlocks: dict[str, asyncio.Lock] = {}
        self._prep = asyncio.Lock()

    # ---- node facts --------------------------------------------------------------
    async def guest(self, machine: str) -> GuestImage:
        async with self._prep:
            if machine not in self._guests:
                self._guests[machine] = await asyncio.to_thread(ensure_guest, self.data_dir, machine)
            if self._accel is None:
                g = self._guests[machine]
                self._accel = await asyncio.to_thread(
                    probe_accel, g.kernel, g.initrd, os.path.join(self.data_dir, "vm", "accel.json"))
                await asyncio.to_thread(lambda: self.version)
                log.info("VM accelerator: %s (%s)", self._accel["accel"], self._accel.get("kvm_probe"))
            return self._guests[machine]

    @property
    def version(self) -> str:
        """QEMU's version line: part of every snapshot's configuration fingerprint."""
        if self._version is None:
            self._version = qemu_version()
        return self._version

    @property
    def available(self) -> bool:
        return shutil.which("qemu-system-x86_64") is not None

    @property
    def accel(self) -> str:
        return self._accel["accel"] if self._accel else "unknown"

    def node_info(self) -> dict[str, Any]:
        cached = self._accel
        if cached is None:
            with contextlib.suppress(OSError, ValueError), open(os.path.join(self.data_dir, "vm", "accel.json")) as f:
                cached = json.load(f)
        info: dict[str, Any] = {
            "accelerator": cached["accel"] if cached else "not probed yet (probed at the first VM)",
            "kvm_device": os.path.exists("/dev/kvm"),
            "kvm_probe": cached.get("kvm_probe") if cached else None,
            "agent_channel": "virtio-serial",
            "vhost_vsock": os.path.exists("/dev/vhost-vsock"),
            "qemu": (cached or {}).get("key", {}).get("qemu") or self._version,
            "guest_kernel": (cached or {}).get("key", {}).get("kernel"),
        }
        if info["accelerator"] == "tcg":
            info["note"] = "TCG: guests are emulated, several times slower than KVM"
        return info

    # ---- disks and specs ------------------------------------------------------------
    async def make_spec(self, machine: str, vcpus: int, memory_mb: int, layer_files: list[tuple[str, str | None]],
                        upper: str, display: bool = False) -> VMSpec:
        g = await self.guest(machine)
        disks = [Disk(upper, "dsec-upper", readonly=False)]
        for i, (meta, data) in enumerate(layer_files):
            disks.append(Disk(meta, f"dsec-l{i}m"))
            if data and os.path.getsize(data) > 0:
                disks.append(Disk(data, f"dsec-l{i}d"))
        # a display shows the kernel console too (tty0); the serial console stays the main one
        cmdline = f"{'console=tty0 ' if display else ''}{KERNEL_CMDLINE} dsec.layers={len(layer_files)}"
        return VMSpec(machine=machine, accel=self.accel, kernel=g.kernel, initrd=g.initrd, guest=g.fingerprint,
                      vcpus=vcpus, memory_mb=memory_mb, disks=disks, cmdline=cmdline, display=display)

    @staticmethod
    async def make_upper(path: str, disk_mb: int, copy_of: str | None = None) -> None:
        """The VM's writable disk: a sparse ext4 image (or a sparse copy of a template's)."""
        if copy_of:
            cmd = ["cp", "--sparse=always", "--reflink=auto", copy_of, path]
        else:
            with open(path, "wb") as f:
                f.truncate(disk_mb << 20)
            cmd = ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard", path]
        p = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, err = await p.communicate()
        if p.returncode:
            raise SandboxError(f"cannot make the VM's disk: {err.decode(errors='replace').strip()}")

    # ---- cgroup ---------------------------------------------------------------------
    def cgroup_path(self, sid: str) -> str:
        return f"/{self.cgroup_parent}/{sid}"

    def _cgroup_dirs(self, sid: str) -> list[tuple[str, str]]:
        rel = self.cgroup_path(sid).lstrip("/")
        if os.path.exists(os.path.join(CGROUP_ROOT, "cgroup.controllers")):
            return [("v2", os.path.join(CGROUP_ROOT, rel))]
        cpu = "cpu" if os.path.isdir(os.path.join(CGROUP_ROOT, "cpu")) else "cpu,cpuacct"
        return [(ctl, os.path.join(CGROUP_ROOT, ctl, rel)) for ctl in ("memory", cpu, "pids")
                if os.path.isdir(os.path.join(CGROUP_ROOT, ctl))]

    def make_cgroup(self, sid: str, memory_mb: int, vcpus: int) -> list[str]:
        """The sandbox's cgroup with its limits; returns the cgroup.procs files to join."""
        limit = (memory_mb + VM_OVERHEAD_MB) << 20
        procs = []
        for ctl, d in self._cgroup_dirs(sid):
            os.makedirs(d, exist_ok=True)
            settings: list[tuple[str, str]] = []
            if ctl == "v2":
                parent = os.path.dirname(d)
                with contextlib.suppress(OSError), open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                    f.write("+memory +cpu +pids")
                settings = [("memory.max", str(limit)), ("memory.swap.max", "0"),
                            ("cpu.max", f"{vcpus * 100000} 100000"), ("pids.max", "64")]
            elif ctl == "memory":  # memory+swap capped too: the node's swap is for paused sandboxes
                settings = [("memory.limit_in_bytes", str(limit)), ("memory.memsw.limit_in_bytes", str(limit))]
            elif ctl.startswith("cpu"):
                settings = [("cpu.cfs_period_us", "100000"), ("cpu.cfs_quota_us", str(vcpus * 100000))]
            elif ctl == "pids":
                settings = [("pids.max", "64")]
            for name, value in settings:
                with contextlib.suppress(OSError), open(os.path.join(d, name), "w") as f:
                    f.write(value)
            procs.append(os.path.join(d, "cgroup.procs"))
        return procs

    def remove_cgroup(self, sid: str) -> None:
        for _, d in self._cgroup_dirs(sid):
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)

    # ---- process ----------------------------------------------------------------------
    async def launch(self, vm: VMInstance, incoming: bool = False) -> None:
        """Start QEMU for ``vm`` inside its cgroup and connect to its monitor."""
        for p in (vm.qmp_sock, vm.agent_sock):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        procs = self.make_cgroup(vm.sid, vm.spec.memory_mb, vm.spec.vcpus)
        argv = vm.spec.argv(vm.qmp_sock, vm.agent_sock, os.path.join(vm.dir, "console.log"), incoming)
        # join the cgroup before exec, so every page QEMU touches is charged there
        join = "".join(f"echo $$ > {shlex.quote(p)} && " for p in procs)
        log_fd = os.open(os.path.join(vm.dir, "qemu.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # not waited on: a pidfd notices the exit, also after an edge restart
            proc = subprocess.Popen(["/bin/sh", "-c", f"{join}exec \"$@\"", "qemu", *argv],  # noqa: ASYNC220
                                    stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, start_new_session=True)
        finally:
            os.close(log_fd)
        vm.pid = proc.pid
        vm.exited = asyncio.Event()
        vm.expected_exit = False
        self.watch(vm)
        vm.qmp = QMP(vm.qmp_sock)
        try:
            await vm.qmp.connect(timeout=30, alive=lambda: not vm.exited.is_set())
        except QMPError:
            await self.kill(vm)
            raise SandboxError(f"QEMU did not start: {self.qemu_log_tail(vm)}") from None

    def watch(self, vm: VMInstance) -> None:
        """Notice QEMU's exit through a pidfd (it may not be our child after an edge restart)."""
        try:
            pidfd = os.pidfd_open(vm.pid)
        except ProcessLookupError:
            vm.exited.set()
            return
        loop = asyncio.get_running_loop()

        def gone() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(vm.pid, os.WNOHANG)
            vm.exited.set()
            if vm.on_exit and not vm.expected_exit:
                vm.on_exit(vm)

        loop.add_reader(pidfd, gone)

    @staticmethod
    def qemu_log_tail(vm: VMInstance) -> str:
        with contextlib.suppress(OSError), open(os.path.join(vm.dir, "qemu.log"), "rb") as f:
            return f.read()[-600:].decode(errors="replace").strip() or "(no output)"
        return "(no log)"

    async def kill(self, vm: VMInstance, graceful: bool = False) -> None:
        """End QEMU (quit through QMP if ``graceful``, else SIGKILL) and wait for it."""
        vm.expected_exit = True
        if vm.pid and not vm.exited.is_set():
            if graceful and vm.qmp:
                with contextlib.suppress(QMPError, OSError, TimeoutError):
                    await vm.qmp.execute("quit", timeout=5)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(vm.exited.wait(), 5)
            if not vm.exited.is_set():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(vm.pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(vm.exited.wait(), 10)
        if vm.qmp:
            vm.qmp.close()
            vm.qmp = None
        vm.pid = 0
        for p in (vm.qmp_sock, vm.agent_sock):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    async def destroy(self, vm: VMInstance) -> None:
        """Everything of the VM goes: process, sockets, cgroup (its dir is the edge's)."""
        if vm.channel:
            vm.channel.close()
        await self.kill(vm)
        self.remove_cgroup(vm.sid)

    # ---- records, for an edge restart ----------------------------------------------------
    def qemus(self) -> dict[str, int]:
        """QEMU processes of this runtime (their sockets are in our socket dir): name -> pid."""
        out: dict[str, int] = {}
        marker = f"unix:{self.sock_dir}/".encode()
        for cmd in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                # the name first: it is the task's own, while reading a process's arguments
                # takes its memory map's lock and may fault its pages in from swap (seconds
                # each for a fork bomb thrashing at its memory limit)
                with open(cmd[:-7] + "comm", "rb") as f:
                    if not f.read().startswith(b"qemu-system"):
                        continue
                with open(cmd, "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if not argv or b"qemu-system" not in argv[0]:
                continue
            for a in argv:
                if a.startswith(marker) and a.endswith(b".q,server=on,wait=off"):
                    out[a[len(marker):-len(b".q,server=on,wait=off")].decode()] = int(cmd.split("/")[2])
        return out

    async def reap_strays(self, keep: set[str]) -> list[str]:
        """Kill QEMUs no record owns (a crash mid-create, a template boot cut short) and
        drop half-built templates."""
        killed = []
        for name, pid in self.qemus().items():
            if name not in keep:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.append(name)
                self.remove_cgroup(name)
        if os.path.isdir(self.templates_dir):
            for key in os.listdir(self.templates_dir):
                if not os.path.exists(os.path.join(self.templates_dir, key, "ready")):
                    shutil.rmtree(os.path.join(self.templates_dir, key), ignore_errors=True)
        return killed

    @staticmethod
    def save_spec(vm: VMInstance) -> None:
        with open(os.path.join(vm.dir, "spec.json.tmp"), "w") as f:
            json.dump(dataclasses.asdict(vm.spec), f)
        os.replace(os.path.join(vm.dir, "spec.json.tmp"), os.path.join(vm.dir, "spec.json"))

    def load(self, sid: str, vm_dir: str) -> VMInstance:
        with open(os.path.join(vm_dir, "spec.json")) as f:
            d = json.load(f)
        spec = VMSpec(**{**d, "disks": [Disk(**x) for x in d["disks"]]})
        return VMInstance(sid, vm_dir, self.sock_dir, spec)

    @staticmethod
    def is_qemu(pid: int) -> bool:
        """``pid`` is alive and is a QEMU (not a recycled pid)."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return os.path.basename(f.read().split(b"\0")[0]).startswith(b"qemu-system")
        except OSError:
            return False

    async def adopt(self, vm: VMInstance, pid: int) -> GuestChannel:
        """Reconnect to a QEMU left running by a previous edge."""
        vm.pid = pid
        vm.exited = asyncio.Event()
        self.watch(vm)
        vm.qmp = QMP(vm.qmp_sock)
        await vm.qmp.connect(timeout=10, alive=lambda: not vm.exited.is_set())
        ch = GuestChannel(vm.agent_sock)
        await ch.connect(timeout=30, alive=lambda: not vm.exited.is_set())
        vm.channel = ch
        return ch

    # ---- boot and restore --------------------------------------------------------------
    async def boot(self, vm: VMInstance, hostname: str, timeout: float) -> GuestChannel:
        t0 = time.monotonic()
        with tracing.span("qemu.launch", sandbox_id=vm.sid, machine=vm.spec.machine, accel=vm.spec.accel):
            await self.launch(vm)
        # the guest kernel's boot up to its agent's first answer
        with tracing.span("agent.handshake", sandbox_id=vm.sid):
            ch = await self._greet(vm, hostname, timeout, "VM did not boot")
        vm.timings["boot_s"] = time.monotonic() - t0
        return ch

    @staticmethod
    def console_tail(vm: VMInstance) -> str:
        with contextlib.suppress(OSError), open(os.path.join(vm.dir, "console.log"), "rb") as f:
            return f.read()[-600:].decode(errors="replace").strip() or "(no console output)"
        return "(no console log)"

    async def pause(self, vm: VMInstance) -> dict[str, Any]:
        """Stop the guest, stream RAM and device state to the snapshot file (hashed on
        the way), end QEMU. The agent channel is kept, detached, for :meth:`resume`."""
        if vm.qmp is None or not vm.running:
            raise SandboxError("VM is not running")
        t0 = time.monotonic()
        await vm.qmp.execute("stop")
        if vm.channel:
            vm.channel.detach_socket()
        tmp = vm.snapshot + ".tmp"
        try:
            # a clone restored with x-ignore-shared keeps the capability; its RAM is private,
            # and the stream must say the capability is off for a plain restore to take it
            digest, size = await self._save_state(vm, tmp, ignore_shared=False)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            with contextlib.suppress(QMPError):
                await vm.qmp.execute("cont")
            if vm.channel:
                await vm.channel.reattach(vm.agent_sock)
            raise
        meta = {"version": SNAPSHOT_VERSION, "sha256": digest, "size": size,
                "config": vm.spec.fingerprint(self.version), "created_at": time.time()}
        os.replace(tmp, vm.snapshot)
        with open(vm.snapshot_meta + ".tmp", "w") as f:
            json.dump(meta, f)
        os.replace(vm.snapshot_meta + ".tmp", vm.snapshot_meta)
        t_saved = time.monotonic()
        await self.kill(vm, graceful=True)
        vm.timings["pause_s"] = time.monotonic() - t0
        log.info("paused %s: %d MiB saved in %.3f s, QEMU gone %.3f s later", vm.sid, size >> 20, t_saved - t0,
                 time.monotonic() - t_saved)
        return meta

    @staticmethod
    async def _save_state(vm: VMInstance, path: str, ignore_shared: bool) -> tuple[str, int]:
        """Migrate the stopped VM into ``path`` through a pipe (QEMU may not spawn or open
        files), hashed on the way; (sha256, size). ``ignore_shared`` leaves shared RAM (a
        template's file) out of the stream."""
        assert vm.qmp is not None
        r, w = os.pipe()
        with contextlib.suppress(OSError):  # fewer, larger hops between QEMU and the hashing thread
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
        saver = asyncio.create_task(asyncio.to_thread(_save_stream, r, path))
        try:
            try:
                await vm.qmp.execute("migrate-set-capabilities", {"capabilities": [
                    {"capability": "x-ignore-shared", "state": ignore_shared}]})
                # QEMU caps migration at 128 MiB/s by default (to spare a live guest's
                # network); a stopped guest to local disk should go as fast as the disk takes it
                await vm.qmp.execute("migrate-set-parameters", {"max-bandwidth": 64 << 30})
                await vm.qmp.execute("getfd", {"fdname": "state"}, fds=[w])
            finally:
                os.close(w)
            await vm.qmp.execute("migrate", {"uri": "fd:state"})
            await vm.qmp.wait_migration()
            return await asyncio.wait_for(asyncio.shield(saver), 30)
        except BaseException:
            saver.cancel()
            with contextlib.suppress(BaseException):
                await saver
            raise

    def check_meta(self, vm: VMInstance, meta_path: str) -> dict[str, Any]:
        """Refuse a snapshot made by another QEMU or VM shape (or in another format)."""
        try:
            with open(meta_path) as f:
                meta: dict[str, Any] = json.load(f)
        except (OSError, ValueError) as e:
            raise SnapshotError(f"snapshot metadata unreadable: {e}") from None
        if meta.get("version") != SNAPSHOT_VERSION:
            raise SnapshotError(f"snapshot format {meta.get('version')} is not {SNAPSHOT_VERSION}")
        if meta.get("config") != vm.spec.fingerprint(self.version):
            raise SnapshotError("snapshot was made by a different QEMU version or VM configuration")
        return meta

    async def restore(self, vm: VMInstance, state: str, meta_path: str, ignore_shared: bool = False,
                      run: bool = True) -> None:
        """Start QEMU from a snapshot and let the guest run. The file reaches QEMU through
        a pipe, hashed on the way; the guest is let run (``cont``) only once the whole
        stream matched its checksum, so a corrupt snapshot never executes. ``run=False``
        leaves it paused, checked."""
        t0 = time.monotonic()
        meta = self.check_meta(vm, meta_path)
        try:
            src = open(state, "rb")  # noqa: SIM115 - handed to the feeding thread
        except OSError as e:
            raise SnapshotError(f"snapshot unreadable: {e}") from None
        await self.launch(vm, incoming=True)
        t_launched = time.monotonic()
        assert vm.qmp is not None
        r, w = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
        feeder = asyncio.create_task(asyncio.to_thread(_feed_stream, src, w))
        try:
            if ignore_shared:
                await vm.qmp.execute("migrate-set-capabilities", {"capabilities": [
                    {"capability": "x-ignore-shared", "state": True}]})
            # an fd, not exec: QEMU's seccomp sandbox forbids it to spawn anything
            try:
                await vm.qmp.execute("getfd", {"fdname": "state"}, fds=[r])
            finally:
                os.close(r)
            await vm.qmp.execute("migrate-incoming", {"uri": "fd:state"})
            await vm.qmp.wait_status("paused")
            t_loaded = time.monotonic()
            digest, size = await asyncio.wait_for(asyncio.shield(feeder), 30)
            if size != meta.get("size") or digest != meta.get("sha256"):
                raise SnapshotError("snapshot file is corrupt (checksum mismatch)")
            if run:
                await vm.qmp.execute("cont")
        except BaseException as e:
            await self.kill(vm)  # the reading end closes: the feeder stops
            with contextlib.suppress(BaseException):
                await feeder
            if isinstance(e, QMPError):
                raise SnapshotError(f"snapshot is corrupt or incompatible, QEMU refused it: {e}; "
                                    f"{self.qemu_log_tail(vm)}") from None
            raise
        vm.timings["restore_s"] = time.monotonic() - t0
        log.info("restored %s: QEMU up %.3f s, state loaded %.3f s, running %.3f s", vm.sid, t_launched - t0,
                 t_loaded - t_launched, time.monotonic() - t_loaded)

    async def resume(self, vm: VMInstance) -> None:
        await self.restore(vm, vm.snapshot, vm.snapshot_meta)
        if vm.channel and not vm.channel.closed.is_set():
            await vm.channel.reattach(vm.agent_sock)
        else:  # paused across an edge restart: the guest drops the old channels
            vm.channel = GuestChannel(vm.agent_sock)
            await vm.channel.connect(timeout=30, alive=lambda: not vm.exited.is_set())
        await vm.channel.identity(vm.sid, time.time_ns())  # the clock stood still while paused
        for p in (vm.snapshot, vm.snapshot_meta):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    # ---- templates -----------------------------------------------------------------------
    def template_key(self, spec: VMSpec, digests: list[str], disk_mb: int) -> str:
        shape = {"spec": spec.fingerprint(self.version), "layers": digests, "disk_mb": disk_mb}
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:24]

    async def ensure_template(self, key: str, spec: VMSpec, disk_mb: int, timeout: float) -> str:
        """The template directory for ``key``: booted once, snapshotted with its RAM in
        a file (x-ignore-shared: the state file holds devices only), then ended."""
        tdir = os.path.join(self.templates_dir, key)
        if os.path.exists(os.path.join(tdir, "ready")):
            return tdir
        lock = self._tlocks.setdefault(key, asyncio.Lock())
        async with lock:
            if os.path.exists(os.path.join(tdir, "ready")):
                return tdir
            shutil.rmtree(tdir, ignore_errors=True)
            os.makedirs(tdir)
            upper = os.path.join(tdir, "upper.img")
            await self.make_upper(upper, disk_mb)
            tspec = VMSpec(**{**spec.__dict__, "disks": [Disk(upper, "dsec-upper", False), *spec.disks[1:]],
                              "mem_path": os.path.join(tdir, "ram"), "mem_shared": True})
            vm = VMInstance(sid=f"tpl-{key[:12]}", dir=tdir, sock_dir=self.sock_dir, spec=tspec)
            try:
                ch = await self.boot(vm, "dsec-template", timeout)
                await ch.ping()
                await _warm(ch)
                ch.close()
                assert vm.qmp is not None
                await vm.qmp.execute("stop")
                digest, size = await self._save_state(vm, os.path.join(tdir, "state"), ignore_shared=True)
                # a clone's spec differs from the template's only in paths and share=off
                clone_spec = VMSpec(**{**tspec.__dict__, "mem_shared": False})
                with open(os.path.join(tdir, "state.json"), "w") as f:
                    json.dump({"version": SNAPSHOT_VERSION, "sha256": digest, "size": size,
                               "config": clone_spec.fingerprint(self.version), "created_at": time.time(),
                               "boot_s": vm.timings.get("boot_s")}, f)
                await self.kill(vm, graceful=True)
                self.remove_cgroup(vm.sid)
                open(os.path.join(tdir, "ready"), "w").close()
            except BaseException:
                await self.kill(vm)
                self.remove_cgroup(vm.sid)
                shutil.rmtree(tdir, ignore_errors=True)
                raise
            log.info("VM template %s ready (boot %.2f s)", key, vm.timings.get("boot_s", 0))
            return tdir

    async def clone(self, vm: VMInstance, tdir: str, hostname: str) -> GuestChannel:
        """Start ``vm`` from template ``tdir``: a sparse copy of its disk, its RAM file
        mapped private (copy on write), its device state restored."""
        t0 = time.monotonic()
        vm.spec.mem_path = os.path.join(tdir, "ram")
        vm.spec.mem_shared = False
        with tracing.span("vm.upper", sandbox_id=vm.sid, copy=True):
            await self.make_upper(vm.spec.disks[0].path, 0, copy_of=os.path.join(tdir, "upper.img"))
        with tracing.span("qemu.restore", sandbox_id=vm.sid, machine=vm.spec.machine, accel=vm.spec.accel):
            await self.restore(vm, os.path.join(tdir, "state"), os.path.join(tdir, "state.json"),
                               ignore_shared=True)
        with tracing.span("agent.handshake", sandbox_id=vm.sid):
            ch = await self._greet(vm, hostname, 30, "cloned VM's agent did not answer")
        vm.timings["clone_s"] = time.monotonic() - t0
        return ch

    # ---- live branch: a running VM's image that children start from --------------------
    async def branch_image(self, vm: VMInstance, work: str) -> dict[str, str]:
        """Capture running ``vm`` into ``work`` for children that share its RAM copy on
        write, the parent running on unchanged (the same QEMU, the same RAM).

        1. The parent is stopped (QEMU drains and flushes its disks) and its disk copied
           (a reflink where the filesystem has them).
        2. A template QEMU is started over that copy, its RAM a file mapped shared, waiting
           for a migration; the parent migrates its whole RAM and device state straight
           into it through a pipe (no file, no second read): every guest page lands in the
           file. Then the parent gets ``cont`` (QEMU takes its disks back after a completed
           outgoing migration): that is the parent's whole pause.
        3. The template is saved with x-ignore-shared: a state of devices only (kilobytes),
           and ends. Each child (:meth:`branch_child`) maps the RAM file private, copy on
           write, and restores that state: no page is read from a stream per child.

        QEMU 7.2 cannot migrate a guest that came in and never ran (its disks stay inactive
        until ``cont``), so the template runs for the moment between a ``cont`` and a
        ``stop``: the children start from the parent's state a few milliseconds of guest
        time later, with the disk as the template left it (both in step)."""
        if vm.qmp is None or not vm.running:
            raise SandboxError("VM is not running")
        t0 = time.monotonic()
        disk = os.path.join(work, "upper.img")
        mem_id = vm.spec.mem_id if vm.spec.mem_path else DEFAULT_RAM_ID[vm.spec.machine]
        tspec = VMSpec(**{**vm.spec.__dict__, "disks": [Disk(disk, vm.spec.disks[0].serial, False), *vm.spec.disks[1:]],
                          "mem_path": os.path.join(work, "ram"), "mem_shared": True, "mem_id": mem_id,
                          "extra": list(vm.spec.extra)})
        tpl = VMInstance(sid=f"br-{os.path.basename(work)[-8:]}-{vm.sid[-6:]}", dir=work, sock_dir=self.sock_dir,
                         spec=tspec)
        try:
            await vm.qmp.execute("stop")
            try:
                await self.make_upper(disk, 0, copy_of=vm.spec.disks[0].path)
                await self.launch(tpl, incoming=True)
                await self._migrate_into(vm, tpl)
            finally:
                with contextlib.suppress(QMPError):  # (a QEMU gone meanwhile fails the parent by itself)
                    await vm.qmp.execute("cont")
            paused_s = time.monotonic() - t0
            assert tpl.qmp is not None
            await tpl.qmp.execute("cont")
            await tpl.qmp.execute("stop")
            digest, size = await self._save_state(tpl, os.path.join(work, "state"), ignore_shared=True)
        finally:
            await self.kill(tpl)
            self.remove_cgroup(tpl.sid)
        with open(os.path.join(work, "state.json"), "w") as f:  # a child's config is the template's, paths aside
            json.dump({"version": SNAPSHOT_VERSION, "sha256": digest, "size": size,
                       "config": tspec.fingerprint(self.version)}, f)
        log.info("branch image of %s: parent paused %.3f s, %d MiB of RAM, ready %.3f s", vm.sid, paused_s,
                 os.stat(os.path.join(work, "ram")).st_blocks >> 11, time.monotonic() - t0)
        return {"branch": work, "ram": os.path.join(work, "ram"), "state": os.path.join(work, "state"),
                "meta": os.path.join(work, "state.json"), "disk": disk, "mem_id": mem_id,
                "paused_ms": f"{paused_s * 1e3:.1f}"}

    @staticmethod
    async def _migrate_into(src: VMInstance, dst: VMInstance) -> None:
        """Migrate stopped ``src`` into ``dst`` (started with ``-incoming defer``) through a
        pipe between the two QEMUs; ``dst`` ends paused, holding the state."""
        assert src.qmp is not None and dst.qmp is not None
        r, w = os.pipe()
        try:
            with contextlib.suppress(OSError):
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
            await dst.qmp.execute("getfd", {"fdname": "state"}, fds=[r])
            await dst.qmp.execute("migrate-incoming", {"uri": "fd:state"})
            await src.qmp.execute("migrate-set-capabilities", {"capabilities": [
                {"capability": "x-ignore-shared", "state": False}]})
            await src.qmp.execute("migrate-set-parameters", {"max-bandwidth": 64 << 30})
            await src.qmp.execute("getfd", {"fdname": "state"}, fds=[w])
        finally:  # the QEMUs hold the two ends now: one ending closes the pipe for the other
            os.close(r)
            os.close(w)
        await src.qmp.execute("migrate", {"uri": "fd:state"})
        await src.qmp.wait_migration()
        await dst.qmp.wait_status("paused")

    async def branch_child(self, vm: VMInstance, image: dict[str, str], hostname: str) -> GuestChannel:
        """Start ``vm`` from a :meth:`branch_image`: the image's RAM file hard-linked into
        its own directory (the same pages in the page cache, mapped private: copy on write;
        the link keeps the file for the child's pause and resume, and goes with its
        directory), its disk a copy of the image's, its devices restored; then a fresh
        clock, hostname and entropy (the guest's RNG is reseeded: no two children share a
        random stream)."""
        t0 = time.monotonic()
        ram = os.path.join(vm.dir, "ram")
        try:
            os.link(image["ram"], ram)
        except OSError as e:  # another filesystem: a copy (correct, but its pages are its own)
            log.warning("branch child %s: RAM file copied, not linked (%s): no memory shared", vm.sid, e)
            await asyncio.to_thread(subprocess.run, ["cp", "--sparse=always", "--reflink=auto", image["ram"], ram],
                                    check=True)
        vm.spec.mem_path, vm.spec.mem_shared, vm.spec.mem_id = ram, False, image["mem_id"]
        await self.make_upper(vm.spec.disks[0].path, 0, copy_of=image["disk"])
        await self.restore(vm, image["state"], image["meta"], ignore_shared=True)
        ch = await self._greet(vm, hostname, 30, "branched VM's agent did not answer")
        vm.timings["clone_s"] = time.monotonic() - t0
        return ch

    async def _greet(self, vm: VMInstance, hostname: str, timeout: float, failure: str) -> GuestChannel:
        """The guest's agent connected and given its identity (hostname, the host's clock, fresh
        entropy: per boot, clone and branch child), as ``vm.channel``; a guest whose agent does
        not answer is killed, and the error says ``failure`` with its console's tail."""
        ch = GuestChannel(vm.agent_sock)
        try:
            await ch.connect(timeout=timeout, alive=lambda: not vm.exited.is_set())
        except SandboxError:
            await self.kill(vm)
            raise SandboxError(f"{failure}: {self.console_tail(vm)}") from None
        await ch.identity(hostname, time.time_ns())
        vm.channel = ch
        return ch

    def remove_templates(self) -> None:
        shutil.rmtree(self.templates_dir, ignore_errors=True)


def _save_stream(fd: int, path: str) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    try:
        with open(path, "wb") as out:
            while chunk := os.read(fd, 4 << 20):
                h.update(chunk)
                out.write(chunk)
                size += len(chunk)
    finally:
        os.close(fd)
    return h.hexdigest(), size


def _feed_stream(src: Any, fd: int) -> tuple[str, int]:
    """Copy an open snapshot file into pipe ``fd``, hashing it; (sha256, size)."""
    h = hashlib.sha256()
    size = 0
    try:
        with src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
    except BrokenPipeError:  # QEMU went away (refused the stream, or was killed)
        pass
    finally:
        os.close(fd)
    return h.hexdigest(), size
