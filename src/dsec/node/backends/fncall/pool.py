"""FnCall on one edge: pools of pre-created containers with warm worker processes.

Per FnCall image a pool keeps containers created through the edge like any sandbox
(label ``dsec-role=fncall``), each running ``WORKERS`` warm workers
(:mod:`dsec.node.backends.fncall.worker`), each under its own unprivileged uid. A call takes
an idle worker (starting a container when all are busy, up to ``max_containers``),
sends it the code, and gets runs back; the edge never provisions anything per call.
A worker that reports its call left something behind retires its whole container, which
is replaced; containers idle past ``idle_s`` beyond ``min_containers`` are stopped.
Verdicts (accepted, wrong answer with the chosen comparator, limits) are decided here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import random
import struct
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dsec.node.agent.initclient import SpawnFailed
from dsec.node.layers.toolchains import LANGUAGE_TOOLCHAIN, TOOLCHAINS, toolchain_layer
from dsec.shared.errors import AdmissionRejected, DsecError, InvalidRequest, SandboxError
from dsec.shared.wire.console import FnCallPoolStats, FnCallStats
from dsec.shared.wire.models import (
    FNCALL_IMAGE,
    ContainerArgs,
    FnCallArgs,
    FnCallResult,
    FnCallRun,
    SandboxInfo,
    TestResult,
)

log = logging.getLogger("dsec.fncall")
# the layers of languages past the base image (a library set's, like scientific Python's, is
# not one: SandboxFusion's Python runs on it, and keeps a warm container as the base's does)
LANGUAGE_LAYERS = frozenset(tc.ref(name) for name, tc in TOOLCHAINS.items() if tc.languages)
WORKER_SRC = os.path.join(os.path.dirname(__file__), "worker.py")
# on the container's /tmp tmpfs: the pool's containers have a read-only root, so that no
# world-writable directory of the image (/run/lock, /var/crash, ...) carries one call's
# files to the next; what stays writable (/tmp, /var/tmp, /dev/shm, /dev/mqueue) is swept
WORKER_PATH = "/tmp/.dsec-fncall/worker.py"
WORKERS = 2
BASE_UID = 20000
# RLIMIT_NPROC counts a uid's processes and threads host-wide (pool containers share the
# host's user namespace), so each container's workers get uids of their own: one call's
# threads (a JVM starts a dozen) never count against a call in another container
UID_BLOCKS = 20000  # uids 20000-59999: clear of nobody (65534)
SLOT_MEMORY_MB = 2048
ARTIFACT_CACHE_BYTES = 256 << 20  # compiled binaries kept per edge, by sha256 of what was compiled
PREIMPORT = ["json", "math", "re", "collections", "itertools", "functools", "heapq", "bisect", "decimal",
             "fractions", "random", "string", "typing", "dataclasses"]


class FnCallEdge(Protocol):
    """What the pool needs from its edge."""

    async def create(self, args: ContainerArgs) -> SandboxInfo: ...
    async def stop(self, sandbox_id: str) -> SandboxInfo: ...
    async def spawn_worker(self, sandbox_id: str, argv: list[str], files: dict[str, bytes]
                           ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]: ...


def _start_failure(image: str, e: BaseException) -> DsecError:
    """Why a pool container could not start, as its caller should hear it: an image that
    cannot be one (not a base layer, no runner in it) is the request's fault, a 400 naming
    ``image``; anything else is the platform's."""
    if isinstance(e, SpawnFailed) and e.errno == errno.ENOENT:
        return InvalidRequest(f"{image!r} is not an FnCall image: {e.message}", field="image")
    if isinstance(e, DsecError) and 400 <= e.status < 500:
        return type(e)(f"FnCall pool for {image}: {e.message}", field="image")
    return SandboxError(f"FnCall pool for {image}: {e}")


@dataclass
class _Container:
    sandbox_id: str
    workers: list[_Worker] = field(default_factory=list)
    retired: bool = False
    last_used: float = field(default_factory=time.monotonic)
    # the project whose calls it runs now: calls of one project only at a time (two at once
    # would share its /tmp, /dev/shm, loopback and process list); it may serve another
    # once every worker is idle again, each call's sweep having reset what it left
    tenant: str | None = None
    busy: int = 0

    def close_workers(self) -> None:
        """Close the worker channels explicitly: under uvloop a transport left to the
        garbage collector closes its fd twice (the second close can hit whatever file now
        has that number, in any thread)."""
        for w in self.workers:
            w.writer.close()

    def takes(self, tenant: str) -> bool:
        return not self.retired and (self.busy == 0 or self.tenant == tenant)


@dataclass
class _Worker:
    container: _Container
    uid: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def request(self, obj: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        async def go() -> dict[str, Any]:
            if obj is not None:
                data = json.dumps(obj).encode()
                self.writer.write(struct.pack(">I", len(data)) + data)
                await self.writer.drain()
            n = struct.unpack(">I", await self.reader.readexactly(4))[0]
            return dict(json.loads(await self.reader.readexactly(n)))

        return await asyncio.wait_for(go(), timeout)


@dataclass(frozen=True)
class PoolKey:
    image: str
    layers: tuple[str, ...] = ()
    preimport: tuple[str, ...] = ()


class _ImagePool:
    def __init__(self, svc: FnCallService, key: PoolKey) -> None:
        self.svc, self.key, self.image = svc, key, key.image
        self.containers: dict[str, _Container] = {}
        self.idle: deque[_Worker] = deque()
        self.waiters: deque[tuple[str, asyncio.Future[_Worker]]] = deque()
        self.draining: set[str] = set()  # retired with calls still running in them
        self.starting = 0
        self.languages: list[str] = []
        self.error: Exception | None = None

    def _take(self, w: _Worker, tenant: str) -> _Worker:
        c = w.container
        c.tenant, c.busy = tenant, c.busy + 1
        return w

    async def acquire(self, timeout: float, tenant: str = "") -> _Worker:
        """An idle worker of a container that runs ``tenant``'s calls or none at all."""
        for w in list(self.idle):
            if w.container.takes(tenant):
                self.idle.remove(w)
                return self._take(w, tenant)
        if len(self.containers) + self.starting < self.svc.max_containers and \
                self.starting * WORKERS < len(self.waiters) + 1:
            self._start_soon()
        fut: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
        entry = (tenant, fut)
        self.waiters.append(entry)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise SandboxError(f"no FnCall worker for {self.image} within {timeout:.0f} s"
                               + (f": {self.error}" if self.error else "")) from None
        finally:
            with contextlib.suppress(ValueError):
                self.waiters.remove(entry)

    def release(self, w: _Worker, retire: bool) -> None:
        c = w.container
        c.last_used = time.monotonic()
        c.busy = max(0, c.busy - 1)
        if retire and not c.retired:
            self.retire(c, "a call left state behind")
        if c.retired:
            if c.busy == 0:
                self._stop(c)
            return
        self.idle.append(w)
        self._serve_waiters()

    def _serve_waiters(self) -> None:
        """Hand idle workers to the callers waiting, first come first served, each to a
        container that may run its project's calls."""
        for tenant, fut in list(self.waiters):
            if fut.done():
                continue
            w = next((w for w in self.idle if w.container.takes(tenant)), None)
            if w is None:
                continue
            self.idle.remove(w)
            fut.set_result(self._take(w, tenant))

    def retire(self, c: _Container, why: str) -> None:
        """No more calls for ``c``; it stops once the calls running in it end (a call of
        the same project in its other worker finishes first, it is not cut off)."""
        c.retired = True
        self.containers.pop(c.sandbox_id, None)
        self.idle = deque(w for w in self.idle if w.container is not c)
        log.info("fncall: retiring %s (%s)", c.sandbox_id, why)
        if c.busy == 0:
            self._stop(c)
        else:
            self.draining.add(c.sandbox_id)
        if self.waiters:
            self._start_soon()

    def _stop(self, c: _Container) -> None:
        self.draining.discard(c.sandbox_id)
        c.close_workers()
        self.svc.background(self.svc.edge.stop(c.sandbox_id))

    def _start_soon(self) -> None:
        self.starting += 1
        self.svc.background(self._start())

    async def _start(self) -> None:
        try:
            # all pools together stay within max_containers where idle containers of other
            # pools (other languages, layer stacks) can make room: the edge keeps room for
            # sandboxes, and a call is placed on an edge only while it has some
            while self.svc.total_containers() > self.svc.max_containers and await self.svc.evict_idle(self):
                pass
            while True:
                try:
                    c = await self.svc.start_container(self.key)
                    break
                except AdmissionRejected:
                    # the edge is full: an idle container of another pool (another language's,
                    # say) makes room, the least recently used first
                    if not await self.svc.evict_idle(self):
                        raise
        except Exception as e:  # reported to whoever waits, retried by the next call
            self.error = e
            log.warning("fncall: cannot start a container for %s: %s", self.image, e)
            for _, fut in list(self.waiters):
                if not fut.done():
                    fut.set_exception(_start_failure(self.image, e))
            return
        finally:
            self.starting -= 1
        self.error = None
        self.containers[c.sandbox_id] = c
        self.idle.extend(c.workers)
        self._serve_waiters()


class FnCallService:
    def __init__(self, edge: FnCallEdge, cpus: int, min_containers: int = 1, idle_s: float = 120.0) -> None:
        self.edge = edge
        self.max_containers = max(2, cpus * 2)
        self.min_containers = min_containers
        self.idle_s = idle_s
        self.pools: dict[PoolKey, _ImagePool] = {}
        self.artifacts: OrderedDict[str, str] = OrderedDict()  # compile key -> base64 artifact, LRU
        self.artifact_bytes = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._uid_block = random.randrange(UID_BLOCKS)  # another edge on this host starts elsewhere
        self.calls = 0
        self.errors = 0
        self.statuses: Counter[str] = Counter()
        self.verdicts: Counter[str] = Counter()
        with open(WORKER_SRC, "rb") as f:
            self._worker_src = f.read()

    def background(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def pool(self, key: PoolKey) -> _ImagePool:
        if key not in self.pools:
            self.pools[key] = _ImagePool(self, key)
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap())
        return self.pools[key]

    async def start_container(self, key: PoolKey) -> _Container:
        info = await self.edge.create(ContainerArgs(
            image=key.image, layers=list(key.layers), memory_limit_mb=WORKERS * SLOT_MEMORY_MB + 256,
            cpu_cores_limit=float(WORKERS),
            pids_limit=WORKERS * 1024 + 64, ttl_running_stop=None, max_lifetime_s=None,
            labels={"dsec-role": "fncall"}, tmpfs={"/tmp": 1024, "/var/tmp": 16}, readonly_rootfs=True, workdir="/",
            qos="latency_sensitive"))  # a caller waits on every call: not work to run in idle time
        c = _Container(info.sandbox_id)
        block, self._uid_block = self._uid_block, (self._uid_block + 1) % UID_BLOCKS
        try:
            for i in range(WORKERS):
                uid = BASE_UID + block * WORKERS + i
                reader, writer = await self.edge.spawn_worker(
                    c.sandbox_id, ["python3", "-I", WORKER_PATH, str(uid), *PREIMPORT, *key.preimport],
                    {WORKER_PATH: self._worker_src} if i == 0 else {})
                w = _Worker(c, uid, reader, writer)
                c.workers.append(w)
                hello = await w.request(None, 30)
                pool = self.pools.get(key)
                if pool is not None:
                    pool.languages = list(hello.get("languages", []))
        except BaseException:
            c.close_workers()
            self.background(self.edge.stop(c.sandbox_id))
            raise
        return c

    def total_containers(self) -> int:
        return sum(len(p.containers) + p.starting + len(p.draining) for p in self.pools.values())

    async def evict_idle(self, need: _ImagePool) -> bool:
        """Stop the least recently used container of a pool other than ``need`` whose
        workers are all idle; False when there is none."""
        idle = [(c.last_used, p, c) for p in self.pools.values() if p is not need for c in p.containers.values()
                if c.busy == 0 and not c.retired and all(w in p.idle for w in c.workers)]
        if not idle:
            return False
        _, pool, c = min(idle, key=lambda t: t[0])
        c.retired = True
        pool.containers.pop(c.sandbox_id, None)
        pool.idle = deque(w for w in pool.idle if w.container is not c)
        c.close_workers()
        log.info("fncall: stopping idle %s of %s to make room for %s", c.sandbox_id, pool.key, need.key)
        with contextlib.suppress(Exception):
            await self.edge.stop(c.sandbox_id)
        return True

    def keep(self, key: PoolKey) -> int:
        """Containers a pool keeps when idle: none for a language toolchain's pool (a language
        called now and then gives its room back; its next call starts a container)."""
        return 0 if LANGUAGE_LAYERS.intersection(key.layers) else self.min_containers

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(5)
            now = time.monotonic()
            for pool in self.pools.values():
                for c in sorted(pool.containers.values(), key=lambda c: c.last_used):
                    if len(pool.containers) <= self.keep(pool.key):
                        break
                    idle = all(w in pool.idle for w in c.workers)
                    if idle and now - c.last_used > self.idle_s:
                        pool.retire(c, "idle")

    async def close(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        for pool in self.pools.values():
            for c in list(pool.containers.values()):
                c.retired = True
                c.close_workers()
                with contextlib.suppress(Exception):
                    await self.edge.stop(c.sandbox_id)
            for sid in list(pool.draining):
                with contextlib.suppress(Exception):
                    await self.edge.stop(sid)
        for t in list(self._tasks):
            t.cancel()

    async def languages(self, image: str, has_layer: Callable[[str], bool] | None = None) -> list[str]:
        """The image's own languages, and on the default image those whose toolchain layer
        ``has_layer`` (each runs in a pool of its own, started on the first call)."""
        pool = self.pool(PoolKey(image))
        if not pool.languages:
            pool.release(await pool.acquire(60), retire=False)
        extra = []
        if image == FNCALL_IMAGE and has_layer is not None:
            extra = [lang for lang, name in LANGUAGE_TOOLCHAIN.items()
                     if lang not in pool.languages and has_layer(TOOLCHAINS[name].ref(name))]
        return [*pool.languages, *extra]

    def stats(self, edge: str) -> FnCallStats:
        """Pool occupancy now, and what the calls so far came to (the console's FnCall view)."""
        pools = []
        for key, p in self.pools.items():
            workers = sum(len(c.workers) for c in p.containers.values())
            pools.append(FnCallPoolStats(
                image=key.image, layers=list(key.layers), containers=len(p.containers), workers=workers,
                busy=max(0, workers - len(p.idle)), waiting=len(p.waiters), starting=p.starting,
                error=str(p.error) if p.error else None))
        return FnCallStats(edge=edge, max_containers=self.max_containers, pools=pools, calls=self.calls,
                           statuses=dict(self.statuses), verdicts=dict(self.verdicts), errors=self.errors)

    async def call(self, args: FnCallArgs) -> FnCallResult:
        self.calls += 1
        try:
            res = await self._call(args)
        except InvalidRequest:
            raise
        except Exception:
            self.errors += 1
            raise
        self.statuses[res.status] += 1
        self.verdicts.update(t.verdict for t in res.tests)
        return res

    async def _call(self, args: FnCallArgs) -> FnCallResult:
        layers = call_layers(args)
        pool = self.pool(PoolKey(args.image, tuple(layers), tuple(args.preimport)))
        stdins = [t.stdin for t in args.tests] if args.tests else [args.stdin]
        limits = {"time_limit_s": args.time_limit_s, "memory_limit_mb": args.memory_limit_mb,
                  "pids_limit": args.pids_limit, "output_limit_kb": args.output_limit_kb,
                  "time_limit_kind": args.time_limit_kind}
        req = {"language": args.language, "code": args.code, "files": args.files, "stdins": stdins,
               "binary_files": args.binary_files, "fetch_files": args.fetch_files,
               "limits": limits, "compile_time_limit_s": args.compile_time_limit_s}
        # per project: whether a compile is cached must not tell one project what another ran
        ckey = hashlib.sha256(json.dumps([args.tenant, args.image, layers, args.language, args.code, args.files,
                                          args.binary_files], sort_keys=True).encode()).hexdigest()
        if (artifact := self.artifacts.get(ckey)) is not None:
            self.artifacts.move_to_end(ckey)
            req["artifact"] = artifact
        budget = args.compile_time_limit_s * 2 + len(stdins) * (args.time_limit_s * 2 + 2) + 30
        try:
            w = await pool.acquire(60, args.tenant)
        except DsecError as e:
            tc = toolchain_layer(args.language)
            if tc is not None and tc in e.message and 400 <= e.status < 500:  # the language's layer is not built
                raise InvalidRequest(f"language {args.language!r} needs the toolchain layer {tc}, which this "
                                     f"platform has not built: run `dsec fncall toolchains build "
                                     f"{LANGUAGE_TOOLCHAIN[args.language]}`", field="language") from None
            raise
        if args.language not in pool.languages:  # known once any container of the pool has started
            pool.release(w, retire=False)
            raise InvalidRequest(f"unknown language {args.language!r}; {args.image} has {pool.languages}",
                                 field="language")
        retire = True
        try:
            out = await w.request(req, budget)
            retire = bool(out.get("retire"))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            raise SandboxError(f"FnCall worker in {w.container.sandbox_id} failed: {type(e).__name__}") from None
        finally:
            pool.release(w, retire)
        if art := out.pop("artifact", None):
            self._keep_artifact(ckey, str(art))
        if "error" in out:
            if out["error"].startswith("ValueError"):
                raise InvalidRequest(out["error"].split(": ", 1)[-1], field="files")
            raise SandboxError(f"FnCall worker: {out['error']}")
        res = _result(args, out, w.container.sandbox_id)
        res.files, res.files_left_out = out.get("files", {}), out.get("files_left_out", [])
        return res


    def _keep_artifact(self, key: str, art: str) -> None:
        if key in self.artifacts:
            return
        self.artifacts[key] = art
        self.artifact_bytes += len(art)
        while self.artifact_bytes > ARTIFACT_CACHE_BYTES and self.artifacts:
            _, old = self.artifacts.popitem(last=False)
            self.artifact_bytes -= len(old)


def call_layers(args: FnCallArgs) -> list[str]:
    """The layer stack a call runs on: the toolchain layer its language needs (on the default
    image only: another image brings its own toolchains), then the layers it asked for.
    The pool is keyed by this stack, so a Python call's pool carries no other toolchain."""
    layers = list(args.layers)
    tc = toolchain_layer(args.language) if args.image == FNCALL_IMAGE else None
    if tc is not None and tc not in layers:
        layers.insert(0, tc)
    return layers


def _result(args: FnCallArgs, out: dict[str, Any], container: str) -> FnCallResult:
    comp = FnCallRun.model_validate(out["compile"]) if out.get("compile") else None
    if comp is not None and comp.status != "ok":
        comp.status = "compile_error" if comp.status == "runtime_error" else comp.status
        return FnCallResult(status="compile_error", stderr=comp.stderr, stdout=comp.stdout, compile=comp,
                            time_ms=comp.time_ms, wall_ms=comp.wall_ms, memory_kb=comp.memory_kb,
                            exit_code=comp.exit_code, container=container)
    runs = [FnCallRun.model_validate(r) for r in out["runs"]]
    tests = []
    for t, run in zip(args.tests, runs if args.tests else [], strict=True):
        verdict: str = run.status
        if run.status == "ok":
            ok = t.expected_stdout is None or _same(run.stdout, t.expected_stdout, args.comparator,
                                                    args.float_tolerance)
            verdict = "accepted" if ok else "wrong_answer"
        tests.append(TestResult(**run.model_dump(), verdict=verdict))  # type: ignore[arg-type]
    shown = next((r for r, t in zip(runs, tests, strict=False) if t.verdict != "accepted"), runs[-1])
    return FnCallResult(**shown.model_dump(), compile=comp, tests=tests, container=container)


def _same(got: str, want: str, comparator: str, tol: float) -> bool:
    if comparator == "exact":
        return got == want
    a, b = got.split(), want.split()
    if comparator == "whitespace":
        return a == b
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=tol, abs_tol=tol):
            return False
    return True
