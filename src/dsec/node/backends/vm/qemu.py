"""QEMU as the VMM: the command line of a VM sandbox, the QMP client that drives a
running QEMU (stop, cont, migrate for snapshots, screendump and input for full VMs),
and the per-node probe that decides between KVM and TCG.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsec.shared.errors import SandboxError

QEMU = "qemu-system-x86_64"
# the RAM a machine makes itself when no memory backend is named, by the name its
# migration stream gives it (QEMU's MachineClass.default_ram_id)
DEFAULT_RAM_ID = {"microvm": "microvm.ram", "q35": "pc.ram"}


class QMPError(SandboxError):
    """QEMU refused a QMP command or its monitor went away."""


async def connect_unix(path: str, timeout: float, alive: Callable[[], bool] | None = None) -> socket.socket:
    """A non-blocking connection to a unix socket that QEMU creates once it is up, retried
    until ``timeout``; ConnectionError when it runs out or ``alive()`` says QEMU is gone."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.setblocking(False)
        try:
            await loop.sock_connect(s, path)
            return s
        except (FileNotFoundError, ConnectionRefusedError) as e:
            s.close()
            if loop.time() > deadline or (alive is not None and not alive()):
                raise ConnectionError(f"{os.path.basename(path)}: {e.strerror}") from None
            await asyncio.sleep(0.005)


def qemu_binary() -> str:
    path = shutil.which(QEMU)
    if path is None:
        raise SandboxError(f"{QEMU} is not installed (apt-get install qemu-system-x86)")
    return path


def qemu_version() -> str:
    out = subprocess.run([qemu_binary(), "--version"], check=True, capture_output=True, text=True).stdout
    return out.splitlines()[0].strip()


@dataclass
class Disk:
    path: str
    serial: str
    readonly: bool = True


@dataclass
class VMSpec:
    """Everything that shapes the guest's hardware. Two QEMUs with equal specs (paths
    aside) can exchange migration state; :meth:`fingerprint` is what snapshots record."""

    machine: str  # microvm | q35
    accel: str  # kvm | tcg
    kernel: str
    initrd: str
    guest: str  # kernel version + initramfs identity
    vcpus: int
    memory_mb: int
    disks: list[Disk]
    cmdline: str
    display: bool = False
    mem_path: str | None = None  # RAM in a file: a template (share on) or its clone (share off)
    mem_shared: bool = False
    extra: list[str] = field(default_factory=list)
    # the RAM block's name in the migration stream: a file-backed RAM restores a stream only
    # under the name it was saved with ("ram" for templates; a booted VM's is its machine's
    # default, DEFAULT_RAM_ID: a live branch's children restore such a VM's stream)
    mem_id: str = "ram"

    def fingerprint(self, version: str) -> str:
        """The hardware as QEMU sees it: the command line with every path taken out
        (disks stand by their serials, the guest by its identity), plus QEMU's version."""
        shape = dataclasses.replace(
            self, kernel="", initrd="", mem_path="ram" if self.mem_path else None, mem_shared=False,
            disks=[Disk(d.serial, d.serial, d.readonly) for d in self.disks])
        argv = shape.argv("qmp", "agent", "console")[1:]
        return hashlib.sha256(json.dumps([version, self.guest, argv]).encode()).hexdigest()

    def argv(self, qmp_sock: str, agent_sock: str, console_log: str, incoming: bool = False) -> list[str]:
        dev = "device" if self.machine == "microvm" else "pci"
        if self.machine == "microvm":
            machine = "microvm,x-option-roms=off,isa-serial=on,rtc=on"
        else:
            machine = "q35"
        accel = "kvm" if self.accel == "kvm" else "tcg,thread=multi,tb-size=64"
        # seccomp: no spawning (migrations go through fds), no setuid, no new privileges
        a = [qemu_binary(), "-nodefaults", "-no-user-config", "-no-reboot", "-accel", accel,
             "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
             "-smp", str(self.vcpus), "-m", f"{self.memory_mb}M",
             "-kernel", self.kernel, "-initrd", self.initrd, "-append", self.cmdline,
             "-qmp", f"unix:{qmp_sock},server=on,wait=off",
             "-chardev", f"file,id=con,path={console_log}", "-serial", "chardev:con",
             "-chardev", f"socket,id=agent,path={agent_sock},server=on,wait=off",
             "-device", f"virtio-serial-{dev},max_ports=2", "-device", "virtserialport,chardev=agent,name=dsec.agent",
             # no free-page reporting (nor balloon inflation): QEMU discards a reported page by
             # punching a hole in the RAM's file even where it maps it private, and a template
             # clone's or a branch child's RAM file is one inode shared by its siblings (and by
             # other tenants' clones of the same template): the hole would zero their pages
             "-device", f"virtio-balloon-{dev}",
             "-object", "rng-random,id=rng,filename=/dev/urandom", "-device", f"virtio-rng-{dev},rng=rng"]
        if self.mem_path:
            a += ["-object", f"memory-backend-file,id={self.mem_id},size={self.memory_mb}M,mem-path={self.mem_path},"
                  f"share={'on' if self.mem_shared else 'off'}"]
            machine += f",memory-backend={self.mem_id}"
        a += ["-machine", machine]
        for i, d in enumerate(self.disks):
            ro = "on" if d.readonly else "off"
            a += ["-drive", f"file={d.path},if=none,id=d{i},format=raw,readonly={ro},cache=writeback,discard=unmap",
                  "-device", f"virtio-blk-{dev},drive=d{i},serial={d.serial}"]
        if self.display:
            # the tablet is bound to the VGA console, so input events sent to that console reach it
            a += ["-vga", "none", "-device", "VGA,id=video0", "-display", "none",
                  "-device", "virtio-tablet-pci,id=tablet,display=video0"]
        else:
            a += ["-display", "none", "-vga", "none"] if self.machine == "q35" else ["-display", "none"]
        if incoming:
            a += ["-incoming", "defer"]
        return a + self.extra


class QMP:
    """A QMP connection: one command at a time, events kept for whoever waits on them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._buf = b""
        self._lock = asyncio.Lock()
        self.events: list[dict[str, Any]] = []

    async def connect(self, timeout: float = 10.0, alive: Callable[[], bool] | None = None) -> None:
        try:
            s = await connect_unix(self.path, timeout, alive)
        except ConnectionError:
            raise QMPError("QEMU's monitor socket never came up") from None
        self._sock = s
        await self._read_msg()  # greeting
        await self.execute("qmp_capabilities")

    async def _read_msg(self) -> dict[str, Any]:
        assert self._sock is not None
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buf:
            try:
                chunk = await loop.sock_recv(self._sock, 65536)
            except OSError as e:
                raise QMPError(f"QEMU's monitor connection failed: {e}") from None
            if not chunk:
                raise QMPError("QEMU's monitor closed the connection")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        return msg

    async def execute(self, cmd: str, args: dict[str, Any] | None = None, fds: list[int] | None = None,
                      timeout: float = 60.0) -> Any:
        if self._sock is None:
            raise QMPError("not connected to QEMU's monitor")
        msg = json.dumps({"execute": cmd, **({"arguments": args} if args else {})}).encode() + b"\n"
        async with self._lock:
            try:
                if fds:
                    socket.send_fds(self._sock, [msg], fds)
                else:
                    await asyncio.get_running_loop().sock_sendall(self._sock, msg)
            except OSError as e:
                raise QMPError(f"QEMU's monitor connection failed: {e}") from None
            async with asyncio.timeout(timeout):
                while True:
                    r = await self._read_msg()
                    if "event" in r:
                        self.events.append(r)
                        continue
                    if "error" in r:
                        raise QMPError(f"QEMU refused {cmd}: {r['error'].get('desc', r['error'])}")
                    return r.get("return")

    async def wait_migration(self, timeout: float = 120.0) -> dict[str, Any]:
        """Poll until the outgoing (or incoming) migration is over; its final status."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            st = await self.execute("query-migrate")
            status = st.get("status") if st else None
            if status == "completed":
                return dict(st)
            if status in ("failed", "cancelled"):
                raise QMPError(f"migration {status}: {st.get('error-desc', '')}")
            if time.monotonic() > deadline:
                raise QMPError("migration did not finish in time")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def wait_status(self, want: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            st = await self.execute("query-status")
            if st and st.get("status") == want:
                return
            if time.monotonic() > deadline:
                raise QMPError(f"VM did not reach status {want!r} (it is {st.get('status') if st else None})")
            await asyncio.sleep(0.005)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


def probe_accel(kernel: str, initrd: str, cache: str, timeout: float = 8.0) -> dict[str, Any]:
    """Which accelerator actually runs guests here: boot the guest once under KVM with
    ``dsec.probe=1`` (its /init prints a marker and powers off). KVM is used only if
    that boot finishes; otherwise TCG. The verdict is cached per node, keyed by QEMU
    version and kernel, because the probe costs up to ``timeout`` seconds."""
    key = {"qemu": qemu_version(), "kernel": os.path.basename(os.path.dirname(kernel))}
    if os.path.exists(cache):
        with contextlib.suppress(OSError, ValueError):
            with open(cache) as f:
                got: dict[str, Any] = json.load(f)
            if got.get("key") == key:
                return got
    result: dict[str, Any] = {"key": key, "accel": "tcg", "kvm_device": os.path.exists("/dev/kvm")}
    if result["kvm_device"]:
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                [qemu_binary(), "-M", "microvm", "-accel", "kvm", "-m", "256", "-kernel", kernel, "-initrd", initrd,
                 "-append", "console=ttyS0 quiet panic=-1 dsec.probe=1", "-nographic", "-no-reboot", "-nodefaults",
                 "-serial", "stdio"], capture_output=True, timeout=timeout)
            ok = b"DSEC-PROBE-OK" in p.stdout
            result["kvm_probe"] = "booted" if ok else f"no marker (exit {p.returncode})"
        except subprocess.TimeoutExpired:
            ok = False
            result["kvm_probe"] = f"guest did not finish booting in {timeout:.0f} s"
        result["kvm_probe_s"] = round(time.monotonic() - t0, 2)
        if ok:
            result["accel"] = "kvm"
    else:
        result["kvm_probe"] = "no /dev/kvm"
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    with open(cache + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(cache + ".tmp", cache)
    return result
