"""The edge's sandbox volume: where writable layers live, with a hard per-sandbox quota.

A container's directory (overlay upper and work dirs, its config) is a btrfs subvolume
with a qgroup limit, so a workload that fills its disk or creates files without end hits
EDQUOT in its own sandbox and the node's disk is untouched. Why btrfs: this kernel has no
CONFIG_QUOTA (no ext4 or XFS project quotas), while btrfs qgroups need none; a qgroup counts
metadata too, so inode exhaustion is bounded by the same limit.

The volume is a sparse file formatted once per edge and loop-mounted under the edge's data
dir; everything below goes through ioctls (no btrfs-progs at run time): subvolume create and
destroy, qgroup limit, and a quota-tree search for usage. If the volume cannot be made (no
btrfs, no loop devices), sandboxes get plain directories and ``status`` says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import struct
import subprocess

from dsec.node.host import linux

log = logging.getLogger("dsec.edge")

_IOC_W, _IOC_R = 1, 2


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr


VOL_ARGS = 4096  # struct btrfs_ioctl_vol_args: s64 fd, char name[4088]
SUBVOL_CREATE = _ioc(_IOC_W, 14, VOL_ARGS)
SNAP_DESTROY = _ioc(_IOC_W, 15, VOL_ARGS)
TREE_SEARCH = _ioc(_IOC_W | _IOC_R, 17, 4096)
INO_LOOKUP = _ioc(_IOC_W | _IOC_R, 18, 4096)
QGROUP_LIMIT = _ioc(_IOC_R, 43, 48)
QUOTA_CTL = _ioc(_IOC_W | _IOC_R, 40, 16)
SNAP_CREATE_V2 = _ioc(_IOC_W, 23, VOL_ARGS)  # struct btrfs_ioctl_vol_args_v2: 4096 bytes
QGROUP_ASSIGN = _ioc(_IOC_W, 41, 24)
QGROUP_CREATE = _ioc(_IOC_W, 42, 16)
SUBVOL_QGROUP_INHERIT = 1 << 2
QUOTA_TREE = 8
QGROUP_INFO_KEY = 242
LIMIT_MAX_RFER = 1
FIRST_FREE_OBJECTID = 256
BTRFS_SUPER_MAGIC = 0x9123683E


def _vol_args(name: str) -> bytearray:
    raw = name.encode()
    if b"/" in raw or len(raw) >= VOL_ARGS - 8:
        raise ValueError(f"bad subvolume name {name!r}")
    return bytearray(struct.pack("q", 0) + raw + b"\0" * (VOL_ARGS - 8 - len(raw)))


def _subvol_id(path: str) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        buf = bytearray(struct.pack("QQ", 0, FIRST_FREE_OBJECTID) + b"\0" * 4080)
        fcntl.ioctl(fd, INO_LOOKUP, buf, True)
        return int(struct.unpack_from("Q", buf, 0)[0])
    finally:
        os.close(fd)


class SandboxVolume:
    def __init__(self, edge_root: str, size_gb: int | None) -> None:
        """``size_gb``: None sizes a new volume at half the free space below it (at most
        256 GiB); 0 turns the volume off."""
        self.image = os.path.join(edge_root, "volume.img")
        self.mnt = os.path.join(edge_root, "volume")
        if size_gb is None:
            st = os.statvfs(edge_root)
            size_gb = max(4, min(256, (st.f_bavail * st.f_frsize >> 30) // 2))
        self.size_gb = size_gb
        self.available = False
        self.status = "off (--sandbox-volume-gb 0)" if size_gb <= 0 else "not set up"

    def setup(self) -> None:
        """Mount the volume (formatting it the first time); safe to call at every start."""
        if self.size_gb <= 0:
            return
        try:
            if not _is_btrfs(self.mnt):
                self._mount()
            self._quota_enable()
            self.available = True
            st = os.statvfs(self.mnt)
            self.status = (f"btrfs qgroups on a {self.size_gb} GiB sparse volume, "
                           f"{st.f_bavail * st.f_frsize >> 30} GiB free")
        except (OSError, subprocess.CalledProcessError) as e:
            self.status = f"unavailable ({e}); writable layers have no disk quota"
            log.warning("sandbox volume: %s", self.status)

    def _mount(self) -> None:
        os.makedirs(self.mnt, exist_ok=True)
        if not os.path.exists(self.image):
            mkfs = shutil.which("mkfs.btrfs")
            if mkfs is None:
                raise OSError("mkfs.btrfs is not installed (btrfs-progs)")
            tmp = self.image + ".new"
            with open(tmp, "wb") as f:
                f.truncate(self.size_gb << 30)
            subprocess.run([mkfs, "-q", "-f", "-m", "single", tmp], check=True, capture_output=True)
            os.replace(tmp, self.image)
        # util-linux sets up the loop device and marks it autoclear: unmounting frees it
        # commit=5: usage (read from qgroups, updated per commit) is at most 5 s old
        subprocess.run(["mount", "-o", "loop,noatime,commit=5", self.image, self.mnt], check=True, capture_output=True,
                       text=True)

    def _quota_enable(self) -> None:
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, QUOTA_CTL, bytearray(struct.pack("QQ", 1, 0)), True)  # BTRFS_QUOTA_CTL_ENABLE
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmount when no sandbox is left (the image stays for the next start)."""
        if self.available:
            with contextlib.suppress(OSError):
                linux.umount(self.mnt, detach=True)
            self.available = False

    def create(self, path: str, limit_mb: int | None) -> None:
        """``path`` (under the volume) as a subvolume holding at most ``limit_mb``."""
        parent, name = os.path.split(path)
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, SUBVOL_CREATE, _vol_args(name), True)
        finally:
            os.close(fd)
        if limit_mb is not None:
            self.limit(path, limit_mb)

    def limit(self, path: str, limit_mb: int) -> None:
        """The subvolume at ``path`` holds at most ``limit_mb`` (a snapshot does not inherit
        its source's limit: a rollback sets it again on the copy it swaps in)."""
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # qgroup id 0: the subvolume this fd is in
            fcntl.ioctl(fd, QGROUP_LIMIT, bytearray(struct.pack("QQQQQQ", 0, LIMIT_MAX_RFER,
                                                               limit_mb << 20, 0, 0, 0)), True)
        finally:
            os.close(fd)

    def snapshot(self, src: str, dst: str, group: int | None = None) -> None:
        """A writable snapshot of the subvolume ``src`` at ``dst`` (same volume): constant
        time, and btrfs writes the source's dirty data out first, so the snapshot holds
        every write that returned before it. ``group``: a level-1 qgroup the snapshot's
        own qgroup joins as it is made (accounting stays exact: no rescan)."""
        parent, name = os.path.split(dst)
        raw = name.encode()
        if b"/" in raw or len(raw) >= 4040:
            raise ValueError(f"bad snapshot name {name!r}")
        inherit = None
        if group is not None:  # struct btrfs_qgroup_inherit: flags, 3 counts, a limit (5 u64), the qgroups
            inherit = ctypes.create_string_buffer(struct.pack("QQQQ5QQ", 0, 1, 0, 0, 0, 0, 0, 0, 0, group))
        src_fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:  # fd, transid, flags (0: writable), 32 bytes of union (size, inherit pointer), then the name
                if inherit is None:
                    args = struct.pack("qQQ", src_fd, 0, 0) + b"\0" * 32 + raw
                else:
                    args = struct.pack("qQQQQ", src_fd, 0, SUBVOL_QGROUP_INHERIT, ctypes.sizeof(inherit) - 1,
                                       ctypes.addressof(inherit)) + b"\0" * 16 + raw
                fcntl.ioctl(fd, SNAP_CREATE_V2, bytearray(args + b"\0" * (VOL_ARGS - len(args))), True)
            finally:
                os.close(fd)
        finally:
            os.close(src_fd)

    # ---- level-1 qgroups: a sandbox and its in-place snapshots under one limit ------------
    def _ctl(self, op: int, args: bytes) -> int:
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return int(fcntl.ioctl(fd, op, bytearray(args), True))
        finally:
            os.close(fd)

    def group_create(self, group: int) -> None:
        self._ctl(QGROUP_CREATE, struct.pack("QQ", 1, group))

    def group_remove(self, group: int) -> None:
        self._ctl(QGROUP_CREATE, struct.pack("QQ", 0, group))

    def group_assign(self, qgroup: int, group: int, assign: bool = True) -> bool:
        """Make ``qgroup`` a member of ``group`` (or not); False when the kernel could not
        account it at once (it shares extents: a rescan would be needed)."""
        return self._ctl(QGROUP_ASSIGN, struct.pack("QQQ", int(assign), qgroup, group)) == 0

    def group_limit(self, group: int, limit_mb: int) -> None:
        self._ctl(QGROUP_LIMIT, struct.pack("QQQQQQ", group, LIMIT_MAX_RFER, limit_mb << 20, 0, 0, 0))

    def is_subvolume(self, path: str) -> bool:
        """A subvolume's root directory is inode 256 (below the volume, nothing else is)."""
        if not self.available or not path.startswith(self.mnt + "/"):
            return False
        try:
            return os.lstat(path).st_ino == FIRST_FREE_OBJECTID
        except OSError:
            return False

    def remove(self, path: str) -> None:
        """Destroy a sandbox's subvolume with everything in it."""
        if not self.is_subvolume(path):
            shutil.rmtree(path, ignore_errors=True)
            return
        parent, name = os.path.split(path)
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:  # the kernel drops its qgroup once the cleaner has freed its extents
            fcntl.ioctl(fd, SNAP_DESTROY, _vol_args(name), True)
        finally:
            os.close(fd)

    def usage(self, path: str) -> int | None:
        """Bytes the subvolume at ``path`` references (data and metadata), from its qgroup
        (as of the last transaction commit, at most 30 s old)."""
        if not self.is_subvolume(path):
            return None
        qgroup = _subvol_id(path)
        return self.referenced(qgroup, qgroup).get(qgroup)

    def subvolume_id(self, path: str) -> int | None:
        return _subvol_id(path) if self.is_subvolume(path) else None

    def referenced(self, lo: int = FIRST_FREE_OBJECTID, hi: int = 2**48 - 1, exclusive: bool = False
                   ) -> dict[int, int]:
        """Level-0 qgroups lo..hi -> referenced bytes (``exclusive``: the bytes no other
        subvolume shares), by a search of the quota tree."""
        out: dict[int, int] = {}
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            while lo <= hi:
                key = struct.pack("QQQQQQQIIII", QUOTA_TREE, 0, 0, lo, hi, 0, 2**64 - 1,
                                  QGROUP_INFO_KEY, QGROUP_INFO_KEY, 64, 0) + b"\0" * 32
                buf = bytearray(key + b"\0" * (4096 - len(key)))
                fcntl.ioctl(fd, TREE_SEARCH, buf, True)
                found = struct.unpack_from("I", buf, 64)[0]
                if found == 0:
                    break
                pos = 104
                for _ in range(found):
                    _, _, qgroup, typ, length = struct.unpack_from("QQQII", buf, pos)
                    if typ == QGROUP_INFO_KEY and length >= 40:
                        # btrfs_qgroup_info_item: generation, rfer, rfer_cmpr, excl, excl_cmpr
                        out[qgroup] = int(struct.unpack_from("QQQQ", buf, pos + 32)[3 if exclusive else 1])
                    lo = qgroup + 1
                    pos += 32 + length
        finally:
            os.close(fd)
        return out


def _is_btrfs(path: str) -> bool:
    try:
        with open("/proc/self/mountinfo") as f:
            real = os.path.realpath(path)
            return any(line.split()[4] == real and " - btrfs " in line for line in f)
    except OSError:
        return False
