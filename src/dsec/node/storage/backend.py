"""Where layer blobs live: the blob backend interface and its two implementations.

A backend stores immutable named files (``<digest>.erofs`` metadata images,
``<digest>.data`` data blobs, ``<digest>.chunks`` chunk indexes) and hands back byte
ranges of them. The layer catalog and the node-side reader (:mod:`dsec.node.storage.lazyfs`)
only use this interface, so a later object-store backend slots in beside these.

* ``local``: a directory on this node (the embedded default, ``DATA/layers``). Nodes
  mount blobs straight from it.
* ``sharedfs``: a directory on a distributed filesystem mounted at the same path on
  every node (how DSec uses 3FS; tested with MooseFS). Nodes copy the small metadata
  images to local disk and read data blobs on demand, in chunks, through a local cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Literal, Protocol

BackendKind = Literal["local", "sharedfs"]


class BlobBackend(Protocol):
    kind: BackendKind
    root: str

    def path(self, name: str) -> str:
        """A path a process on this node can open for ``name`` (for mounting and reading)."""
        ...

    def exists(self, name: str) -> bool: ...

    def size(self, name: str) -> int: ...

    def put(self, src: str, name: str) -> None:
        """Store the file at ``src`` as ``name``, atomically (readers never see a partial blob)."""
        ...

    def read_range(self, name: str, offset: int, size: int) -> bytes: ...

    def remove(self, name: str) -> None: ...

    def names(self) -> list[str]: ...

    def tempdir(self) -> str:
        """A scratch directory on the same filesystem, so that ``put`` of a file made
        there is a rename."""
        ...


class DirBackend:
    """Blobs as files under ``root/blobs/sha256``; serves both kinds, which differ in
    how nodes read them (directly or on demand), not in how they are stored."""

    def __init__(self, root: str, kind: BackendKind = "local") -> None:
        self.kind: BackendKind = kind
        self.root = os.path.abspath(root)
        self.blob_dir = os.path.join(self.root, "blobs", "sha256")
        os.makedirs(self.blob_dir, exist_ok=True)
        os.makedirs(self.tempdir(), exist_ok=True)

    def path(self, name: str) -> str:
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad blob name {name!r}")
        return os.path.join(self.blob_dir, name)

    def exists(self, name: str) -> bool:
        return os.path.exists(self.path(name))

    def size(self, name: str) -> int:
        return os.path.getsize(self.path(name))

    def put(self, src: str, name: str) -> None:
        dest = self.path(name)
        if os.path.exists(dest):
            return
        if os.path.abspath(src).startswith(self.tempdir() + os.sep):  # same filesystem: a rename
            os.chmod(src, 0o444)
            os.replace(src, dest)
            return
        fd, tmp = tempfile.mkstemp(dir=self.tempdir())
        os.close(fd)
        try:
            shutil.copyfile(src, tmp)
            os.chmod(tmp, 0o444)
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def read_range(self, name: str, offset: int, size: int) -> bytes:
        fd = os.open(self.path(name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        os.unlink(self.path(name))

    def names(self) -> list[str]:
        return os.listdir(self.blob_dir)

    def tempdir(self) -> str:
        return os.path.join(self.root, "tmp")


def open_backend(root: str, kind: BackendKind | None = None) -> DirBackend:
    """The backend for a store root. ``sharedfs`` insists that ``root`` is on a
    filesystem of its own (a distributed filesystem's mount), not on this node's root
    filesystem, so that a plain local directory is never mistaken for shared storage."""
    kind = kind or "local"
    if kind == "sharedfs":
        if not os.path.isdir(root):
            raise ValueError(f"shared store {root!r} is not a directory (is the shared filesystem mounted?)")
        if _device_of(root) == _device_of("/"):
            raise ValueError(f"shared store {root!r} is on this node's root filesystem, not a shared mount")
    return DirBackend(root, kind)


def _device_of(path: str) -> int:
    return os.stat(path).st_dev
