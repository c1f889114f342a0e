"""A tree search over a sandbox's states: in-place rollback against recreate + replay,
in the same run, on a private ``dsec serve`` (crun, overlayfs, the btrfs sandbox volume).

The task: a repository-like tree (``--files`` source files of ~10 KiB, a test script
that reads all of them) set up once in the root state. Each expansion takes a node of the
search tree, brings a sandbox to that node's state, applies one action (an edit of one
file plus a run of the test script) and records the child. Nodes are expanded
breadth-first with ``--branching`` children each, ``--expansions`` in all, no deeper
than ``--depth`` (the default, 64 expansions with 3 children each, reaches depth 4).

- rollback: one sandbox; an expansion is a rollback to the parent's in-place snapshot,
  the action, and a snapshot of the child (a leaf at the depth bound takes none); a node's
  snapshot is dropped once its last child is expanded (not timed);
- recreate: an expansion is a fresh sandbox, the setup and every action on the path from
  the root replayed, the action, and a stop (what branching without snapshots costs);
- live branch (``--live``, CRIU): every node of the tree is a running container; a node is
  captured once (``branch_image``: its processes by CRIU, its files by a btrfs snapshot)
  and an expansion is a child restored from that image, the action, and (a node to be
  expanded in turn) its own capture; a node stops once its last child is made. This leg
  drives the container backend in this process as an edge does (the SDK's live-branch
  call is the edge's, elsewhere), on its own sandbox volume.

Then the size leg: snapshot and rollback times with 0, 64 MiB and ``--big-mib`` MiB
written since the base (the target: snapshot <= 10 ms, rollback <= 20 ms at 1 GiB).

    python bench/treesearch.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from container import report, start_server  # noqa: E402

import dsec  # noqa: E402
from dsec.node.agent.aether import DEFAULT_PATH, Aether, AgentContext  # noqa: E402
from dsec.node.agent.native import ensure_init_binary  # noqa: E402
from dsec.node.backends.api import Record, Sandbox  # noqa: E402
from dsec.node.backends.container.sandboxes import ContainerSandboxes  # noqa: E402
from dsec.node.host import linux  # noqa: E402
from dsec.node.host.cgroup import Cgroup  # noqa: E402
from dsec.node.host.prep import prepare_cgroups  # noqa: E402
from dsec.node.host.volume import SandboxVolume  # noqa: E402
from dsec.node.layers.store import LayerStore  # noqa: E402
from dsec.node.storage.node import NodeLayers  # noqa: E402
from dsec.shared.wire.models import Backend, ContainerArgs, ExecRequest, SandboxInfo, SandboxState  # noqa: E402

ARGS = dict(image="base/busybox", memory_limit_mb=256, cpu_cores_limit=1.0)


@dataclass
class Node:
    name: str
    depth: int
    path: list[str] = field(default_factory=list)  # the actions from the root to here
    snapshot: str | None = None


def setup_cmd(files: int) -> str:
    """The root state: a source tree and a test script that reads all of it."""
    return (f"mkdir -p /repo/src && cd /repo && i=0; while [ $i -lt {files} ]; do "
            "yes \"def f$i(x): return x + $i\" | head -n 400 > src/m$i.txt; i=$((i+1)); done; "
            "printf 'cat /repo/src/*.txt | md5sum\\n' > test.sh")


def action(node: Node, k: int, files: int) -> str:
    """Child ``k`` of ``node``: edit one file (which one depends on the path), run the tests."""
    f = (sum(map(ord, node.name)) * 7 + k) % files
    return f"cd /repo && echo '{node.name}.{k}' >> src/m{f}.txt && sh test.sh"


def plan(a: argparse.Namespace) -> list[tuple[Node, int]]:
    """The expansions, breadth-first: (parent, child index)."""
    out: list[tuple[Node, int]] = []
    frontier = [Node("r", 0)]
    while frontier and len(out) < a.expansions:
        nxt = []
        for node in frontier:
            for k in range(a.branching):
                if len(out) == a.expansions:
                    break
                out.append((node, k))
                if node.depth + 1 < a.depth:
                    nxt.append(Node(f"{node.name}{k}", node.depth + 1, [*node.path, action(node, k, a.files)]))
        frontier = nxt
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else float("nan")


async def by_rollback(c: dsec.AsyncClient, a: argparse.Namespace, outputs: dict[str, str]) -> dict[str, list[float]]:
    sb = await c.run_container(dsec.ContainerArgs(**ARGS))  # type: ignore[arg-type]
    t: dict[str, list[float]] = {"expansion": [], "rollback": [], "snapshot": [], "edge_rollback": []}
    try:
        await sb.exec(setup_cmd(a.files), timeout=120)
        snaps = {"r": (await sb.snapshot("r")).name}
        for parent, k in plan(a):
            t0 = time.perf_counter()
            res = await sb.rollback(snaps[parent.name])
            t1 = time.perf_counter()
            out = await sb.exec(action(parent, k, a.files))
            child = f"{parent.name}{k}"
            t2 = time.perf_counter()
            if parent.depth + 1 < a.depth:
                snaps[child] = (await sb.snapshot(child)).name
            t3 = time.perf_counter()
            outputs[child] = out.stdout
            if k == a.branching - 1:  # the parent is fully expanded: its snapshot goes (32 per sandbox at most)
                await sb.drop_snapshot(snaps.pop(parent.name))
            t["expansion"].append((t3 - t0) * 1e3)
            t["rollback"].append((t1 - t0) * 1e3)
            t["edge_rollback"].append(res.rollback_ms)
            if parent.depth + 1 < a.depth:
                t["snapshot"].append((t3 - t2) * 1e3)
    finally:
        await sb.stop()
    return t


async def by_recreate(c: dsec.AsyncClient, a: argparse.Namespace, outputs: dict[str, str]) -> dict[str, list[float]]:
    t: dict[str, list[float]] = {"expansion": [], "create": [], "replay": []}
    for parent, k in plan(a):
        t0 = time.perf_counter()
        sb = await c.run_container(dsec.ContainerArgs(**ARGS))  # type: ignore[arg-type]
        t1 = time.perf_counter()
        try:
            await sb.exec(setup_cmd(a.files), timeout=120)
            for cmd in parent.path:
                await sb.exec(cmd)
            t2 = time.perf_counter()
            out = await sb.exec(action(parent, k, a.files))
        finally:
            await sb.stop()
        t3 = time.perf_counter()
        outputs[f"{parent.name}{k}"] = out.stdout
        t["expansion"].append((t3 - t0) * 1e3)
        t["create"].append((t1 - t0) * 1e3)
        t["replay"].append((t2 - t1) * 1e3)
    return t


async def by_size(c: dsec.AsyncClient, a: argparse.Namespace) -> list[tuple[int, float, float, float, float, float]]:
    """Per size: (MiB written since the base, the first snapshot's ms, snapshot ms (SDK), its freeze,
    rollback ms at the edge, its freeze)."""
    rows = []
    for mib in (0, 64, a.big_mib):
        sb = await c.run_container(dsec.ContainerArgs(**ARGS))  # type: ignore[arg-type]
        try:
            base = await sb.snapshot("base")
            if mib:
                await sb.exec(f"dd if=/dev/urandom of=/data bs=1M count={mib} 2>/dev/null", timeout=600)
            t0 = time.perf_counter()
            first = await sb.snapshot("first")  # btrfs writes the dirty data out first: this one waits for it
            first_ms = (time.perf_counter() - t0) * 1e3
            await sb.drop_snapshot(first)
            snap_ms, freeze, back_ms, back_frozen = [], [], [], []
            for i in range(a.reps):
                t0 = time.perf_counter()
                s = await sb.snapshot(f"s{i}")
                snap_ms.append((time.perf_counter() - t0) * 1e3)
                freeze.append(s.freeze_ms)
                await sb.drop_snapshot(s)
            for _ in range(a.reps):
                # back to the base (the written data goes), then to the written state again
                top = await sb.snapshot("top")
                r = await sb.rollback(base)
                back_ms.append(r.rollback_ms)
                back_frozen.append(r.frozen_ms)
                await sb.rollback(top)
                await sb.drop_snapshot(top)
            rows.append((mib, first_ms, med(snap_ms), med(freeze), med(back_ms), med(back_frozen)))
        finally:
            await sb.stop()
    return rows


class LiveNode:
    """The container backend on a private sandbox volume, driven as an edge drives it:
    create, exec, branch_image, a child from an image, stop."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir, self.tag = data_dir, os.urandom(3).hex()
        self.run_dir = f"/run/dsec/tree{self.tag}"
        self.volume = SandboxVolume(os.path.join(data_dir, "edges", "tree"), 4)
        self.volume.setup()
        if not self.volume.available:
            raise SystemExit(f"no btrfs sandbox volume: {self.volume.status}")
        self.root = os.path.join(self.volume.mnt, "sandboxes")
        os.makedirs(self.root, exist_ok=True)
        store = LayerStore(os.path.join(data_dir, "layers"))
        self.digests = store.get(str(ARGS["image"])).all_blobs
        self.rt = ContainerSandboxes(NodeLayers(store, data_dir, self.run_dir, "eager"), self.volume, self.run_dir,
                                     f"dsec-tree{self.tag}",
                                     ensure_init_binary(os.path.join(data_dir, "bin", "dsec-init")))
        self.agents: dict[str, Aether] = {}

    def _bind(self, sb: Sandbox, link: object) -> None:
        self.agents[sb.id] = Aether(AgentContext(sb.id, sb.rec.init_pid, {"PATH": DEFAULT_PATH, "HOME": "/root"}, "/"),
                                    link.init, link.files)  # type: ignore[attr-defined]

    def _new(self) -> Sandbox:
        sid = f"tree-{os.urandom(6).hex()}"
        args = ContainerArgs(**ARGS)  # type: ignore[arg-type]
        now = time.time()
        info = SandboxInfo(sandbox_id=sid, edge="tree", backend=Backend.container, state=SandboxState.creating,
                           image=args.image, layers=[], created_at=now, last_active_at=now,
                           memory_limit_mb=args.memory_limit_mb, cpu_cores_limit=args.cpu_cores_limit)
        return Sandbox(Record(info, args, 0, self.digests), os.path.join(self.root, sid))

    async def create(self, restore: dict[str, str] | None = None) -> Sandbox:
        sb = self._new()
        await self.rt.prepare(sb, self.digests, restore=restore)
        sb.rec.init_pid = (await self.rt.launch(sb, self.digests)).init_pid
        self._bind(sb, await self.rt.connect(sb))
        return sb

    async def exec(self, sb: Sandbox, cmd: str) -> str:
        r = await self.agents[sb.id].exec(ExecRequest(cmd=cmd, timeout_s=120))
        if r.exit_code != 0:
            raise RuntimeError(f"{cmd!r}: {r}")
        return r.stdout

    def memory(self, sb: Sandbox) -> int:
        """Bytes charged to its cgroup (its processes' memory and the page cache they made)."""
        with open(os.path.join(Cgroup(self.rt.cgroup_path(sb.id)).dir("memory"), "memory.usage_in_bytes")) as f:
            return int(f.read())

    async def stop(self, sb: Sandbox) -> None:
        await self.rt.kill(sb)
        await self.agents.pop(sb.id).close()
        await self.rt.destroy(sb)
        linux.unmount_all(sb.dir)
        self.volume.remove(sb.dir)

    def close(self) -> None:
        self.rt.close(sandboxes_left=False)
        self.volume.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


async def by_branch(a: argparse.Namespace, data_dir: str, outputs: dict[str, str]) -> dict[str, list[float]]:
    """The live-branch leg (see the module's docstring)."""
    t: dict[str, list[float]] = {"expansion": [], "child": [], "capture": [], "dump": [], "child_mib": [],
                                 "fresh": [], "fresh_mib": []}
    node = LiveNode(data_dir)
    live: dict[str, Sandbox] = {}
    images: dict[str, str] = {}

    async def capture(name: str) -> None:
        t0 = time.perf_counter()
        work = os.path.join(node.rt.branch_dir(), f"img-{name}")
        await node.rt.branch_image(live[name], work)
        t["capture"].append((time.perf_counter() - t0) * 1e3)
        with open(os.path.join(work, "criu", "dsec.json")) as f:
            t["dump"].append(json.load(f)["dump_ms"])
        images[name] = work

    try:
        for _ in range(3):  # fresh creates, for the memory and time of a child against them
            t0 = time.perf_counter()
            sb = await node.create()
            t["fresh"].append((time.perf_counter() - t0) * 1e3)
            t["fresh_mib"].append(node.memory(sb) / 2**20)
            await node.stop(sb)
        live["r"] = await node.create()
        await node.exec(live["r"], setup_cmd(a.files))
        await capture("r")
        for parent, k in plan(a):
            t0 = time.perf_counter()
            child = await node.create({"kind": "container-criu", "image": images[parent.name]})
            t1 = time.perf_counter()
            name = f"{parent.name}{k}"
            outputs[name] = await node.exec(child, action(parent, k, a.files))
            t["child_mib"].append(node.memory(child) / 2**20)
            if parent.depth + 1 < a.depth:
                live[name] = child
                await capture(name)
            else:
                await node.stop(child)
            t["expansion"].append((time.perf_counter() - t0) * 1e3)
            t["child"].append((t1 - t0) * 1e3)
            if k == a.branching - 1:  # fully expanded: the node and its image go (not timed)
                await node.stop(live.pop(parent.name))
                node.rt.drop_branch_image(images.pop(parent.name))
    finally:
        for sb in live.values():
            await node.stop(sb)
        for work in images.values():
            node.rt.drop_branch_image(work)
        node.close()
    return t


def render_live(lb: dict[str, list[float]], same: bool | None) -> str:
    check = "" if same is None else (" Every child's test output was the same as the rollback way's: "
                                     + ("yes." if same else "**NO**."))
    return "\n".join([
        "", "Live branch (CRIU; the container backend driven in-process as an edge drives it, each node a running "
        "container)." + check,
        "", "| live branch (ms) | median | p90 |", "|---|---|---|",
        f"| whole expansion (child restored, action, its own capture if it is expanded in turn) | "
        f"{med(lb['expansion']):.1f} | {p90(lb['expansion']):.1f} |",
        f"| &nbsp;&nbsp;of which the child (prepare from the image, CRIU restore, connect) | {med(lb['child']):.1f} | "
        f"{p90(lb['child']):.1f} |",
        f"| a node's capture (freeze, btrfs snapshot, CRIU dump, thaw), once per node | {med(lb['capture']):.1f} | "
        f"{p90(lb['capture']):.1f} |",
        f"| &nbsp;&nbsp;of which the CRIU dump | {med(lb['dump']):.1f} | {p90(lb['dump']):.1f} |",
        f"| a fresh create (same backend, same harness) | {med(lb['fresh']):.1f} | {p90(lb['fresh']):.1f} |",
        "", f"Memory charged to a child's cgroup after its action: median {med(lb['child_mib']):.1f} MiB "
        f"(a fresh sandbox: {med(lb['fresh_mib']):.1f} MiB). CRIU restores each child's memory as its own copy "
        "(nothing is shared copy-on-write between children, unlike a VM's memory snapshot); here the workload "
        "between actions is a shell's, so a child is mostly dsec-init and the page cache of its files.",
    ])


def render(a: argparse.Namespace, rb: dict[str, list[float]], rc: dict[str, list[float]],
           sizes: list[tuple[int, float, float, float, float, float]], same: bool) -> str:
    ratio = med(rc["expansion"]) / med(rb["expansion"])
    out = [
        f"{a.expansions} expansions, {a.branching} children per node, depth <= {a.depth}; the root state is "
        f"{a.files} files of ~10 KiB and a test script; an action edits one file and runs the tests. Image "
        f"{ARGS['image']}; {os.cpu_count()} cores, load average {a.load[0]:.1f} before and {a.load[1]:.1f} after "
        "(the machine is shared). Times are the SDK's (client to apiserver to edge) unless "
        "marked edge. Every child's test output was the same both ways: " + ("yes." if same else "**NO**."), "",
        "| per expansion (ms) | median | p90 |", "|---|---|---|",
        f"| rollback: whole expansion (rollback, action, snapshot) | {med(rb['expansion']):.1f} | "
        f"{p90(rb['expansion']):.1f} |",
        f"| &nbsp;&nbsp;of which the rollback | {med(rb['rollback']):.1f} | {p90(rb['rollback']):.1f} |",
        f"| &nbsp;&nbsp;of which the rollback, at the edge | {med(rb['edge_rollback']):.1f} | "
        f"{p90(rb['edge_rollback']):.1f} |",
        f"| &nbsp;&nbsp;of which the child's snapshot | {med(rb['snapshot']):.1f} | {p90(rb['snapshot']):.1f} |",
        f"| recreate + replay: whole expansion (create, setup and path replayed, action, stop) | "
        f"{med(rc['expansion']):.1f} | {p90(rc['expansion']):.1f} |",
        f"| &nbsp;&nbsp;of which the create | {med(rc['create']):.1f} | {p90(rc['create']):.1f} |",
        f"| &nbsp;&nbsp;of which the setup and replay | {med(rc['replay']):.1f} | {p90(rc['replay']):.1f} |",
        "", "A child's snapshot first writes out what the action wrote (btrfs puts a snapshot's data on disk), "
        "so its time is the disk's: on this shared machine's loop-mounted volume, tens of ms under load. The "
        "rollback itself writes nothing (its copy of the parent's snapshot is readied in the background).",
        "", f"Recreate + replay / rollback, medians per expansion: **{ratio:.1f}x**. Memory: the rollback way holds "
        "one sandbox for the whole search (and its snapshots, on disk: only the blocks each changed); recreate "
        "holds one at a time here (a search that keeps nodes alive would hold one sandbox per node).", "",
        f"Snapshot and rollback against data written since the base (edge times, medians of {a.reps}):", "",
        "| written since the base | first snapshot after the write (SDK, ms) | snapshot (SDK, ms) | "
        "of which frozen (ms) | rollback (edge, ms) | of which frozen (ms) |", "|---|---|---|---|---|---|",
    ]
    for mib, first, s, f, r, rf in sizes:
        out.append(f"| {mib} MiB | {first:.1f} | {s:.1f} | {f:.1f} | {r:.1f} | {rf:.1f} |")
    out += ["", "The first snapshot after a write waits for btrfs to write the dirty data out (it holds every "
            "write that returned before it); data already on disk costs nothing, whatever its size."]
    return "\n".join(out)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--expansions", type=int, default=64)
    ap.add_argument("--branching", type=int, default=3)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--live", action="store_true", help="also the live-branch leg (CRIU, scripts/criu.sh)")
    ap.add_argument("--only-live", action="store_true", help="the live-branch leg alone (no dsec serve)")
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    prepare_cgroups()
    load0 = os.getloadavg()[0]
    d = tempfile.mkdtemp(prefix="dsec-bench-")
    LayerStore(os.path.join(d, "layers")).link_from(os.path.join(a.data_dir, "layers"))
    if a.only_live:
        try:
            lb = await by_branch(a, d, {})
        finally:
            shutil.rmtree(d, ignore_errors=True)
        print(render_live(lb, None))
        return
    token = "bench-" + os.urandom(8).hex()
    proc, url = start_server(d, token)
    lb: dict[str, list[float]] = {}
    out_lb: dict[str, str] = {}
    try:
        async with dsec.AsyncClient(url=url, token=token) as c:
            out_rb: dict[str, str] = {}
            out_rc: dict[str, str] = {}
            rb = await by_rollback(c, a, out_rb)
            rc = await by_recreate(c, a, out_rc)
            sizes = await by_size(c, a)
        if a.live:
            lb = await by_branch(a, d, out_lb)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)
    a.load = (load0, os.getloadavg()[0])
    same = out_rb == out_rc and len(out_rb) == a.expansions
    body = render(a, rb, rc, sizes, same) + ("\n" + render_live(lb, out_lb == out_rb) if a.live else "")
    report(body, a.write, "treesearch.py", "treesearch",
           "Tree search: in-place rollback, live branch and recreate + replay (`bench/treesearch.py`)")


if __name__ == "__main__":
    asyncio.run(main())
