"""A container sandbox's files, reached from the host through its init's /proc/PID/root
with openat2(RESOLVE_IN_ROOT): nothing the sandbox does to its own tree (symlinks, bind
mounts, renames) can send a host-side file operation outside it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat as statmod
from collections.abc import Callable

from dsec.node.agent.watch import DirWatch
from dsec.node.host import linux
from dsec.shared.errors import InvalidRequest, NotFound, SandboxError
from dsec.shared.wire.models import FileStat, Owner


class ProcRootFiles:
    """A container's files, reached from the host through /proc/<init>/root with every
    lookup resolved in that root (openat2 RESOLVE_IN_ROOT), and its network namespace.
    The work is blocking syscalls, so each call runs in a thread."""

    def __init__(self, init_pid: int) -> None:
        self.init_pid = init_pid

    @property
    def root(self) -> str:
        return f"/proc/{self.init_pid}/root"

    async def exists(self, path: str) -> bool:
        return await asyncio.to_thread(self._exists, path)

    async def mkdirs(self, path: str, owner: Owner | None = None) -> None:
        await asyncio.to_thread(self._mkdirs, path, owner)

    async def read_file(self, path: str, limit: int) -> bytes:
        return await asyncio.to_thread(self._read_file, path, limit)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, owner: Owner | None = None) -> None:
        await asyncio.to_thread(self._write_file, path, data, mode, owner)

    async def stat(self, path: str) -> FileStat:
        return await asyncio.to_thread(self._stat, path)

    async def list_dir(self, path: str) -> list[FileStat]:
        return await asyncio.to_thread(self._list_dir, path)

    async def remove(self, path: str, recursive: bool) -> None:
        await asyncio.to_thread(self._remove, path, recursive)

    def watch(self, path: str, recursive: bool) -> DirWatch:
        """inotify on a directory of the sandbox (resolved in its root, never followed out)."""
        def open_dir(p: str) -> int:
            return self._open_in_root(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return DirWatch(open_dir, path, recursive)
        except FileNotFoundError:
            raise NotFound(f"no such directory: {path}", field="path") from None
        except OSError as e:
            raise InvalidRequest(f"{path}: {e.strerror}", field="path") from None

    async def set_xattrs(self, path: str, prefix: str, values: dict[str, str]) -> None:
        """Make the user.* extended attributes under ``prefix`` exactly ``values``
        (names relative to the prefix) on a regular file or directory."""
        def go() -> None:
            d, name = self._open_parent(path)
            try:
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
            finally:
                os.close(d)
            try:
                st = os.fstat(fd)
                if not (statmod.S_ISREG(st.st_mode) or statmod.S_ISDIR(st.st_mode)):
                    raise InvalidRequest(f"{path} is not a regular file or directory", field="path")
                at = f"/proc/self/fd/{fd}"  # an O_PATH fd: xattr calls go through its magic link
                for old in os.listxattr(at):
                    if old.startswith(prefix) and old[len(prefix):] not in values:
                        os.removexattr(at, old)
                for key, value in values.items():
                    os.setxattr(at, prefix + key, value.encode())
            finally:
                os.close(fd)
        if not prefix.startswith("user."):
            raise InvalidRequest("only user.* extended attributes can be set", field="prefix")
        await asyncio.to_thread(self._wrap_fs, go, path)

    async def move(self, source: str, destination: str) -> None:
        """rename(2) within the sandbox (destination's parents are made)."""
        def go() -> None:
            src_dir, src_name = self._open_parent(source)
            try:
                dst_dir, dst_name = self._open_parent(destination, create=True)
                try:
                    os.rename(src_name, dst_name, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
                finally:
                    os.close(dst_dir)
            finally:
                os.close(src_dir)
        await asyncio.to_thread(self._wrap_fs, go, source)

    async def connect(self, port: int) -> socket.socket:
        def go() -> socket.socket:
            sock = linux.socket_in_netns(f"/proc/{self.init_pid}/ns/net")
            sock.settimeout(10)
            try:
                sock.connect(("127.0.0.1", port))
            except OSError as e:
                sock.close()
                raise SandboxError(f"nothing answers on port {port} in the sandbox: {e.strerror}") from None
            return sock
        return await asyncio.to_thread(go)

    def _rootfd(self) -> int:
        return os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def _open_in_root(self, path: str, flags: int, mode: int = 0o644) -> int:
        rootfd = self._rootfd()
        try:
            return linux.openat2(rootfd, path, flags, mode)
        finally:
            os.close(rootfd)

    def _open_parent(self, path: str, create: bool = False, owner: Owner | None = None) -> tuple[int, str]:
        """An O_PATH fd of ``path``'s parent (made, with its parents, if ``create``, owned
        by ``owner`` when given) and the last component. Every lookup is scoped to the
        sandbox's root."""
        if not path.startswith("/"):
            raise InvalidRequest("path must be absolute", field="path")
        parent, name = os.path.split(os.path.normpath(path))
        if not name:
            raise InvalidRequest("path names the root directory", field="path")
        flags = os.O_PATH | os.O_DIRECTORY
        try:
            return self._open_in_root(parent, flags), name
        except FileNotFoundError:
            if not create:
                raise
        prefix = "/"
        for part in [p for p in parent.split("/") if p]:
            here = os.path.join(prefix, part)
            try:
                os.close(self._open_in_root(here, flags))
            except FileNotFoundError:
                up = self._open_in_root(prefix, flags)
                try:
                    os.mkdir(part, 0o755, dir_fd=up)
                    if owner is not None:
                        os.chown(part, *owner, dir_fd=up, follow_symlinks=False)
                except FileExistsError:
                    pass
                finally:
                    os.close(up)
            prefix = here
        return self._open_in_root(parent, flags), name

    def tree(self, path: str, limit: int = 100_000) -> list[tuple[str, int, int, int]]:
        """Regular files at or under ``path``: (path, size, mtime_ns, ctime_ns), not
        following symlinks; a missing path is an empty tree. Blocking."""
        out: list[tuple[str, int, int, int]] = []

        def walk(fd: int, here: str) -> None:
            with os.scandir(fd) as it:
                for e in it:
                    if len(out) >= limit:
                        return
                    st = e.stat(follow_symlinks=False)
                    child = os.path.join(here, e.name)
                    if statmod.S_ISREG(st.st_mode):
                        out.append((child, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
                    elif statmod.S_ISDIR(st.st_mode):
                        sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                        try:
                            walk(sub, child)
                        finally:
                            os.close(sub)

        try:
            fd = self._open_in_root(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            return out
        try:
            st = os.fstat(fd)
            if statmod.S_ISREG(st.st_mode):
                out.append((os.path.normpath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns))
            elif statmod.S_ISDIR(st.st_mode):
                walk(fd, os.path.normpath(path))
        finally:
            os.close(fd)
        return out

    def read_bytes(self, path: str, limit: int = 64 << 20) -> bytes:
        """Blocking read of a regular file (for the edge's own threads)."""
        return self._read_file(path, limit)

    def _wrap_fs(self, fn: Callable[[], object], path: str) -> object:
        try:
            return fn()
        except FileNotFoundError:
            raise NotFound(f"no such file or directory: {path}", field="path") from None
        except NotADirectoryError:
            raise InvalidRequest(f"a component of {path} is not a directory", field="path") from None
        except IsADirectoryError:
            raise InvalidRequest(f"{path} is a directory", field="path") from None
        except OSError as e:
            raise InvalidRequest(f"{path}: {e.strerror}", field="path") from None

    def _exists(self, path: str) -> bool:
        try:
            os.close(self._open_in_root(path, os.O_PATH))
            return True
        except OSError:
            return False

    def _mkdirs(self, path: str, owner: Owner | None = None) -> None:
        def go() -> None:
            os.close(self._open_parent(os.path.join(path, "x"), create=True, owner=owner)[0])
        self._wrap_fs(go, path)

    def _read_file(self, path: str, limit: int) -> bytes:
        def go() -> bytes:
            if not path.startswith("/"):
                raise InvalidRequest("path must be absolute", field="path")
            # O_NONBLOCK: a FIFO planted by the workload must not park an edge thread forever
            with os.fdopen(self._open_in_root(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                st = os.fstat(f.fileno())
                if not statmod.S_ISREG(st.st_mode):
                    raise InvalidRequest(f"{path} is not a regular file", field="path")
                os.set_blocking(f.fileno(), True)
                data = bytearray()
                while len(data) <= limit:  # in bounded reads: procfs refuses one of the whole limit (ENOMEM)
                    chunk = os.read(f.fileno(), min(1 << 20, limit + 1 - len(data)))
                    if not chunk:
                        break
                    data += chunk
            if len(data) > limit:
                raise InvalidRequest(f"{path} is larger than the {limit}-byte read limit", field="path")
            return bytes(data)
        return self._wrap_fs(go, path)  # type: ignore[return-value]

    def _write_file(self, path: str, data: bytes, mode: int = 0o644, owner: Owner | None = None) -> None:
        def go() -> None:
            os.close(self._open_parent(path, create=True, owner=owner)[0])
            # O_TRUNC: one change event per step for watchers (create, owner, write), and
            # the kernel ignores it on FIFOs and devices, which are refused just below
            fd = self._open_in_root(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, mode)
            with os.fdopen(fd, "wb") as f:
                if not statmod.S_ISREG(os.fstat(fd).st_mode):
                    raise InvalidRequest(f"{path} exists and is not a regular file", field="path")
                os.set_blocking(fd, True)
                if owner is not None:
                    os.fchown(fd, *owner)
                f.write(data)
        self._wrap_fs(go, path)

    def _stat(self, path: str) -> FileStat:
        def go() -> FileStat:
            if os.path.normpath(path) == "/":
                st = os.stat(self.root)
                return _filestat("/", "/", st, None)
            d, name = self._open_parent(path)
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                target = os.readlink(name, dir_fd=d) if statmod.S_ISLNK(st.st_mode) else None
                xattrs = _user_xattrs(d, name, st)
            finally:
                os.close(d)
            return _filestat(os.path.normpath(path), name, st, target, xattrs)
        return self._wrap_fs(go, path)  # type: ignore[return-value]

    def _list_dir(self, path: str) -> list[FileStat]:
        def go() -> list[FileStat]:
            fd = self._open_in_root(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                out = []
                for name in sorted(os.listdir(fd)):
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    target = os.readlink(name, dir_fd=fd) if statmod.S_ISLNK(st.st_mode) else None
                    out.append(_filestat(os.path.join(path, name), name, st, target, _user_xattrs(fd, name, st)))
                return out
            finally:
                os.close(fd)
        if not path.startswith("/"):
            raise InvalidRequest("path must be absolute", field="path")
        return self._wrap_fs(go, path)  # type: ignore[return-value]

    def _remove(self, path: str, recursive: bool) -> None:
        import shutil

        def go() -> None:
            d, name = self._open_parent(path)
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                if statmod.S_ISDIR(st.st_mode):
                    if recursive:
                        shutil.rmtree(name, dir_fd=d)
                    else:
                        os.rmdir(name, dir_fd=d)
                else:
                    os.unlink(name, dir_fd=d)
            finally:
                os.close(d)
        self._wrap_fs(go, path)


def _user_xattrs(dir_fd: int, name: str, st: os.stat_result) -> dict[str, str]:
    """The user.* extended attributes of ``name`` in ``dir_fd`` (regular files and
    directories: the only ones that can have them), values as text."""
    if not (statmod.S_ISREG(st.st_mode) or statmod.S_ISDIR(st.st_mode)):
        return {}
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return {}
    try:
        at = f"/proc/self/fd/{fd}"
        out = {}
        for key in os.listxattr(at):
            if key.startswith("user."):
                with contextlib.suppress(OSError):
                    out[key] = os.getxattr(at, key)[:4096].decode(errors="replace")
        return out
    except OSError:
        return {}
    finally:
        os.close(fd)


def _filestat(path: str, name: str, st: os.stat_result, target: str | None,
              xattrs: dict[str, str] | None = None) -> FileStat:
    if statmod.S_ISREG(st.st_mode):
        kind = "file"
    elif statmod.S_ISDIR(st.st_mode):
        kind = "dir"
    elif statmod.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "other"
    return FileStat(path=path, name=name, type=kind, size=st.st_size, mode=statmod.S_IMODE(st.st_mode),  # type: ignore[arg-type]
                    mtime=st.st_mtime, link_target=target, uid=st.st_uid, gid=st.st_gid, xattrs=xattrs or {})
