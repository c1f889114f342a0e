"""Sandbox checkpoints and restores on a 2-node Ray cluster on this machine
(dsec.control.cluster.local: raylets, a private PostgreSQL, a MooseFS store; every hop is real).

1. A sandbox writing steadily (appends of ``--rate-kib`` KiB/s over a few files, one small
   file rewritten 10 times a second): ``--checkpoints`` checkpoints ``--interval-s`` apart.
   Per checkpoint: the freeze (the sandbox stopped), the build and upload (it runs), the
   bytes written to the store against the bytes the workload wrote in the interval.
   Baseline in the same run: pack_diff of the same sandbox, which keeps it frozen for the
   whole build (what a checkpoint without the snapshot would cost).
2. A microVM's checkpoints (memory snapshot and disk: QEMU down for the pause, the
   copies and the restore) and moves to first exec, against fresh microVM creates.
3. Restore to first exec on the other edge: a live move (pause, final checkpoint, restore,
   evict) of a sandbox holding ``--restore-mib`` MiB of files, against a fresh create to
   first exec on the same cluster; then a node loss (the raylet killed) until the sandbox
   answers on the other edge, which adds Ray's detection and the controller's round.

    .venv/bin/python bench/checkpoints.py --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import aiohttp  # noqa: E402
import ray  # noqa: E402
from container import report  # noqa: E402

import dsec  # noqa: E402
from dsec.control.cluster import ops  # noqa: E402
from dsec.control.cluster.local import LocalCluster  # noqa: E402
from tests.conftest import _seed_vm  # noqa: E402

NAMES = ("c1", "c2")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))] if xs else float("nan")


async def steady(c: dsec.AsyncClient, a: argparse.Namespace) -> tuple[list[dsec.CheckpointInfo], list[int], float]:
    sb = await c.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=256))
    chunk = max(1, a.rate_kib // 10)
    await sb.exec("mkdir -p /work && cd /work && setsid sh -c 'i=0; while true; do i=$((i+1)); "
                  f"dd if=/dev/urandom bs=1024 count={chunk} 2>/dev/null >> data$((i % 4)); echo $i > progress; "
                  "sleep 0.1; done' "
                  ">/dev/null 2>&1 </dev/null &")
    cps: list[dsec.CheckpointInfo] = []
    written: list[int] = []
    prev = 0
    for _ in range(a.checkpoints):
        await asyncio.sleep(a.interval_s)
        size = int((await sb.exec("cat /work/data* | wc -c")).stdout)
        cps.append(await sb.checkpoint())
        written.append(size - prev)
        prev = size
    t0 = time.perf_counter()
    await sb.pack_diff(f"ws/bench-ckpt:{int(time.time())}")
    pack_diff_s = time.perf_counter() - t0
    await sb.stop()
    return cps, written, pack_diff_s


async def first_exec(c: dsec.AsyncClient) -> float:
    t0 = time.perf_counter()
    sb = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
    await sb.exec("true")
    dt = time.perf_counter() - t0
    await sb.stop()
    return dt


async def moves(c: dsec.AsyncClient, a: argparse.Namespace) -> tuple[list[float], list[float], list[float]]:
    sb = await c.run_container(dsec.ContainerArgs(image="base/busybox", checkpoint_every_s=3600))
    r = await sb.exec(f"mkdir -p /work && dd if=/dev/urandom of=/work/blob bs=1M count={a.restore_mib} 2>/dev/null "
                      "&& echo ok > /work/f")
    assert r.exit_code == 0, r
    await sb.checkpoint()
    move_s, creates = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        await sb.move()
        assert (await sb.exec("cat /work/f")).stdout == "ok\n"
        move_s.append(time.perf_counter() - t0)
        creates.append(await first_exec(c))
    cps = await sb.checkpoints()
    await sb.stop()
    return move_s, creates, [cp.freeze_ms for cp in cps]


async def vm_moves(c: dsec.AsyncClient, a: argparse.Namespace
                   ) -> tuple[list[float], list[int], list[float], list[float]]:
    """A microVM (256 MiB): checkpoints (freeze: QEMU down for pause, copy, restore) and
    moves to first exec, against fresh creates of the same VM to first exec."""
    vm = await c.run_microvm(dsec.MicroVMArgs(memory_mb=256, checkpoint_every_s=3600))
    await vm.exec("true")
    cps = [await vm.checkpoint() for _ in range(a.repeats)]
    move_s, creates = [], []
    for _ in range(max(1, a.repeats // 2)):
        t0 = time.perf_counter()
        await vm.move()
        await vm.exec("true")
        move_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fresh = await c.run_microvm(dsec.MicroVMArgs(memory_mb=256))
        await fresh.exec("true")
        creates.append(time.perf_counter() - t0)
        await fresh.stop()
    await vm.stop()
    return [cp.freeze_ms for cp in cps], [cp.bytes for cp in cps], move_s, creates


async def node_loss(c: dsec.AsyncClient, local: LocalCluster, a: argparse.Namespace) -> float:
    victim = NAMES[1]
    while True:
        sb = await c.run_container(dsec.ContainerArgs(image="base/busybox", checkpoint_every_s=3600))
        if sb.info.edge == victim:
            break
        await sb.stop()
    r = await sb.exec(f"mkdir -p /work && dd if=/dev/urandom of=/work/blob bs=1M count={a.restore_mib} 2>/dev/null "
                      "&& echo ok > /work/f")
    assert r.exit_code == 0, r
    await sb.checkpoint()
    t0 = time.perf_counter()
    await asyncio.to_thread(local.remove_node, victim)
    try:
        while time.perf_counter() - t0 < 180:
            # the replica may have run on the lost node: Ray restarts it elsewhere, on a new URL
            try:  # (the controller itself may be restarting: Ray answers with an error meanwhile)
                urls = sorted(ops.status(local.address)["apiservers"].values())
                async with dsec.AsyncClient(url=",".join(urls), token=c.token) as now:
                    there = await now.connect(sb.sandbox_id)  # restored: on another edge, answering
                    if there.info.edge != victim and (await there.exec("cat /work/f", timeout=10)).stdout == "ok\n":
                        return time.perf_counter() - t0
            except (dsec.DsecError, OSError, aiohttp.ClientError, ray.exceptions.RayError):
                pass
            await asyncio.sleep(0.2)
        return float("nan")
    finally:
        local.add_node(victim)  # Ray sets signal handlers: the main thread only


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=int, default=12)
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument("--rate-kib", type=int, default=640, help="KiB/s the steady writer appends")
    ap.add_argument("--restore-mib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_DATA_DIR", "/var/lib/dsec"))
    ap.add_argument("--write", metavar="MARKDOWN", help="replace this benchmark's section in that file")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix="dsec-bench-ckpt-", dir="/var/tmp")
    local = LocalCluster(root, NAMES, os.path.join(a.data_dir, "layers"), {"base/busybox:latest", "base/debian:12"},
                         apiservers=1, seed=_seed_vm)  # the VM guest setup prepared, as the tests seed it
    try:
        up = local.start()
        async with dsec.AsyncClient(url=up.apiservers[0], token=up.token) as c:
            cps, written, pack_diff_s = await steady(c, a)
            move_s, creates, move_freezes = await moves(c, a)
            vm_freeze, vm_bytes, vm_move, vm_create = await vm_moves(c, a)
            lost_s = await node_loss(c, local, a)
    finally:
        local.stop()
        shutil.rmtree(root, ignore_errors=True)
    deltas = [cp for cp in cps if cp.kind == "delta"]
    fulls = [cp for cp in cps if cp.kind == "full"]
    freeze = [cp.freeze_ms for cp in cps]
    ratio = [cp.bytes / w for cp, w in zip(cps, written, strict=True) if cp.kind == "delta" and w]
    body = "\n".join([
        f"A sandbox appending {a.rate_kib} KiB/s (and rewriting a small file 10x/s), {a.checkpoints} checkpoints "
        f"{a.interval_s:g} s apart ({len(fulls)} full, {len(deltas)} delta):",
        "",
        "| | median | p90 |",
        "|---|---|---|",
        f"| freeze (sandbox stopped), ms | {med(freeze):.1f} | {p90(freeze):.1f} |",
        f"| build + upload (sandbox running), ms | {med([cp.build_ms for cp in cps]):.0f} | "
        f"{p90([cp.build_ms for cp in cps]):.0f} |",
        f"| delta bytes to the store, KiB | {med([cp.bytes / 1024 for cp in deltas]):.0f} | "
        f"{p90([cp.bytes / 1024 for cp in deltas]):.0f} |",
        f"| written by the workload per interval, KiB | {med([w / 1024 for w in written]):.0f} | "
        f"{p90([w / 1024 for w in written]):.0f} |",
        f"| delta bytes / bytes written | {med(ratio):.2f} | {p90(ratio):.2f} |",
        "",
        f"Baseline in the same run: pack_diff of the same sandbox freezes it for its whole build, "
        f"{pack_diff_s * 1e3:.0f} ms: the checkpoint's freeze is {med(freeze) / (pack_diff_s * 1e3):.4f}x that "
        f"({pack_diff_s * 1e3 / med(freeze):.0f}x shorter).",
        "",
        f"Restore to first exec ({a.restore_mib} MiB of files, {a.repeats} moves between the two edges):",
        "",
        "| | median s | p90 s |",
        "|---|---|---|",
        f"| live move (pause, final checkpoint, restore there, evict here), to first exec | {med(move_s):.2f} | "
        f"{p90(move_s):.2f} |",
        f"| baseline: a fresh create to first exec | {med(creates):.2f} | {p90(creates):.2f} |",
        f"| ratio | {med(move_s) / med(creates):.2f}x | |",
        f"| freeze of the moves' final checkpoints, ms | {med(move_freezes):.1f} | {p90(move_freezes):.1f} |",
        "",
        f"A microVM (256 MiB, TCG here): {len(vm_freeze)} checkpoints, freeze (QEMU down: pause, reflink copies, "
        f"restore) median {med(vm_freeze):.0f} ms, {med([b / 2**20 for b in vm_bytes]):.0f} MiB to the store each "
        f"(memory snapshot + the disk's allocated blocks); a move to first exec {med(vm_move):.1f} s against a "
        f"fresh microVM's create to first exec {med(vm_create):.1f} s ({med(vm_move) / med(vm_create):.2f}x), "
        "its processes running on.",
        "",
        f"Node lost (its raylet killed) to the sandbox's first exec on the other edge: {lost_s:.1f} s "
        "(Ray's health checks at 1 s x 3, the controller's 1 s round, then the restore).",
    ])
    report(body, a.write, "checkpoints.py", "checkpoints", "Checkpoints and restores (`bench/checkpoints.py`)")


if __name__ == "__main__":
    asyncio.run(main())
