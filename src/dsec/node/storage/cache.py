"""The node's second-level chunk cache: verified chunks of data blobs on local disk.

Chunks are stored by their own sha256 (``<root>/<2 hex>/<64 hex>``), so a chunk shared
by two blobs is stored once, and every read is checked against the name it was asked
for: a torn write (crash mid-write) or a corrupt file is deleted and reported as a miss,
never served. Writes go to a temporary file and are renamed into place, so concurrent
readers only ever see whole files. The cache is bounded in bytes and evicts least
recently used chunks; recency is the file's mtime, so the order survives a restart.
Thread-safe: the reader calls it from worker threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
from collections import OrderedDict


class ChunkCache:
    def __init__(self, root: str, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0
        self.evictions = 0
        self.corrupt = 0
        self.written_bytes = 0
        os.makedirs(root, exist_ok=True)
        self._load()

    def _load(self) -> None:
        found: list[tuple[float, str, int]] = []
        for sub in os.listdir(self.root):
            d = os.path.join(self.root, sub)
            if not os.path.isdir(d):
                continue
            for name in os.listdir(d):
                path = os.path.join(d, name)
                if name.startswith(".tmp"):  # a write cut short by a crash
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    continue
                with contextlib.suppress(OSError):
                    st = os.stat(path)
                    found.append((st.st_mtime, name, st.st_size))
        for _, name, size in sorted(found):
            self._lru[name] = size
            self.bytes += size
        self._evict()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key)

    @property
    def entries(self) -> int:
        return len(self._lru)

    def get(self, digest: bytes) -> bytes | None:
        key = digest.hex()
        with self._lock:
            if key not in self._lru:
                return None
            self._lru.move_to_end(key)
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            self._drop(key)
            return None
        if hashlib.sha256(data).digest() != digest:
            self.corrupt += 1
            self._drop(key)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        return data

    def put(self, digest: bytes, data: bytes) -> None:
        """Store a chunk the caller has already verified against ``digest``."""
        key = digest.hex()
        with self._lock:
            if key in self._lru:
                return
        d = os.path.join(self.root, key[:2])
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with self._lock:
            if key not in self._lru:
                self._lru[key] = len(data)
                self.bytes += len(data)
                self.written_bytes += len(data)
            self._evict()

    def _drop(self, key: str) -> None:
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self.bytes -= size

    def _evict(self) -> None:
        """Called with the lock held (or before the cache is shared)."""
        while self.bytes > self.max_bytes and self._lru:
            key, size = self._lru.popitem(last=False)
            self.bytes -= size
            self.evictions += 1
            with contextlib.suppress(OSError):
                os.unlink(self._path(key))

    def clear(self) -> None:
        with self._lock:
            for key in list(self._lru):
                with contextlib.suppress(OSError):
                    os.unlink(self._path(key))
            self._lru.clear()
            self.bytes = 0
