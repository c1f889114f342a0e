"""Layer images on one node: turning a published image into a mounted EROFS filesystem.

How an image reaches the mount depends on the store and the fetch mode:

* local store: the metadata image and its data blob are mounted where they lie.
* shared store, ``ondemand`` (default): the metadata image and chunk index are copied to
  local disk (small, verified against their digests), and the data blob is read through
  the node's lazy reader (:mod:`dsec.node.storage.lazyfs`), chunk by chunk, as files are read.
* shared store, ``eager``: metadata and the whole data blob are copied to local disk
  first (the baseline that on-demand loading is measured against).

One mount per image per node (``DATA/layers/mnt/<digest>``), shared by every sandbox;
a sandbox that records its access list gets private mounts under its own directory.
The edge calls this through :class:`NodeLayers` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from dsec.node.host import linux
from dsec.node.layers.store import LayerStore, check_erofs, sha256_file
from dsec.node.storage.chunks import ChunkIndex
from dsec.node.storage.lazyfs import LazyClient
from dsec.shared.errors import SandboxError
from dsec.shared.faults import failpoint

log = logging.getLogger("dsec.storage")
FetchMode = Literal["ondemand", "eager"]
T = TypeVar("T")
# reads of the shared store that may hang (a stalled storage node) run on threads of their
# own: a stuck read keeps its thread, and must never take one the rest of the edge needs
STORE_IO_THREADS = 16
SCRATCH_MAX_AGE_MIN = 24 * 60


class NodeLayers:
    def __init__(self, store: LayerStore, data_dir: str, run_dir: str, mode: FetchMode = "ondemand",
                 cache_bytes: int = 10 << 30, fetch_timeout_s: float = 20.0,
                 on_error: Callable[[str, str], None] | None = None) -> None:
        self.store = store
        self.mode = mode
        self.cache_bytes = cache_bytes
        self.fetch_timeout_s = fetch_timeout_s
        self.on_error = on_error or (lambda data, msg: log.warning("%s", msg))
        self.mnt_dir = os.path.join(data_dir, "layers", "mnt")
        node = os.path.join(data_dir, "node")
        self.meta_dir = os.path.join(node, "meta")
        self.full_dir = os.path.join(node, "full")
        self.cache_dir = os.path.join(node, "cache")
        self.lazy_mnt = os.path.join(node, "lazy")
        self.log_path = os.path.join(node, "lazyfs.log")
        for d in (self.mnt_dir, self.meta_dir, self.full_dir, self.cache_dir, self.lazy_mnt):
            os.makedirs(d, exist_ok=True)
        self.lazy = LazyClient(os.path.join(run_dir, "lazyfs.sock"))
        self._lock = asyncio.Lock()  # the reader process
        self._mounting: dict[str, asyncio.Lock] = {}  # one mount of each target at a time
        self._io = ThreadPoolExecutor(STORE_IO_THREADS, thread_name_prefix="dsec-store")
        self._poll: asyncio.Task[None] | None = None
        self._sweep: asyncio.Task[None] | None = None
        self._error_seq = 0
        self.snapshot: dict[str, Any] = {}
        # bytes this node copied whole from the store (metadata, eager data blobs)
        self.copied_bytes = 0
        # image digest -> its data blob (None: metadata only), as read when it was prepared: a
        # storage error names a data blob, and which sandboxes it hurts must be found without a
        # catalog read on the event loop (the store that failed may hold the catalog)
        self.data_blob: dict[str, str | None] = {}

    @property
    def on_demand(self) -> bool:
        return self.store.backend.kind == "sharedfs" and self.mode == "ondemand"

    # ---- the lazy reader process --------------------------------------------------
    async def start(self) -> None:
        self._sweep = asyncio.create_task(self.sweep_scratch())
        if not self.on_demand:
            return
        await self._ensure_reader()
        self._poll = asyncio.create_task(self._poll_loop())

    async def sweep_scratch(self, max_age_min: int = SCRATCH_MAX_AGE_MIN) -> None:
        """Remove layer-build scratch dirs in the store older than ``max_age_min`` (a
        builder killed mid-build leaves one; on a shared store, other nodes' builds in
        progress are younger). In a process of its own, bounded, like every other store
        access of the edge's that may stall (see :meth:`_fetch`)."""
        proc = await asyncio.create_subprocess_exec(
            "find", self.store.backend.tempdir(), "-mindepth", "1", "-maxdepth", "1", "-mmin", f"+{max_age_min}",
            "-exec", "rm", "-rf", "{}", "+", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        try:
            async with asyncio.timeout(300):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            log.warning("sweeping the store's scratch dirs took over 300 s; left for the next start")
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise

    async def _alive(self) -> bool:
        try:
            await self.lazy.call("ping")
            return True
        except (TimeoutError, OSError, RuntimeError, ValueError):
            return False

    async def _ensure_reader(self) -> None:
        if await self._alive():
            return
        # A reader that died leaves its mount behind (ENOTCONN): layers mounted through
        # it cannot be revived. Detach them all, so that new sandboxes mount afresh
        # through the new reader; sandboxes already on them keep them (their reads fail).
        if self.lazy_mnt in linux.mounted_under(self.lazy_mnt):
            log.warning("lazy layer reader died; layer mounts made through it are detached")
            for mp in linux.mounted_under(self.mnt_dir):
                with contextlib.suppress(OSError):
                    linux.umount(mp, detach=True)
            with contextlib.suppress(OSError):
                linux.umount(self.lazy_mnt, detach=True)
        cmd = [sys.executable, "-m", "dsec.node.storage.lazyfs", "--mount", self.lazy_mnt,
               "--store", self.store.root, "--backend", self.store.backend.kind,
               "--cache-dir", self.cache_dir, "--cache-bytes", str(self.cache_bytes),
               "--index-dir", self.meta_dir, "--socket", self.lazy.socket_path,
               "--fetch-timeout-s", str(self.fetch_timeout_s)]
        proc = await asyncio.to_thread(self._spawn, cmd)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SandboxError(f"the lazy layer reader exited with {proc.returncode}; see {self.log_path}")
            if await self._alive():
                log.info("lazy layer reader pid %d on %s", proc.pid, self.lazy_mnt)
                return
            await asyncio.sleep(0.05)
        proc.kill()
        raise SandboxError(f"the lazy layer reader did not start; see {self.log_path}")

    def _spawn(self, cmd: list[str]) -> subprocess.Popen[bytes]:
        with open(self.log_path, "ab") as logf:
            # its own session: it outlives an edge restart, so mounted layers keep their device
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)

    async def _poll_loop(self) -> None:
        while True:
            try:
                self.snapshot = await self.lazy.call("stats")
                for e in await self.lazy.call("errors", since=self._error_seq):
                    self._error_seq = max(self._error_seq, int(e["seq"]))
                    self.on_error(str(e["data"]), str(e["message"]))
            except (TimeoutError, OSError, RuntimeError, ValueError) as e:
                log.warning("lazy layer reader unreachable: %s", e)
                with contextlib.suppress(OSError, SandboxError):
                    async with self._lock:
                        await self._ensure_reader()
            await asyncio.sleep(1.0)

    async def fresh_snapshot(self) -> dict[str, Any]:
        """The reader's counters as of now (the polled copy can be a second old, and empty
        just after a reader restart); the polled copy when the reader does not answer."""
        if self.on_demand:
            with contextlib.suppress(TimeoutError, OSError, RuntimeError, ValueError):
                self.snapshot = await self.lazy.call("stats")
        return self.snapshot

    async def close(self, sandboxes_left: bool) -> None:
        if self._sweep:
            self._sweep.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await self._sweep
        if self._poll:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
        if self.on_demand and not sandboxes_left and not linux.mounted_under(self.mnt_dir):
            with contextlib.suppress(OSError, TimeoutError, RuntimeError):
                pid = int((await self.lazy.call("ping"))["pid"])
                await self.lazy.call("shutdown")
                for _ in range(200):  # it unmounts itself on the way out
                    if not os.path.exists(f"/proc/{pid}"):
                        break
                    await asyncio.sleep(0.05)

    # ---- mounting -------------------------------------------------------------
    async def mount(self, digest: str, target: str | None = None, record_tag: str | None = None) -> str:
        """Mount image ``digest`` read-only; at the shared node mount point unless
        ``target`` is given (a private mount, read through ``<data>@<record_tag>``)."""
        shared = target is None
        target = target or os.path.join(self.mnt_dir, digest)
        if self.on_demand:
            async with self._lock:
                await self._ensure_reader()
        # per image, not node-wide: a store that stalls on one image holds only the
        # creates that need it
        async with self._mounting.setdefault(target, asyncio.Lock()):
            if shared and os.path.ismount(target):
                if digest not in self.data_blob and self.store.backend.kind != "local":
                    # mounted by an edge before a restart: learn its data blob, for storage
                    # errors (a hint: the mount is there, so a store away now fails nothing)
                    with contextlib.suppress(SandboxError):
                        self.data_blob[digest] = await self.store_io(
                            f"the catalog entry of {digest[:12]}", self.store.data_of, digest)
                return target
            source, opts = await self._prepare(digest, record_tag)
            os.makedirs(target, exist_ok=True)
            try:
                linux.mount(source, target, "erofs", linux.MS_RDONLY, opts)
            except OSError as e:
                raise SandboxError(f"layer image {digest[:12]} does not mount (corrupt?): {e.strerror}") from None
        return target

    async def image_files(self, digest: str) -> tuple[str, str | None]:
        """Image ``digest`` as files for a VM's read-only disks, without mounting it on
        the host: (metadata image, data blob or None). From a shared store read on
        demand the blob is the lazy reader's file, so the guest's reads fetch chunks."""
        if self.on_demand:
            async with self._lock:
                await self._ensure_reader()
        source, opts = await self._prepare(digest, None)
        return source, opts.removeprefix("device=") if opts else None

    @property
    def catalog_local(self) -> bool:
        """Whether the layer catalog is this node's own SQLite file (else a shared store's
        file or the cluster's database: reads that can stall, kept off the event loop)."""
        return self.store.backend.kind == "local" and self.store.catalog.engine.dialect.name == "sqlite"

    async def store_io(self, what: str, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """``fn(*args)`` against the shared store, on the store's threads, within the
        fetch bound; a miss is the request's clear error."""
        limit = timeout or self.fetch_timeout_s
        try:
            if self.store.backend.kind != "local":  # (a local store is this node's own disk)
                await failpoint("store.read")
            return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(self._io, fn, *args), limit)
        except TimeoutError:
            raise self._failed(what, f"shared layer store did not deliver {what} within {limit:g} s") from None
        except OSError as e:
            raise self._failed(what, f"shared layer store: cannot read {what}: {e.strerror or e}") from None

    def _failed(self, what: str, message: str) -> SandboxError:
        """A read from the store failed: the edge counts it (its health) and the error is
        the request's."""
        self.on_error(what, message)
        return SandboxError(message)

    async def _prepare(self, digest: str, record_tag: str | None) -> tuple[str, str | None]:
        data = await self.store_io(f"the catalog entry of {digest[:12]}", self.store.data_of, digest)
        self.data_blob[digest] = data
        if self.store.backend.kind == "local":
            return self.store.mount_args(digest)
        meta = await self._copy(f"{digest}.erofs", self.meta_dir, digest)
        check_erofs(meta)
        if data is None:
            return meta, None
        if self.on_demand:
            await self._fetch_index(data)
            return meta, f"device={self.lazy_mnt}/{data}" + (f"@{record_tag}" if record_tag else "")
        return meta, f"device={await self._copy(f'{data}.data', self.full_dir, data)}"

    async def _copy(self, name: str, dest_dir: str, digest: str) -> str:
        dest = os.path.join(dest_dir, name)
        if os.path.exists(dest):
            return dest
        tmp = await self._fetch(name, dest)
        if await asyncio.to_thread(sha256_file, tmp) != digest:
            os.unlink(tmp)
            raise SandboxError(f"{name[:12]} from the shared store does not match its digest")
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
        return dest

    async def _fetch_index(self, data: str) -> None:
        """Copy the blob's chunk index to the node (checked), once: the reader looks it up there."""
        dest = os.path.join(self.meta_dir, f"{data}.chunks")
        if os.path.exists(dest):
            return
        tmp = await self._fetch(f"{data}.chunks", dest)
        try:
            with open(tmp, "rb") as f:
                ChunkIndex.from_bytes(f.read())
        except ValueError:
            os.unlink(tmp)
            raise
        os.replace(tmp, dest)

    async def _fetch(self, name: str, dest: str) -> str:
        """Copy a store file next to ``dest`` with cp, a process of its own: a stalled
        store then holds that process, never a file of the edge's (a child the edge forks
        closes every fd it inherits, and closing a FUSE file with a read stuck on it
        blocks; the edge's fork would block with it). The bound is on progress, not on
        the whole copy: a large image arriving steadily takes what it takes, a store
        that delivers nothing for ``fetch_timeout_s`` fails the request. Returns the
        copy's path."""
        tmp = f"{dest}.{os.getpid()}.tmp"
        limit = self.fetch_timeout_s
        try:
            await failpoint("store.read")
        except OSError as e:
            raise self._failed(name[:12], f"shared layer store: cannot read {name[:12]}: {e.strerror}") from None
        proc = await asyncio.create_subprocess_exec(
            "cp", "--", self.store.backend.path(name), tmp, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        done = asyncio.ensure_future(proc.communicate())
        try:
            copied, since = -1, time.monotonic()
            while not done.done():
                await asyncio.wait([done], timeout=min(limit, 0.5))
                size = _size(tmp)
                if size != copied:
                    copied, since = size, time.monotonic()
                elif time.monotonic() - since >= limit and not done.done():
                    raise TimeoutError
            _, err = done.result()
        except BaseException:
            done.cancel()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # reaped by asyncio's child watcher when the store lets it go
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if isinstance(sys.exc_info()[1], TimeoutError):
                raise self._failed(name[:12], f"shared layer store did not deliver {name[:12]} within {limit:g} s"
                                   ) from None
            raise
        if proc.returncode != 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            why = err.decode(errors="replace").strip().rsplit(": ", 1)[-1]
            raise self._failed(name[:12], f"shared layer store: cannot read {name[:12]}: {why}")
        self.copied_bytes += os.path.getsize(tmp)
        return tmp

    async def release(self, in_use: set[str]) -> None:
        """Unmount node-shared layer mounts no sandbox uses any more."""
        for mp in linux.mounted_under(self.mnt_dir):
            if os.path.basename(mp) not in in_use:
                async with self._mounting.setdefault(mp, asyncio.Lock()):
                    with contextlib.suppress(OSError):
                        linux.umount(mp)

    # ---- prefetch and recording ---------------------------------------------
    async def prefetch(self, digests: list[str]) -> int:
        """Queue the recorded access lists of these images' data blobs; returns chunks queued."""
        if not self.on_demand:
            return 0
        queued = 0
        for digest in digests:
            try:  # a hint: never the reason a create fails
                data = await self.store_io(f"the catalog entry of {digest[:12]}", self.store.data_of, digest)
                chunks = await self.store_io("an access list", self.store.access_list, data) if data else []
                if not (data and chunks):
                    continue
                async with self._lock:
                    await self._ensure_reader()
                await self._fetch_index(data)
                await self.lazy.call("prefetch", data=data, chunks=chunks)
                queued += len(chunks)
            except (OSError, TimeoutError, RuntimeError, ValueError, SandboxError) as e:
                log.warning("prefetch for %s not queued: %s", digest[:12], e)
        return queued

    async def recorded(self, digest: str, record_tag: str, forget: bool = False) -> tuple[str, list[int]] | None:
        """(data blob, chunks in first-touch order) that the private mount read so far."""
        if not self.on_demand:
            return None
        data = await self.store_io(f"the catalog entry of {digest[:12]}", self.store.data_of, digest)
        if data is None:
            return None
        got = await self.lazy.call("recorded", name=f"{data}@{record_tag}", forget=forget)
        return data, [int(c) for c in got["chunks"]]


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1
