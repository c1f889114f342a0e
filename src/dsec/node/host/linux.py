"""Thin ctypes bindings for the kernel calls the edge needs and Python lacks:
mount(2), umount2(2), setns(2) on 3.11, and openat2(2) with RESOLVE_IN_ROOT, which is
what lets the host touch a sandbox's files without following its symlinks out."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.syscall.restype = ctypes.c_long

MS_RDONLY = 1
MS_REMOUNT = 32
MNT_DETACH = 2
CLONE_NEWNET = 0x40000000
CLONE_NEWUTS = 0x04000000
SYS_OPENAT2 = 437
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Orphaned descendants (a container's init, once crun exits) become this process's
    children instead of the host init's, so the edge reaps them when they end."""
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str | None = None) -> None:
    ret = _libc.mount(source.encode(), target.encode(), fstype.encode(), flags,
                      data.encode() if data is not None else None)
    _check(ret, f"mount {fstype} {source} on {target}")


def umount(target: str, detach: bool = False) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH if detach else 0), f"umount {target}")


def mounted_under(prefix: str) -> list[str]:
    """Mount points at or below ``prefix`` in this mount namespace, deepest first."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == prefix or mp.startswith(prefix.rstrip("/") + "/"):
                out.append(mp)
    return sorted(out, key=len, reverse=True)


def unmount_all(root: str) -> None:
    """Unmount everything mounted under ``root`` (lazily where a mount is busy)."""
    for mp in mounted_under(root):
        try:
            umount(mp)
        except OSError:
            umount(mp, detach=True)


def openat2(dirfd: int, path: str, flags: int, mode: int = 0o644,
            resolve: int = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) -> int:
    """open ``path`` relative to ``dirfd`` as if ``dirfd`` were ``/``."""
    how = struct.pack("QQQ", flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, resolve)
    buf = ctypes.create_string_buffer(how)
    while True:
        fd = _libc.syscall(SYS_OPENAT2, dirfd, path.encode(), buf, len(how))
        if fd >= 0:
            return int(fd)
        e = ctypes.get_errno()
        if e != errno.EINTR:
            raise OSError(e, os.strerror(e), path)


_netns_lock = threading.Lock()


def in_netns(netns_path: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` in the network namespace at ``netns_path`` from the calling thread,
    which returns home afterwards (setns(CLONE_NEWNET) is per thread; sockets and
    netlink handles made inside keep the namespace they were made in)."""
    with _netns_lock:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        target = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(_libc.setns(target, CLONE_NEWNET), "setns into sandbox netns")
            try:
                return fn()
            finally:
                _check(_libc.setns(home, CLONE_NEWNET), "setns back to host netns")
        finally:
            os.close(home)
            os.close(target)


def in_ns(ns_path: str, nstype: int, fn: Callable[[], T]) -> T:
    """``fn`` run from the calling thread inside the namespace at ``ns_path`` of type
    ``nstype`` (a CLONE_NEW* flag: one whose setns is per thread, such as UTS), which
    returns home afterwards."""
    kind = {CLONE_NEWNET: "net", CLONE_NEWUTS: "uts"}[nstype]
    home = os.open(f"/proc/thread-self/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(target, nstype), f"setns into {ns_path}")
        try:
            return fn()
        finally:
            _check(_libc.setns(home, nstype), f"setns back to the host's {kind} namespace")
    finally:
        os.close(home)
        os.close(target)


def new_netns(fn: Callable[[], T]) -> tuple[int, T]:
    """A new network namespace with its loopback up, and ``fn`` run in it from the calling
    thread, which returns home afterwards. Returns an fd of the namespace (the caller
    closes it; whatever holds it or runs in it keeps it) and ``fn``'s result."""
    with _netns_lock:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _check(_libc.unshare(CLONE_NEWNET), "unshare a network namespace")
            try:
                ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    _loopback_up()
                    return ns, fn()
                except BaseException:
                    os.close(ns)
                    raise
            finally:
                _check(_libc.setns(home, CLONE_NEWNET), "setns back to host netns")
        finally:
            os.close(home)


SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def _loopback_up() -> None:
    """``lo`` up in the calling thread's network namespace (what an OCI runtime does for a
    namespace it makes itself), without netlink: two ioctls."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def socket_in_netns(netns_path: str, family: int = socket.AF_INET) -> socket.socket:
    """A TCP socket that belongs to the network namespace at ``netns_path``."""
    return in_netns(netns_path, lambda: socket.socket(family, socket.SOCK_STREAM))
