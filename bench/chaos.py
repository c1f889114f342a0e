"""The chaos soak (issue 33, item 6): a 3-node Ray cluster on this machine (dsec.control.cluster.local:
raylets, two apiserver replicas, a private PostgreSQL, a MooseFS store) under a steady,
RL-shaped load through the SDK, while one fault at a time fires at random every 40-80 s:

- an edge daemon SIGKILLed (its Ray actor restarts it; it re-adopts its sandboxes);
- a raylet killed (the node goes, its sandboxes are lost) and the node brought back 10 s later;
- an apiserver replica SIGKILLed (the SDK fails over; Ray restarts it on a new port);
- the cluster's PostgreSQL restarted (fast shutdown, then the same data dir);
- the MooseFS chunkserver stopped (SIGSTOP) for 15 s;
- a fork-bomb neighbour: a sandbox at the default limits running a fork bomb for 20 s.

The load: episodes (create, keyed commands that append their key to a ledger file in the
sandbox, a deliberate resend of an acknowledged key, pause/resume, checkpoint, stop),
batches of 6, pack_diff + fork, FnCall calls. Every call is counted: answered, failed with
a typed infrastructure error (``DsecError.infra``: by type and by the fault window it
started in), or a violation (anything else). The ledger read at the end of each episode
says whether a keyed command ran twice or an acknowledged one is missing. At the end every
sandbox is stopped and the host is searched for what any of them left (mounts, cgroups,
processes, netns, runtime state), then the cluster is stopped and searched for its own
(daemons, mounts, nftables tables).

Bounded and self-stopping (``--minutes``, default 30); not part of the test suite.

    .venv/bin/python bench/chaos.py --minutes 30 --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import glob
import hashlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from container import report  # noqa: E402

import dsec  # noqa: E402
from dsec.control.cluster import ops  # noqa: E402
from dsec.control.cluster.local import LocalCluster  # noqa: E402
from dsec.node.edge.leftovers import sandbox_leftovers  # noqa: E402
from dsec.shared.wire.models import FNCALL_IMAGE  # noqa: E402

T = TypeVar("T")
NAMES = ("c1", "c2", "c3")  # c1 is Ray's head node (the replicas' home): never removed
FAULTS = ("edge SIGKILL", "raylet killed", "replica SIGKILL", "PostgreSQL restart", "chunkserver stalled",
          "fork-bomb neighbour")
BOMB = "b() { b | b & }; b"
WINDOW_TAIL_S = 5.0  # a fault's window runs on this long past its recovery


def small(job: str | None = None) -> dsec.ContainerArgs:
    """What the load creates: busybox at a 64 MiB, quarter-core limit."""
    return dsec.ContainerArgs(image="base/busybox", memory_limit_mb=64, cpu_cores_limit=0.25, job=job)


def edge_of(sandbox_id: str) -> str:
    return sandbox_id.rsplit("-", 1)[0]


@dataclass
class Fault:
    kind: str
    node: str | None  # the node whose own sandboxes it hits (None: cluster-wide)
    t0: float
    t_end: float = float("inf")
    recovery_s: float | None = None
    note: str = ""


@dataclass
class Ledger:
    """Every call of the load and what came of it."""

    calls: int = 0
    ok: int = 0
    outside_calls: int = 0
    outside_ok: int = 0
    infra: collections.Counter[str] = field(default_factory=collections.Counter)  # "Type (op)" -> n
    by_window: collections.Counter[str] = field(default_factory=collections.Counter)  # fault kind -> failures
    violations: list[str] = field(default_factory=list)  # untyped or caller errors, wrong answers
    keys_acked: int = 0
    keys_doubled: list[str] = field(default_factory=list)
    keys_missing: list[str] = field(default_factory=list)
    replays_ok: int = 0
    episodes: collections.Counter[str] = field(default_factory=collections.Counter)
    made: set[str] = field(default_factory=set)  # every sandbox id ever created


class Soak:
    def __init__(self, local: LocalCluster, token: str, seed: int) -> None:
        self.local, self.token = local, token
        self.rng = random.Random(seed)
        self.urls: tuple[str, ...] = ()
        self.client: dsec.AsyncClient | None = None
        self.old_clients: list[dsec.AsyncClient] = []
        self.ledger = Ledger()
        self.faults: list[Fault] = []
        self.hit: set[str] = set()  # sandboxes on a node while a fault hit it
        self.live: dict[str, str] = {}  # sandbox id -> node, while the load holds it
        self.probes: dict[str, dsec.SandboxInfo] = {}  # node -> a sandbox the fault loop measures through
        self.stopping = asyncio.Event()
        self.cgroup_parents: dict[str, str] = {}  # edge -> the cgroup its sandboxes' cgroups are made in
        self.n = 0

    # ---- the client, following the replicas (a restarted one listens on a new port) ----
    async def refresh_urls(self) -> None:
        try:
            found = (await asyncio.to_thread(ops.status, self.local.address))["apiservers"]
        except Exception:  # the controller is being restarted: keep what we have
            return
        urls = tuple(str(found[k]) for k in sorted(found) if found[k])
        if urls and set(urls) != set(self.urls):
            if self.client is not None:
                self.old_clients.append(self.client)  # handles in flight still use it
            self.urls = urls
            self.client = dsec.AsyncClient(url=list(urls), token=self.token)

    @property
    def c(self) -> dsec.AsyncClient:
        assert self.client is not None
        return self.client

    def sb(self, info: dsec.SandboxInfo) -> dsec.AsyncSandbox:
        return dsec.AsyncSandbox(self.c, info)

    # ---- accounting ----
    def active(self, at: float) -> Fault | None:
        for f in reversed(self.faults):
            if f.t0 <= at <= f.t_end:
                return f
        return None

    async def call(self, op: str, coro: Callable[[], Awaitable[T]], sid: str | None = None,
                   spans: Iterable[str] = ()) -> T:
        """One counted call (on sandbox ``sid``, or on each of ``spans``: a job-wide call).
        Raises what it raised (typed) after counting it."""
        t0 = time.monotonic()
        fault = self.active(t0)
        on = [sid] if sid else list(spans)
        if fault is not None:
            self.hit |= {x for x in on if edge_of(x) == fault.node}
        outside = not any(x in self.hit for x in on)
        self.ledger.calls += 1
        self.ledger.outside_calls += outside
        try:
            out = await coro()
        except dsec.DsecError as e:
            if e.infra:
                self.ledger.infra[f"{type(e).__name__} ({op})"] += 1
                self.ledger.by_window[fault.kind if fault else "no fault"] += 1
            else:
                self.ledger.violations.append(f"{op} {sid or ''}: caller error {type(e).__name__}: {e.message[:200]}")
            raise
        except Exception as e:
            self.ledger.violations.append(f"{op} {sid or ''}: untyped {type(e).__name__}: {str(e)[:200]}")
            raise
        self.ledger.ok += 1
        self.ledger.outside_ok += outside
        return out

    def wrong(self, what: str) -> None:
        self.ledger.violations.append(what)

    # ---- the load ----
    async def create(self, job: str) -> dsec.SandboxInfo:
        info = (await self.call("create", lambda: self.c.run_container(small(job)))).info
        self.ledger.made.add(info.sandbox_id)
        self.live[info.sandbox_id] = edge_of(info.sandbox_id)
        if edge_of(info.sandbox_id) not in self.cgroup_parents:  # where the edge puts its sandboxes' cgroups
            for cg in glob.glob(f"/sys/fs/cgroup/*/*/{info.sandbox_id}"):
                self.cgroup_parents[edge_of(info.sandbox_id)] = os.path.dirname(cg)
        f = self.active(time.monotonic())
        if f is not None and f.node == edge_of(info.sandbox_id):
            self.hit.add(info.sandbox_id)
        return info

    async def stop(self, info: dsec.SandboxInfo) -> None:
        sid = info.sandbox_id
        for _ in range(5):  # a stop is safe to resend
            try:
                await self.call("stop", lambda: self.sb(info).stop(), sid)
                break
            except dsec.DsecError:
                await asyncio.sleep(2)
        self.live.pop(sid, None)

    async def keyed(self, info: dsec.SandboxInfo, key: str) -> dsec.ExecResult | None:
        """Append ``key`` to the ledger file, retried with the same key until answered:
        whatever happened to a try, the command must have run once."""
        for _ in range(6):
            try:
                return await self.call("exec (keyed)", lambda: self.sb(info).exec(
                    f"echo {key} >> /root/ledger", key=key, timeout=30), info.sandbox_id)
            except dsec.DsecError as e:
                if isinstance(e, dsec.SandboxNotRunning) or "lost" in e.message:
                    return None
                await asyncio.sleep(1.5)
        return None

    async def episode(self, n: int) -> None:
        try:
            info = await self.create("chaos-ep")
        except dsec.DsecError:
            self.ledger.episodes["create failed"] += 1
            return
        sid = info.sandbox_id
        acked: list[str] = []
        sent: list[str] = []
        try:
            for k in range(6):
                key = f"{sid}.{k}"
                sent.append(key)
                r = await self.keyed(info, key)
                if r is None:
                    self.ledger.episodes["abandoned (sandbox gone)"] += 1
                    return
                acked.append(key)
                if k == 2:  # the same key again: the recorded answer, nothing run
                    again = await self.keyed(info, acked[0])
                    if again is None:
                        return
                    if not again.replayed:
                        self.wrong(f"{sid}: key {acked[0]} resent was run again (replayed false)")
                    else:
                        self.ledger.replays_ok += 1
                    await self.call("pause", lambda: self.sb(info).pause(), sid)
                    await self.call("resume", lambda: self.sb(info).resume(), sid)
                if k == 3 and n % 2 == 0:
                    await self.call("checkpoint", lambda: self.sb(info).checkpoint(), sid)
            for _ in range(5):
                try:
                    r = await self.call("exec", lambda: self.sb(info).exec("cat /root/ledger", timeout=30), sid)
                    break
                except dsec.DsecError:
                    await asyncio.sleep(1.5)
            else:
                self.ledger.episodes["ledger unread"] += 1
                return
            lines = collections.Counter(r.stdout.split())
            self.ledger.keys_acked += len(acked)
            self.ledger.keys_doubled += [k for k in sent if lines[k] > 1]
            self.ledger.keys_missing += [k for k in acked if lines[k] == 0]
            self.ledger.episodes["checked"] += 1
        except dsec.DsecError:
            self.ledger.episodes["abandoned (error)"] += 1
        finally:
            await self.stop(info)

    async def batch(self, n: int) -> None:
        job = f"chaos-b{n}"
        try:
            b = await self.call("batch", lambda: self.c.create_many(small(), 6, job=job))
            made, failed = await self.call("batch result", lambda: dsec.AsyncBatch(self.c, b.info).result(timeout=300))
        except dsec.DsecError:
            with contextlib.suppress(dsec.DsecError):
                await self.c.stop_many(job=job)
            return
        for item in failed:
            self.ledger.calls += 1
            self.ledger.outside_calls += 1
            self.ledger.infra[f"batch item {item.error} (create)"] += 1
            f = self.active(time.monotonic())
            self.ledger.by_window[f.kind if f else "no fault"] += 1
        for s in made:
            self.ledger.made.add(s.sandbox_id)
            self.live[s.sandbox_id] = edge_of(s.sandbox_id)
            with contextlib.suppress(dsec.DsecError):
                r = await self.call("exec", functools.partial(self.sb(s.info).exec, "echo b", timeout=30),
                                    s.sandbox_id)
                if r.stdout != "b\n":
                    self.wrong(f"{s.sandbox_id}: exec answered {r.stdout!r}")
        for _ in range(5):
            try:
                await self.call("stop_many", lambda: self.c.stop_many(job=job), spans=[x.sandbox_id for x in made])
                break
            except dsec.DsecError:
                await asyncio.sleep(2)
        for s in made:
            self.live.pop(s.sandbox_id, None)

    async def fork(self, n: int) -> None:
        try:
            info = await self.create("chaos-fork")
        except dsec.DsecError:
            return
        kids: list[dsec.SandboxInfo] = []
        ref = f"ws/chaos-{info.sandbox_id}:v1"
        try:
            await self.call("exec", lambda: self.sb(info).exec(f"echo {n} > /root/mark", timeout=30), info.sandbox_id)
            snap = await self.call("pack_diff", lambda: self.sb(info).pack_diff(ref), info.sandbox_id)
            forked = await self.call("fork", lambda: self.c.fork(snap, n=2, args=dsec.ContainerArgs(
                memory_limit_mb=64, cpu_cores_limit=0.25, job="chaos-fork")))
            kids = [k.info for k in forked]
            for k in kids:
                self.ledger.made.add(k.sandbox_id)
                self.live[k.sandbox_id] = edge_of(k.sandbox_id)
                read = functools.partial(self.sb(k).exec, "cat /root/mark", timeout=30)
                r = await self.call("exec", read, k.sandbox_id)
                if r.stdout != f"{n}\n":
                    self.wrong(f"{k.sandbox_id}: forked child reads {r.stdout!r}, not {n}")
        except dsec.DsecError:
            pass
        finally:
            for k in kids:
                await self.stop(k)
            await self.stop(info)
            with contextlib.suppress(dsec.DsecError):
                await self.c.remove_layer(ref)

    async def fncall(self, n: int) -> None:
        with contextlib.suppress(dsec.DsecError):
            r = await self.call("fncall", lambda: self.c.fncall(dsec.FnCallArgs(
                language="python", code="print(sum(map(int, input().split())))", stdin=f"{n} 1")))
            if r.stdout.strip() != str(n + 1):
                self.wrong(f"fncall {n}: answered {r.stdout!r} ({r.status})")

    async def worker(self, body: Callable[[int], Awaitable[None]], pause_s: float) -> None:
        while not self.stopping.is_set():
            self.n += 1
            try:
                await body(self.n)
            except Exception as e:  # the soak's own bug: say so, keep loading
                self.wrong(f"worker {body.__name__}: {type(e).__name__}: {e}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), pause_s)

    # ---- the faults ----
    async def probe(self, node: str) -> dsec.SandboxInfo | None:
        """A sandbox on ``node``, made if need be (placement picks the node: create until
        one lands there)."""
        if node in self.probes:
            return self.probes[node]
        extra = []
        try:
            for _ in range(9):
                sb = await self.c.run_container(small("chaos-probe"))
                self.ledger.made.add(sb.sandbox_id)
                if edge_of(sb.sandbox_id) == node:
                    self.probes[node] = sb.info
                    return sb.info
                extra.append(sb)
        except dsec.DsecError:
            pass
        finally:
            for s in extra:
                with contextlib.suppress(dsec.DsecError):
                    await self.sb(s.info).stop()
        return None

    async def until(self, ok: Callable[[], Awaitable[bool]], t0: float, limit: float = 180.0) -> float | None:
        while time.monotonic() - t0 < limit:
            try:
                if await ok():
                    return time.monotonic() - t0
            except Exception:  # still down: any failure is the fault's
                pass
            await asyncio.sleep(0.2)
        return None

    async def exec_on(self, node: str) -> bool:
        info = self.probes.get(node)
        if info is None:
            return False
        return (await self.sb(info).exec("true", timeout=10)).exit_code == 0

    async def edge_healthy(self, node: str) -> bool:
        st = await asyncio.to_thread(ops.status, self.local.address)
        return any(e["name"] == node and e["state"] == "active" and e["healthy"] for e in st["edges"])

    async def fire(self, kind: str) -> Fault:
        workers = [n for n in NAMES if n in self.local.nodes]
        if kind == "edge SIGKILL":
            node = self.rng.choice(workers)
        elif kind == "raylet killed":
            node = self.rng.choice([n for n in workers if n != NAMES[0]])
        else:
            node = None
        if node is not None and await self.probe(node) is None:
            kind, node = "PostgreSQL restart", None  # no sandbox of ours there to measure through
        f = Fault(kind, node, time.monotonic())
        if node is not None:
            self.hit |= {s for s, n in self.live.items() if n == node}
        self.faults.append(f)
        print(f"[{time.strftime('%H:%M:%S')}] fault: {kind}{f' on {node}' if node else ''}", flush=True)
        root = self.local.root
        if kind == "edge SIGKILL":
            assert node is not None
            pids = pgrep(f"dsec.client.cli.main edge serve --name {node} .*--data-dir {root}/{node}")
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            f.note = f"pids {pids}"
            f.recovery_s = await self.until(lambda: self.exec_on(node), f.t0)
        elif kind == "raylet killed":
            assert node is not None
            gone = node
            # on this thread, not another: Ray's node handling installs signal handlers
            self.local.remove_node(node)
            self.probes.pop(node, None)
            await asyncio.sleep(10)
            self.local.add_node(node)
            f.recovery_s = await self.until(lambda: self.edge_healthy(gone), f.t0)
            f.note = "recovery: the node back (after 10 s down) and its edge healthy"
        elif kind == "replica SIGKILL":
            i = self.rng.randrange(len(self.urls) or 1)
            pids = pgrep(f"dsec.client.cli.main apiserver .*--data-dir {root}/apiserver-{i}")
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)

            async def listed() -> bool:
                await self.c.list(job="chaos-probe")
                return True
            f.recovery_s = await self.until(listed, f.t0)
            old = set(self.urls)

            async def back() -> bool:
                await self.refresh_urls()
                return len(self.urls) >= 2 and set(self.urls) != old
            again = await self.until(back, f.t0)
            f.note = f"apiserver:{i}; replica back on a new port in {again if again is None else round(again, 1)} s"
        elif kind == "PostgreSQL restart":
            await asyncio.to_thread(self.local.pg.stop)
            await asyncio.to_thread(self.local.pg.start)

            async def made() -> bool:
                sb = await self.c.run_container(small("chaos-probe"))
                self.ledger.made.add(sb.sandbox_id)
                await sb.stop()
                return True
            f.recovery_s = await self.until(made, f.t0)
        elif kind == "chunkserver stalled":

            async def made_cp() -> bool:
                sb = await self.c.run_container(small("chaos-probe"))
                self.ledger.made.add(sb.sandbox_id)
                try:
                    await sb.checkpoint()  # the shared store's write path
                finally:
                    await sb.stop()
                return True
            self.local.fs.stall_chunkserver()
            try:  # measured from the stall on: a create and a checkpoint that need no chunk read go through
                probing = asyncio.create_task(self.until(made_cp, f.t0))
                await asyncio.sleep(15)
            finally:
                self.local.fs.resume_chunkserver()
            f.recovery_s = await probing
            f.note = "recovery: a create and a checkpoint, tried from the stall on (15 s)"
        elif kind == "fork-bomb neighbour":
            bomb = await self.c.run_container(dsec.ContainerArgs(image="base/busybox", job="chaos-probe"))
            self.ledger.made.add(bomb.sandbox_id)
            f.node = bombed = edge_of(bomb.sandbox_id)
            self.hit |= {s for s, n in self.live.items() if n == bombed}
            await bomb.exec(f"setsid sh -c '{BOMB}' >/dev/null 2>&1 < /dev/null &")
            await self.probe(bombed)
            f.recovery_s = await self.until(lambda: self.exec_on(bombed), f.t0)  # while the bomb goes on
            await asyncio.sleep(max(0.0, 20 - (time.monotonic() - f.t0)))
            t = time.monotonic()
            await bomb.stop()
            f.note = f"neighbour exec answered through the bomb; its stop took {time.monotonic() - t:.1f} s"
        f.t_end = time.monotonic() + WINDOW_TAIL_S
        print(f"[{time.strftime('%H:%M:%S')}]   recovered in {f.recovery_s} s; {f.note}", flush=True)
        return f

    async def faulting(self, gap: tuple[float, float], kinds: list[str], deadline: float) -> None:
        order: list[str] = []
        while True:
            wait = self.rng.uniform(*gap)
            if time.monotonic() + wait > deadline - 20:  # a fault must not run into the end
                return
            await asyncio.sleep(wait)
            if not order:  # every kind once before any twice, in a random order
                order = self.rng.sample(kinds, len(kinds))
            try:
                await self.fire(order.pop())
            except Exception as e:
                self.wrong(f"fault injection failed: {type(e).__name__}: {e}")
                if self.faults:
                    self.faults[-1].t_end = time.monotonic() + WINDOW_TAIL_S

    async def following(self) -> None:
        while not self.stopping.is_set():
            await self.refresh_urls()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 3)


def pgrep(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def cluster_leftovers(root: str, tables: dict[str, str], parents: list[str]) -> list[str]:
    """What the stopped cluster left: its daemons, mounts under its dirs, its edges' nft tables."""
    found = [f"process {p}" for p in pgrep(f"dsec.client.cli.main .*{root}/")]
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {line.split()[4]}" for line in f if root in line.split()[4]]
    listed = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout.split()
    found += [f"nft table {t}" for t in tables if t in listed]
    for parent in parents:  # any sandbox's cgroup (the FnCall pool's too): its edges are gone
        hierarchy = os.path.dirname(os.path.dirname(parent))
        for p in glob.glob(os.path.join(hierarchy, "*", os.path.basename(parent), "*", "")):
            found.append(f"cgroup {p}")
    return found


async def settle(ids: set[str], root: str, limit: float) -> dict[str, list[str]]:
    """Each sandbox's leftovers, waited for (an edge back from a lost node cleans up after a while)."""
    deadline = time.monotonic() + limit
    while True:
        left = {s: x for s in ids if (x := sandbox_leftovers(s, [os.path.join(root, "*")]))}
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(2)


def med_max(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} / {max(xs):.1f}" if xs else "-"


def render(s: Soak, a: argparse.Namespace, minutes: float, leaks: dict[str, list[str]], cluster_leaks: list[str],
           setup_s: float) -> str:
    lg = s.ledger
    failed = sum(lg.infra.values())
    avail = 100.0 * lg.ok / max(1, lg.calls)
    out_avail = 100.0 * lg.outside_ok / max(1, lg.outside_calls)
    lines = [
        f"{minutes:.1f} minutes of load on a 3-node Ray cluster (dsec.control.cluster.local: three raylets, two "
        "apiserver "
        f"replicas, a private PostgreSQL, a MooseFS store; cluster up in {setup_s:.0f} s), {os.cpu_count()} cores; "
        f"seed {a.seed}; a fault every {a.gap[0]:g}-{a.gap[1]:g} s. Load: {a.episodes} episode loops (create, 6 keyed "
        "commands with a resend of an acknowledged key, pause/resume, a checkpoint every other episode, the ledger "
        "read back, stop), a batch loop (6 sandboxes), a pack_diff + fork loop (2 children), an FnCall loop.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| calls | {lg.calls} |",
        f"| answered | {lg.ok} ({avail:.3f}%) |",
        f"| outside the faulted node's own sandboxes | {lg.outside_ok} of {lg.outside_calls} ({out_avail:.3f}%; "
        f"goal >= 99.9%) |",
        f"| failed with a typed infrastructure error | {failed} |",
        f"| violations (untyped or caller errors, wrong answers) | {len(lg.violations)} |",
        f"| keyed commands acknowledged / doubled / missing | {lg.keys_acked} / {len(lg.keys_doubled)} / "
        f"{len(lg.keys_missing)} |",
        f"| resent keys answered from the log (not run again) | {lg.replays_ok} |",
        f"| episodes | {', '.join(f'{k}: {v}' for k, v in sorted(lg.episodes.items()))} |",
        f"| sandboxes made / with leftovers after the end | {len(lg.made)} / {len(leaks)} |",
        f"| cluster leftovers after stop (daemons, mounts, nft tables) | {len(cluster_leaks)} |",
        "",
        "Failures by cause:",
        "",
        "| error (operation) | count |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in lg.infra.most_common()] or ["| none | 0 |"]
    lines += ["", "Failures by the fault window they started in (a window: from the fault until 5 s after its "
              "recovery):", "", "| window | failures |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in lg.by_window.most_common()] or ["| none | 0 |"]
    lines += ["", "Recovery per fault kind (from the fault until the first success on the affected path: an exec "
              "in a sandbox on the node for an edge kill or a fork bomb, the node's edge healthy again for a raylet "
              "kill, a list through the SDK for a replica kill, a create for PostgreSQL, a create and a checkpoint "
              "for the chunkserver):", "", "| fault | fired | recovered | median / max (s) | notes |",
              "|---|---|---|---|---|"]
    for kind in FAULTS:
        fs = [f for f in s.faults if f.kind == kind]
        rec = [f.recovery_s for f in fs if f.recovery_s is not None]
        notes = "; ".join(sorted({f.note for f in fs if f.note}))[:300]
        lines.append(f"| {kind} | {len(fs)} | {len(rec)} | {med_max(rec)} | {notes} |")
    if lg.violations:
        lines += ["", "Violations (first 10):", ""] + [f"- {v}" for v in lg.violations[:10]]
    if lg.keys_doubled or lg.keys_missing:
        lines += ["", f"Doubled keys: {lg.keys_doubled[:10]}; missing keys: {lg.keys_missing[:10]}"]
    if leaks:
        lines += ["", "Leftovers (first 5 sandboxes):", ""] + [f"- {k}: {v[:4]}" for k, v in list(leaks.items())[:5]]
    if cluster_leaks:
        lines += ["", f"Cluster leftovers: {cluster_leaks[:10]}"]
    return "\n".join(lines)


async def soak(a: argparse.Namespace) -> tuple[str, bool]:
    root = tempfile.mkdtemp(prefix="dsec-chaos-")
    local = LocalCluster(root, NAMES, os.path.join(a.data_dir, "layers"), {"base/busybox:latest", FNCALL_IMAGE},
                         apiservers=2)
    t_setup = time.monotonic()
    leaks: dict[str, list[str]] = {}
    tables: dict[str, str] = {}
    parents: list[str] = []
    try:
        up = local.start()
        setup_s = time.monotonic() - t_setup
        s = Soak(local, up.token, a.seed)
        await s.refresh_urls()
        print(f"cluster up in {setup_s:.0f} s in {root}: replicas {s.urls}; soak for {a.minutes:g} min", flush=True)
        t0 = time.monotonic()
        deadline = t0 + a.minutes * 60
        load = [asyncio.create_task(s.worker(s.episode, 0.5)) for _ in range(a.episodes)]
        load += [asyncio.create_task(s.worker(s.batch, 5)), asyncio.create_task(s.worker(s.fork, 5)),
                 asyncio.create_task(s.worker(s.fncall, 2)), asyncio.create_task(s.following())]
        kinds = [k for k in FAULTS if k in a.faults]
        faults = asyncio.create_task(s.faulting(tuple(a.gap), kinds, deadline))
        last = t0
        while time.monotonic() < deadline:
            await asyncio.sleep(5)
            if time.monotonic() - last >= 60:
                last = time.monotonic()
                lg = s.ledger
                print(f"[{time.strftime('%H:%M:%S')}] {lg.calls} calls, {lg.ok} ok, {sum(lg.infra.values())} infra, "
                      f"{len(lg.violations)} violations, keys {lg.keys_acked} acked", flush=True)
        s.stopping.set()
        try:  # the fault in flight ends (a fault never starts within 20 s of the end)
            await asyncio.wait_for(faults, 240)
        except TimeoutError:
            s.wrong("a fault did not end within 240 s of the soak's end")
        try:
            await asyncio.wait_for(asyncio.gather(*load), 300)
        except TimeoutError:
            s.wrong("the load did not wind down within 300 s")
            for t in load:
                t.cancel()
        minutes = (time.monotonic() - t0) / 60
        # everything stopped through the API, then the host searched for what any sandbox left
        await s.refresh_urls()
        for job in ("chaos-ep", "chaos-fork", "chaos-probe"):
            for _ in range(5):
                try:
                    await s.c.stop_many(job=job)
                    break
                except dsec.DsecError:
                    await asyncio.sleep(2)
        for info in await s.c.list():  # batch jobs and anything else still running
            if info.state.value not in ("stopped", "failed"):
                with contextlib.suppress(dsec.DsecError):
                    await s.sb(info).stop()
        leaks = await settle(s.ledger.made, root, 120)
        for c in (*s.old_clients, s.client):
            if c is not None:
                await c.close()
        parents = list(s.cgroup_parents.values())
        tables = {f"dsec_{hashlib.sha1(d.encode()).hexdigest()[:8]}": d for d in glob.glob(f"{root}/*/edges/*")}
    finally:
        failed = local.stop()
        if failed:
            print(f"cluster stop met: {failed}", flush=True)
    cluster_leaks = cluster_leftovers(root, tables, parents)
    if leaks or cluster_leaks:  # the edges' logs say why
        print(f"leftovers: the cluster's dirs and logs are kept in {root}; nft tables by edge: {tables}", flush=True)
    else:
        shutil.rmtree(root, ignore_errors=True)
    body = render(s, a, minutes, leaks, cluster_leaks, setup_s)
    lg = s.ledger
    good = (not lg.violations and not lg.keys_doubled and not lg.keys_missing and not leaks and not cluster_leaks
            and 100.0 * lg.outside_ok / max(1, lg.outside_calls) >= 99.9)
    return body, good


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (then it stops by itself)")
    ap.add_argument("--gap", type=float, nargs=2, default=[40.0, 80.0], metavar=("MIN", "MAX"),
                    help="seconds between one fault's end and the next one")
    ap.add_argument("--faults", default=",".join(FAULTS), type=lambda v: [x.strip() for x in v.split(",")],
                    help="the fault kinds to fire, comma-separated (default: all)")
    ap.add_argument("--episodes", type=int, default=2, help="episode loops at once (the machine has few cores)")
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    unknown = [f for f in a.faults if f not in FAULTS]
    if unknown:
        ap.error(f"--faults: unknown {unknown}; known: {', '.join(FAULTS)}")
    body, good = asyncio.run(soak(a))
    how = f"chaos.py --minutes {a.minutes:g} --gap {a.gap[0]:g} {a.gap[1]:g} --seed {a.seed}"
    if set(a.faults) != set(FAULTS):
        how += f" --faults '{','.join(a.faults)}'"
    report(body, a.write, how, "chaos",
           "Chaos soak: faults under a steady RL-shaped load (`bench/chaos.py`)")
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
