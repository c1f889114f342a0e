"""The guest side of VM sandboxes, built on the host: the kernel (Debian's cloud
kernel package, fetched with apt and unpacked, never taken from the host's /boot) and
dsec's initramfs (busybox, the kernel modules it needs, dsec-init and dsec-vmux, and an
/init that stacks the layer disks into the root filesystem).

Everything lands under DATA/vm/guest/<kernel version>/; a build is reused while its
inputs are unchanged (the initramfs is named by the hash of what went into it).
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from dsec.node.agent.native import ensure_binary

KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
# in load order; the bus drivers are picked per machine type
MODULES_COMMON = ["virtio_ring", "virtio", "virtio_blk", "virtio_console", "libcrc32c", "erofs", "overlay",
                  "virtio_balloon", "virtio-rng"]
MODULES_BUS = {"microvm": ["virtio_mmio"], "q35": ["virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci"]}
# a full VM's pointer: virtio-tablet, seen by the guest through evdev
MODULES_DISPLAY = ["virtio_input", "evdev"]
# the cloud kernel's TSC calibration sometimes hangs under TCG without a given frequency
KERNEL_CMDLINE = "console=ttyS0 quiet panic=-1 tsc_early_khz=2600000 random.trust_cpu=on"
BUSYBOX_APPLETS = ["sh", "mount", "umount", "insmod", "mkdir", "cat", "ln", "switch_root", "ip", "cp", "sleep",
                   "echo", "poweroff", "basename", "chmod", "mknod", "ls", "dmesg"]

INIT_SCRIPT = r"""#!/bin/sh
# dsec guest /init: layer disks -> overlay root -> dsec-init (PID 1) + dsec-vmux
export PATH=/bin
mount -t devtmpfs dev /dev
mount -t proc proc /proc
mount -t sysfs sys /sys
fail() { echo "dsec-init: $*" > /dev/ttyS0; poweroff -f; }
for m in $(cat /etc/dsec-modules); do insmod /lib/modules/$m.ko 2>/dev/null; done
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    dsec.layers=*) LAYERS="${arg#dsec.layers=}" ;;
    dsec.probe=1) echo DSEC-PROBE-OK > /dev/ttyS0; poweroff -f ;;
  esac
done
for b in /sys/block/vd*; do
  [ -e "$b/serial" ] && ln -s "/dev/$(basename "$b")" "/dev/disk-$(cat "$b/serial")"
done
mkdir -p /up /newroot
mount -t ext4 -o noatime /dev/disk-dsec-upper /up || fail "no upper disk"
mkdir -p /up/upper /up/work
lowers=""
i=0
while [ "$i" -lt "${LAYERS:-0}" ]; do
  mkdir -p "/l$i"
  opt=ro
  [ -e "/dev/disk-dsec-l${i}d" ] && opt="ro,device=/dev/disk-dsec-l${i}d"
  mount -t erofs -o "$opt" "/dev/disk-dsec-l${i}m" "/l$i" || fail "layer $i does not mount"
  lowers="/l$i${lowers:+:}$lowers"
  i=$((i + 1))
done
mount -t overlay overlay -o "lowerdir=$lowers,upperdir=/up/upper,workdir=/up/work" /newroot || fail "overlay"
mkdir -p /newroot/dev /newroot/proc /newroot/sys /newroot/run /newroot/tmp
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
mount -t tmpfs -o mode=755,size=64m run /newroot/run
mkdir -p /newroot/run/dsec
cp /bin/dsec-init /bin/dsec-vmux /newroot/run/dsec/
ip link set lo up
exec switch_root /newroot /run/dsec/dsec-init --vm /run/dsec/dsec-vmux
"""


@dataclass(frozen=True)
class GuestImage:
    """A bootable guest: kernel, initramfs and the identity of both."""

    kernel: str
    initrd: str
    version: str
    machine: str

    @property
    def fingerprint(self) -> str:
        return f"{self.version}/{os.path.basename(self.initrd)}"


def _apt_download(pkg: str, dest: str) -> str:
    subprocess.run(["apt-get", "download", pkg], cwd=dest, check=True, capture_output=True)
    debs = glob.glob(os.path.join(dest, f"{pkg}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download {pkg} produced no package")
    return debs[0]


def kernel_package() -> str:
    """The concrete kernel package the cloud meta package points at today."""
    out = subprocess.run(["apt-cache", "depends", KERNEL_META_PACKAGE], check=True, capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Depends:") and "linux-image-" in line:
            return line.split()[1]
    raise RuntimeError(f"cannot tell which kernel {KERNEL_META_PACKAGE} depends on")


def ensure_kernel(data_dir: str) -> tuple[str, str]:
    """(kernel version, directory with vmlinuz and modules/), fetched once per node."""
    base = os.path.join(data_dir, "vm", "guest")
    current = os.path.join(base, "current.json")
    if os.path.exists(current):
        with open(current) as f:
            ver = json.load(f)["version"]
        if os.path.exists(os.path.join(base, ver, "vmlinuz")):
            return ver, os.path.join(base, ver)
    pkg = kernel_package()
    ver = pkg.removeprefix("linux-image-")
    kdir = os.path.join(base, ver)
    os.makedirs(base, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        deb = _apt_download(pkg, tmp)
        x = os.path.join(tmp, "x")
        subprocess.run(["dpkg-deb", "-x", deb, x], check=True, capture_output=True)
        stage = os.path.join(tmp, "stage")
        os.makedirs(os.path.join(stage, "modules"))
        shutil.copy(os.path.join(x, "boot", f"vmlinuz-{ver}"), os.path.join(stage, "vmlinuz"))
        wanted = set(MODULES_COMMON) | set(MODULES_DISPLAY) | {m for ms in MODULES_BUS.values() for m in ms}
        for ko in glob.glob(os.path.join(x, "lib", "modules", ver, "kernel", "**", "*.ko"), recursive=True):
            name = os.path.basename(ko)[:-3]
            if name in wanted:
                shutil.copy(ko, os.path.join(stage, "modules", name + ".ko"))
        missing = wanted - {n[:-3] for n in os.listdir(os.path.join(stage, "modules"))}
        if missing:
            raise RuntimeError(f"kernel {ver} lacks modules {sorted(missing)}")
        shutil.rmtree(kdir, ignore_errors=True)
        os.rename(stage, kdir)
    with open(current + ".tmp", "w") as f:
        json.dump({"version": ver, "package": pkg}, f)
    os.replace(current + ".tmp", current)
    return ver, kdir


class _Cpio:
    """A newc cpio archive (what the kernel unpacks as an initramfs)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"") -> None:
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        self.ino += 1
        self.buf.write(hdr.encode() + nb)
        self.buf.write(b"\0" * ((4 - (110 + len(nb)) % 4) % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * ((4 - len(data) % 4) % 4))

    def dir(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, mode: int = 0o755) -> None:
        self._entry(name, 0o100000 | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, 0o120777, target.encode())

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def ensure_guest(data_dir: str, machine: str = "microvm") -> GuestImage:
    """Kernel and initramfs for ``machine`` (microvm or q35), built if missing."""
    if machine not in MODULES_BUS:
        raise ValueError(f"unknown machine type {machine!r}")
    ver, kdir = ensure_kernel(data_dir)
    bindir = os.path.join(data_dir, "bin")
    init_bin = ensure_binary("dsec-init", os.path.join(bindir, "dsec-init"))
    vmux_bin = ensure_binary("dsec-vmux", os.path.join(bindir, "dsec-vmux"))
    busybox = shutil.which("busybox")
    if busybox is None:
        raise RuntimeError("busybox is needed for the VM initramfs (apt-get install busybox-static)")
    modules = ["virtio_ring", "virtio"] + MODULES_BUS[machine] + MODULES_COMMON[2:]
    if machine == "q35":
        modules += MODULES_DISPLAY
    files: list[tuple[str, bytes, int]] = []
    for src, dest in ((busybox, "bin/busybox"), (init_bin, "bin/dsec-init"), (vmux_bin, "bin/dsec-vmux")):
        with open(src, "rb") as f:
            files.append((dest, f.read(), 0o755))
    for m in modules:
        with open(os.path.join(kdir, "modules", m + ".ko"), "rb") as f:
            files.append((f"lib/modules/{m}.ko", f.read(), 0o644))
    files.append(("etc/dsec-modules", "\n".join(modules).encode() + b"\n", 0o644))
    files.append(("init", INIT_SCRIPT.encode(), 0o755))
    h = hashlib.sha256()
    for name, data, mode in files:
        h.update(f"{name}:{mode}:{len(data)}:".encode())
        h.update(data)
    h.update(" ".join(BUSYBOX_APPLETS).encode())
    initrd = os.path.join(kdir, f"initrd-{machine}-{h.hexdigest()[:16]}.cpio")
    if not os.path.exists(initrd):
        cp = _Cpio()
        for d in ("bin", "dev", "proc", "sys", "etc", "lib", "lib/modules", "newroot", "up"):
            cp.dir(d)
        for name, data, mode in files:
            cp.file(name, data, mode)
        for applet in BUSYBOX_APPLETS:
            cp.symlink(f"bin/{applet}", "busybox")
        tmp = f"{initrd}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(cp.finish())
        os.replace(tmp, initrd)
        for old in glob.glob(os.path.join(kdir, f"initrd-{machine}-*.cpio")):
            if old != initrd:
                os.unlink(old)
    return GuestImage(kernel=os.path.join(kdir, "vmlinuz"), initrd=initrd, version=ver, machine=machine)
