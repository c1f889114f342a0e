"""Watching a directory inside a container sandbox with the host's inotify.

The directory is opened inside the sandbox's root first (openat2 RESOLVE_IN_ROOT, by the
caller's ``open_dir``), and inotify is pointed at that open file through
/proc/self/fd/N: a symlink planted in the sandbox can never lead the watch to a host
directory. Events on the overlay's merged directory are the sandbox's own writes (it uses
the same mount). Recursive watches add each new subdirectory as it appears. Events queue up
to a bound; past it the oldest are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

_libc = ctypes.CDLL(None, use_errno=True)
IN_MODIFY, IN_ATTRIB = 0x2, 0x4
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_ISDIR, IN_IGNORED = 0x40000000, 0x8000
# no IN_CLOSE_WRITE: a write is reported once, by its IN_MODIFY (as envd's fsnotify does)
MASK = IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
MAX_EVENTS = 10_000
MAX_WATCHES = 4096
# each watch is its own inotify instance; the kernel's default allows 128 per user on the
# whole host, which a handful of sandboxes with watches would use up
INSTANCES = 16384
INSTANCES_SYSCTL = "/proc/sys/fs/inotify/max_user_instances"


def ensure_instances(n: int = INSTANCES) -> int:
    """Raise the host's per-user inotify instance limit to ``n`` (never lower it);
    returns the limit in force."""
    with open(INSTANCES_SYSCTL) as f:
        now = int(f.read())
    if now < n:
        try:
            with open(INSTANCES_SYSCTL, "w") as f:
                f.write(str(n))
            now = n
        except OSError:
            pass  # not allowed here: watches stay bounded by the host's limit
    return now


@dataclass
class WatchEvent:
    name: str  # relative to the watched directory
    kind: str  # create | write | remove | rename | chmod


def _kind(mask: int) -> str | None:
    if mask & IN_CREATE or mask & IN_MOVED_TO:
        return "create" if mask & IN_CREATE else "rename"
    if mask & IN_DELETE:
        return "remove"
    if mask & IN_MOVED_FROM:
        return "rename"
    if mask & IN_MODIFY:
        return "write"
    if mask & IN_ATTRIB:
        return "chmod"
    return None


class DirWatch:
    def __init__(self, open_dir: Callable[[str], int], path: str, recursive: bool) -> None:
        """``open_dir(path)``: an fd of that directory opened inside the sandbox's root."""
        self.open_dir, self.root, self.recursive = open_dir, path.rstrip("/") or "/", recursive
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.dirs: dict[int, str] = {}  # watch descriptor -> path relative to the root
        self.events: collections.deque[WatchEvent] = collections.deque(maxlen=MAX_EVENTS)
        self.changed = asyncio.Event()
        self.closed = False
        try:
            self._add("")
        except BaseException:
            os.close(self.fd)
            raise
        asyncio.get_running_loop().add_reader(self.fd, self._readable)

    def _add(self, rel: str, announce: bool = False) -> None:
        """Watch ``rel`` (and, recursively, its subdirectories). ``announce``: the directory
        is new, so what was made in it before its watch existed is reported as created —
        ``mkdir d && echo > d/f`` must not lose ``d/f`` to the gap."""
        if len(self.dirs) >= MAX_WATCHES:
            return
        dfd = self.open_dir(os.path.join(self.root, rel) if rel else self.root)
        subs: list[str] = []
        try:
            wd = _libc.inotify_add_watch(self.fd, f"/proc/self/fd/{dfd}".encode(), MASK)
            if wd < 0:
                raise OSError(ctypes.get_errno(), "inotify_add_watch", rel or self.root)
            self.dirs[wd] = rel
            if self.recursive:
                with os.scandir(dfd) as it:
                    for e in it:
                        if announce:
                            self.events.append(WatchEvent(os.path.join(rel, e.name), "create"))
                        if e.is_dir(follow_symlinks=False):
                            subs.append(e.name)
        finally:
            os.close(dfd)
        for name in subs:
            try:
                self._add(os.path.join(rel, name), announce)
            except OSError:
                pass  # gone again, or not a directory any more

    def _readable(self) -> None:
        while not self.closed:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            pos = 0
            while pos + 16 <= len(data):
                wd, mask, _, length = struct.unpack_from("iIII", data, pos)
                name = data[pos + 16:pos + 16 + length].rstrip(b"\0").decode(errors="replace")
                pos += 16 + length
                if mask & IN_IGNORED:
                    self.dirs.pop(wd, None)
                    continue
                base = self.dirs.get(wd)
                kind = _kind(mask)
                if base is None or kind is None or not name:
                    continue
                rel = os.path.join(base, name)
                self.events.append(WatchEvent(rel, kind))
                if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                    try:
                        self._add(rel, announce=True)
                    except OSError:
                        pass
                self.changed.set()

    def drain(self) -> list[WatchEvent]:
        out = list(self.events)
        self.events.clear()
        self.changed.clear()
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().remove_reader(self.fd)
            os.close(self.fd)
            self.changed.set()
