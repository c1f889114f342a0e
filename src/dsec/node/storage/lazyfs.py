"""The node's on-demand reader: a read-only FUSE filesystem that shows every data blob
of the shared store as a file, ``<mount>/<digest>``, and fetches its bytes only when
something reads them.

EROFS mounts the (local) metadata image with ``device=<mount>/<digest>``; a read of a
file in a sandbox becomes a read of a range of that blob, which this process serves
from, in order: a small memory cache, the node's chunk cache on local disk
(:mod:`dsec.node.storage.cache`), the shared store (one whole chunk, default 1 MiB). Every
chunk is checked against the blob's chunk index; a store read that is slow or fails
gives the reader EIO after ``fetch_timeout_s``, and the next read tries again.

``<digest>@<tag>`` is the same blob under a private inode: a sandbox created with
``record_access`` mounts its layers through such names, so its own page cache sits in
front of them and every chunk it touches is seen here and recorded, in first-touch
order, as the layer's access list (prefetch hint).

It runs as its own process (``python -m dsec.node.storage.lazyfs``), started by the edge and
left running across edge restarts, so mounted layers never lose their device. The edge
talks to it over a unix socket, one JSON request per line (:class:`LazyClient`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import signal
import stat
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from dsec.node.storage.backend import BackendKind, BlobBackend, open_backend
from dsec.node.storage.cache import ChunkCache
from dsec.node.storage.chunks import ChunkIndex
from dsec.shared.faults import failpoint_sync

log = logging.getLogger("dsec.lazyfs")
NAME_RE = re.compile(r"^([0-9a-f]{64})(?:@([A-Za-z0-9_-]{1,64}))?$")
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


class FetchError(Exception):
    pass


@dataclass
class BlobStats:
    remote_bytes: int = 0
    remote_chunks: int = 0
    hits: int = 0
    misses: int = 0
    errors: int = 0
    prefetched: int = 0
    latency_sum: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))

    def observe(self, seconds: float) -> None:
        self.latency_sum += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_buckets[i] += 1
                return
        self.latency_buckets[-1] += 1


class ChunkReader:
    """Chunks of data blobs, verified, through the memory and disk caches, fetched from
    the store at most once at a time per chunk."""

    def __init__(self, backend: BlobBackend, cache: ChunkCache, index_dir: str, fetch_timeout_s: float,
                 fetch_threads: int = 16, memory_bytes: int = 64 << 20) -> None:
        self.backend = backend
        self.cache = cache
        self.index_dir = index_dir
        self.fetch_timeout_s = fetch_timeout_s
        self._degraded_until = 0.0
        self._probing = False
        self._last_probe = 0.0
        self.memory_bytes = memory_bytes
        # Store reads run here. A hung store can hold every thread, never more: later
        # reads then wait for a thread and time out like the hung ones.
        self._pool = concurrent.futures.ThreadPoolExecutor(fetch_threads, thread_name_prefix="fetch")
        self._io = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="cache")
        self._mem: OrderedDict[bytes, bytes] = OrderedDict()
        self._mem_bytes = 0
        self._inflight: dict[bytes, asyncio.Future[bytes]] = {}
        self._indexes: dict[str, ChunkIndex] = {}
        self.stats: dict[str, BlobStats] = {}
        self.errors: list[dict[str, Any]] = []
        self.error_seq = 0
        os.makedirs(index_dir, exist_ok=True)

    def index(self, data: str) -> ChunkIndex:
        """The blob's chunk index. The edge copies it to the node before it mounts
        anything that reads the blob, so a lookup never waits on the store."""
        if (idx := self._indexes.get(data)) is not None:
            return idx
        with open(os.path.join(self.index_dir, f"{data}.chunks"), "rb") as f:
            idx = ChunkIndex.from_bytes(f.read())
        self._indexes[data] = idx
        return idx

    def blob_stats(self, data: str) -> BlobStats:
        return self.stats.setdefault(data, BlobStats())

    async def read(self, data: str, offset: int, size: int, seen: set[int] | None = None,
                   order: list[int] | None = None) -> bytes:
        idx = self.index(data)
        parts = []
        for c in idx.chunks_for(offset, size):
            if seen is not None and order is not None and c not in seen:
                seen.add(c)
                order.append(c)
            chunk = await self.chunk(data, idx, c)
            start, _ = idx.span(c)
            lo = max(offset - start, 0)
            hi = min(offset + size - start, len(chunk))
            parts.append(chunk[lo:hi])
        return b"".join(parts)

    async def chunk(self, data: str, idx: ChunkIndex, c: int, prefetch: bool = False) -> bytes:
        digest = idx.hashes[c]
        st = self.blob_stats(data)
        if (hit := self._mem.get(digest)) is not None:
            self._mem.move_to_end(digest)
            if not prefetch:
                st.hits += 1
            return hit
        if (pending := self._inflight.get(digest)) is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._inflight[digest] = fut
        try:
            got = await self._load(data, idx, c, st, prefetch)
            fut.set_result(got)
            self._remember(digest, got)
            return got
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" noise when nobody else waited
            raise
        finally:
            del self._inflight[digest]

    async def _load(self, data: str, idx: ChunkIndex, c: int, st: BlobStats, prefetch: bool) -> bytes:
        loop = asyncio.get_running_loop()
        digest = idx.hashes[c]
        cached = await loop.run_in_executor(self._io, self.cache.get, digest)
        if cached is not None:
            if not prefetch:
                st.hits += 1
            return cached
        if prefetch:
            st.prefetched += 1
        else:
            st.misses += 1
        off, length = idx.span(c)
        t0 = time.monotonic()
        timeout, probe = self._timeout()
        try:
            got = await asyncio.wait_for(loop.run_in_executor(self._pool, self._fetch, data, off, length, digest),
                                         timeout)
        except (TimeoutError, FetchError, OSError) as e:
            if isinstance(e, TimeoutError):
                self._degraded_until = time.monotonic() + 2 * self.fetch_timeout_s
                if timeout >= self.fetch_timeout_s:  # a full wait that failed counts as the latest probe
                    self._last_probe = time.monotonic()
            st.errors += 1
            reason = "timed out" if isinstance(e, TimeoutError) else str(e)
            self._error(data, c, f"chunk {c} of {data[:12]}: shared store read {reason}")
            raise FetchError(reason) from None
        finally:
            if probe:
                self._probing = False
        self._degraded_until = 0.0
        st.observe(time.monotonic() - t0)
        st.remote_bytes += len(got)
        st.remote_chunks += 1
        await loop.run_in_executor(self._io, self.cache.put, digest, got)
        return got

    def _timeout(self) -> tuple[float, bool]:
        """(timeout, is_probe) for a new fetch. Right after a fetch timed out, the kernel
        retries the failed range page by page (EROFS, then FUSE readahead); each retry
        waiting a full timeout would hold the reader for minutes. So while the store is
        known stalled, one fetch at a time probes it with the full timeout and the others
        get a short grace; the first success ends that."""
        now = time.monotonic()
        if now >= self._degraded_until:
            return self.fetch_timeout_s, False
        if not self._probing and now - self._last_probe >= self.fetch_timeout_s:
            self._probing = True
            self._last_probe = now
            return self.fetch_timeout_s, True
        return min(self.fetch_timeout_s, 0.5), False

    def _fetch(self, data: str, off: int, length: int, digest: bytes) -> bytes:
        failpoint_sync("store.read")  # (inherited from the edge's environment; tests only)
        for _ in range(3):  # a short or torn read is retried, then refused
            got = self.backend.read_range(f"{data}.data", off, length)
            if len(got) == length and hashlib.sha256(got).digest() == digest:
                return got
        raise FetchError(f"chunk at {off} does not match its checksum")

    def _remember(self, digest: bytes, chunk: bytes) -> None:
        if digest in self._mem:
            return
        self._mem[digest] = chunk
        self._mem_bytes += len(chunk)
        while self._mem_bytes > self.memory_bytes and self._mem:
            _, old = self._mem.popitem(last=False)
            self._mem_bytes -= len(old)

    def drop_memory(self) -> None:
        self._mem.clear()
        self._mem_bytes = 0

    def _error(self, data: str, chunk: int, message: str) -> None:
        self.error_seq += 1
        self.errors.append({"seq": self.error_seq, "t": time.time(), "data": data, "chunk": chunk,
                            "message": message})
        del self.errors[:-256]
        log.warning("%s", message)

    async def prefetch(self, data: str, chunks: list[int], parallel: int = 4) -> None:
        """Warm the cache with ``chunks`` in order, a few at a time, in the background."""
        idx = self.index(data)
        todo = iter([c for c in chunks if 0 <= c < idx.count])

        async def worker() -> None:
            for c in todo:
                with contextlib.suppress(FetchError, OSError):
                    await self.chunk(data, idx, c, prefetch=True)

        await asyncio.gather(*(worker() for _ in range(parallel)))

    def snapshot(self) -> dict[str, Any]:
        return {"blobs": {d: vars(s) for d, s in self.stats.items()},
                "cache": {"bytes": self.cache.bytes, "max_bytes": self.cache.max_bytes, "entries": self.cache.entries,
                          "evictions": self.cache.evictions, "corrupt": self.cache.corrupt,
                          "written_bytes": self.cache.written_bytes},
                "latency_buckets": list(LATENCY_BUCKETS)}


@dataclass
class Node:
    inode: int
    name: str
    data: str
    size: int
    seen: set[int] = field(default_factory=set)
    order: list[int] = field(default_factory=list)
    recording: bool = False


def _fuse_ops(reader: ChunkReader) -> Any:
    import pyfuse3

    class LazyFS(pyfuse3.Operations):
        def __init__(self) -> None:
            super().__init__()
            self.by_name: dict[str, Node] = {}
            self.by_inode: dict[int, Node] = {}
            self.next_inode = pyfuse3.ROOT_INODE + 1
            self.started = time.time_ns()

        def node(self, name: str) -> Node:
            if (n := self.by_name.get(name)) is not None:
                return n
            m = NAME_RE.match(name)
            if not m:
                raise pyfuse3.FUSEError(errno.ENOENT)
            try:
                idx = reader.index(m.group(1))
            except (OSError, ValueError):
                raise pyfuse3.FUSEError(errno.ENOENT) from None
            n = Node(self.next_inode, name, m.group(1), idx.size, recording=m.group(2) is not None)
            self.next_inode += 1
            self.by_name[name] = self.by_inode[n.inode] = n
            return n

        def attrs(self, inode: int) -> pyfuse3.EntryAttributes:
            a = pyfuse3.EntryAttributes()
            a.st_ino = pyfuse3.InodeT(inode)
            a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self.started
            a.st_uid = a.st_gid = 0
            a.entry_timeout = a.attr_timeout = 3600.0  # blobs never change
            a.st_blksize = 1 << 20
            if inode == pyfuse3.ROOT_INODE:
                a.st_mode = stat.S_IFDIR | 0o555
                a.st_nlink = 2
                return a
            n = self.by_inode.get(inode)
            if n is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            a.st_mode = stat.S_IFREG | 0o444
            a.st_nlink = 1
            a.st_size = n.size
            a.st_blocks = -(-n.size // 512)
            return a

        async def lookup(self, parent_inode: pyfuse3.InodeT, name: pyfuse3.FileNameT,
                         ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
            if parent_inode != pyfuse3.ROOT_INODE:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self.attrs(self.node(os.fsdecode(name)).inode)

        async def getattr(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
            return self.attrs(inode)

        async def open(self, inode: pyfuse3.InodeT, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
            if inode not in self.by_inode:
                raise pyfuse3.FUSEError(errno.ENOENT)
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise pyfuse3.FUSEError(errno.EROFS)
            return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(inode), keep_cache=True)

        async def read(self, fh: pyfuse3.FileHandleT, off: int, size: int) -> bytes:
            n = self.by_inode[fh]
            try:
                if n.recording:
                    return await reader.read(n.data, off, size, n.seen, n.order)
                return await reader.read(n.data, off, size)
            except (FetchError, OSError):
                raise pyfuse3.FUSEError(errno.EIO) from None

        async def opendir(self, inode: pyfuse3.InodeT, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
            if inode != pyfuse3.ROOT_INODE:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            return pyfuse3.FileHandleT(inode)

        async def readdir(self, fh: pyfuse3.FileHandleT, start_id: int, token: pyfuse3.ReaddirToken) -> None:
            nodes = sorted(self.by_inode.values(), key=lambda n: n.inode)
            for n in nodes:
                if n.inode <= start_id:
                    continue
                if not pyfuse3.readdir_reply(token, os.fsencode(n.name), self.attrs(n.inode), n.inode):
                    break

        async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
            s = pyfuse3.StatvfsData()
            s.f_bsize = s.f_frsize = 4096
            s.f_namemax = 255
            return s

        def forget_name(self, name: str) -> None:
            n = self.by_name.pop(name, None)
            if n is not None:
                self.by_inode.pop(n.inode, None)

    return LazyFS()


async def _serve(args: argparse.Namespace) -> None:
    import pyfuse3
    import pyfuse3.asyncio

    pyfuse3.asyncio.enable()
    backend = open_backend(args.store, args.backend)
    reader = ChunkReader(backend, ChunkCache(args.cache_dir, args.cache_bytes), args.index_dir,
                         args.fetch_timeout_s)
    ops = _fuse_ops(reader)
    tasks: set[asyncio.Task[None]] = set()

    async def control(req: dict[str, Any]) -> Any:
        op = req.get("op")
        if op == "ping":
            return {"pid": os.getpid()}
        if op == "stats":
            return reader.snapshot()
        if op == "errors":
            return [e for e in reader.errors if e["seq"] > int(req.get("since", 0))]
        if op == "prefetch":
            t = asyncio.create_task(reader.prefetch(str(req["data"]), [int(c) for c in req["chunks"]]))
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            return {"queued": len(req["chunks"])}
        if op == "recorded":
            n = ops.by_name.get(str(req["name"]))
            chunks = list(n.order) if n else []
            if req.get("forget"):
                ops.forget_name(str(req["name"]))
            return {"chunks": chunks}
        if op == "drop_cache":  # benchmarks and tests: start cold (memory tier only with memory_only)
            reader.drop_memory()
            if not req.get("memory_only"):
                reader.cache.clear()
            return {}
        if op == "shutdown":
            pyfuse3.terminate()
            return {}
        raise ValueError(f"unknown op {op!r}")

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while line := await r.readline():
                try:
                    out = {"ok": True, "result": await control(json.loads(line))}
                except Exception as e:  # the reply names the problem; the daemon keeps serving
                    out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                w.write(json.dumps(out).encode() + b"\n")
                await w.drain()
        w.close()

    with contextlib.suppress(FileNotFoundError):
        os.unlink(args.socket)
    server = await asyncio.start_unix_server(handle, args.socket)
    os.chmod(args.socket, 0o600)
    opts = set(pyfuse3.default_options) | {"fsname=dsec-lazy", "ro", "allow_other"}
    pyfuse3.init(ops, args.mount, opts)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pyfuse3.terminate)
    log.info("serving %s from %s on %s", args.mount, args.store, args.socket)
    try:
        await pyfuse3.main(min_tasks=4, max_tasks=64)
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.socket)
        pyfuse3.close(unmount=True)
        reader._pool.shutdown(wait=False, cancel_futures=True)


class LazyClient:
    """The edge's side of the control socket."""

    def __init__(self, socket_path: str, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    async def call(self, op: str, **kw: Any) -> Any:
        async def go() -> Any:
            r, w = await asyncio.open_unix_connection(self.socket_path, limit=64 << 20)
            try:
                w.write(json.dumps({"op": op, **kw}).encode() + b"\n")
                await w.drain()
                line = await r.readline()
            finally:
                w.close()
            if not line:
                raise ConnectionError("lazyfs closed the connection")
            reply = json.loads(line)
            if not reply["ok"]:
                raise RuntimeError(reply["error"])
            return reply["result"]

        return await asyncio.wait_for(go(), self.timeout_s)


def main() -> None:
    p = argparse.ArgumentParser(prog="dsec-lazyfs", description=__doc__.split("\n\n")[0])
    p.add_argument("--mount", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--backend", default="sharedfs", choices=["local", "sharedfs"])
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--cache-bytes", type=int, default=10 << 30)
    p.add_argument("--index-dir", required=True)
    p.add_argument("--socket", required=True)
    p.add_argument("--fetch-timeout-s", type=float, default=20.0)
    args = p.parse_args()
    backend: BackendKind = args.backend
    args.backend = backend
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
