"""Checkpoints, restores and moves on a real 3-node Ray cluster on this machine
(dsec.control.cluster.local: three raylets, a private PostgreSQL, a MooseFS store, an edge daemon
per node, two apiserver replicas). A node is killed for real (its raylet and everything
Ray started there die) while checkpointed sandboxes write; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pydantic
import pytest

import dsec
from dsec.control.cluster import ops
from dsec.control.cluster.local import LocalCluster
from tests.conftest import SHARED_LAYERS, SRC_DATA, _seed_vm
from tests.test_ray_cluster import RayDsec, _brief, _edge, _until

NAMES = ("f1", "f2", "f3")
SETUP = "mkdir -p /work && echo run >> /work/runs"  # a keyed command that leaves a trace each time it runs
# a writer that leaves a consistent trail: progress.txt is the last number, log has 1..n
WRITER = ("mkdir -p /work && cd /work && setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i >> log; "
          "echo $i > progress.txt; sleep 0.1; done' >/dev/null 2>&1 < /dev/null &")


@pytest.fixture(scope="module")
def rc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayDsec]:
    local = LocalCluster(str(tmp_path_factory.mktemp("ray-ft")), NAMES, os.path.join(SRC_DATA, "layers"),
                         SHARED_LAYERS, seed=_seed_vm)
    try:
        up = local.start()
        yield RayDsec(local, up.token)
    finally:
        failed = local.stop()
        assert not failed, failed


async def _on_non_head(c: dsec.AsyncClient, args: dsec.ContainerArgs, n: int = 1) -> list[dsec.AsyncSandbox]:
    """``n`` sandboxes on one edge that is not the head's (the head node cannot be removed);
    the others made on the way are stopped."""
    made: list[dsec.AsyncSandbox] = []
    for _ in range(40):
        made += await asyncio.gather(*(c.run_container(args) for _ in range(3)))
        by_edge: dict[str, list[dsec.AsyncSandbox]] = {}
        for sb in made:
            by_edge.setdefault(_edge(sb.sandbox_id), []).append(sb)
        for edge, sbs in by_edge.items():
            if edge != NAMES[0] and len(sbs) >= n:
                for other in made:
                    if other not in sbs[:n]:
                        await other.stop()
                return sbs[:n]
    raise AssertionError("nothing placed on the non-head nodes")


async def _checkpoints(sb: dsec.AsyncSandbox, n: int) -> list[dsec.CheckpointInfo]:
    async def enough() -> list[dsec.CheckpointInfo] | None:
        cps = await sb.checkpoints()
        return cps if len(cps) >= n else None
    cps: list[dsec.CheckpointInfo] = await _until(enough, f"{n} checkpoints of {sb.sandbox_id}", 60)
    return cps


async def test_a_lost_node_s_checkpointed_sandboxes_come_back_elsewhere_with_their_files(rc: RayDsec) -> None:
    async with rc.client(rc.url) as c:
        args = dsec.ContainerArgs(image="base/busybox", job="ft-lost", checkpoint_every_s=5)
        sb, sb2 = await _on_non_head(c, args, 2)
        victim = _edge(sb.sandbox_id)
        plain = await c.run_container(dsec.ContainerArgs(image="base/busybox", job="ft-lost"))
        while _edge(plain.sandbox_id) != victim:  # one without checkpoints on the same node
            await plain.stop()
            plain = await c.run_container(dsec.ContainerArgs(image="base/busybox", job="ft-lost"))
        assert (await sb.exec(SETUP, key="setup")).exit_code == 0
        await sb.exec("echo doomed > /work/doomed")
        await sb.exec(WRITER)
        first = (await _checkpoints(sb, 1))[-1]
        assert first.kind == "full" and first.freeze_ms < 1000 and first.bytes > 0, first
        await sb.exec("rm /work/doomed")
        cps = await _checkpoints(sb, 3)
        assert [cp.kind for cp in cps[:3]] == ["full", "delta", "delta"], cps
        assert all(cp.bytes < 1 << 20 for cp in cps[1:3]), cps  # deltas: only what changed
        await _checkpoints(sb2, 1)
        # the node dies mid-write (its raylet, its edge daemon, its sandboxes with it)
        await asyncio.to_thread(rc.local.remove_node, victim)
        try:
            async def back() -> dsec.SandboxInfo | None:
                try:
                    info = await sb.refresh()
                except dsec.EdgeUnavailable:
                    return None
                return info if info.state == "running" and info.edge != victim else None
            info = await _until(back, "the checkpointed sandbox runs again on another edge", 120, lambda: _brief(rc))
            assert info.sandbox_id == sb.sandbox_id and info.restored_from and victim in info.restored_from
            # files as of its last checkpoint: a consistent trail (log is 1..n, progress is n)
            log = (await sb.exec("cat /work/log")).stdout.split()
            progress = int((await sb.exec("cat /work/progress.txt")).stdout)
            assert [int(x) for x in log] == list(range(1, len(log) + 1)) and progress == len(log) > 0
            assert (await sb.exec("test -e /work/doomed")).exit_code == 1  # the deletion came along too
            assert (await sb.exec("cat /work/runs")).stdout == "run\n"
            # the command log came along: the keyed command replays, runs nothing
            again = await sb.exec(SETUP, key="setup")
            assert again.replayed and (await sb.exec("cat /work/runs")).stdout == "run\n"
            # its processes did not (no CRIU): the writer is gone, the sandbox runs
            await asyncio.sleep(0.5)
            assert int((await sb.exec("cat /work/progress.txt")).stdout) == progress
            # every replica routes to it, by the same id (each reads the moves once a second)
            for url in rc.urls:
                async with rc.client(url) as other:
                    async def answers(other: dsec.AsyncClient = other) -> bool:
                        try:
                            return (await (await other.connect(sb.sandbox_id)).exec("echo hi")).stdout == "hi\n"
                        except dsec.EdgeUnavailable:
                            return False
                    await _until(answers, f"{url} routes to the restored sandbox", 10)
            info2 = await _until(lambda: _running_elsewhere(c, sb2.sandbox_id, victim), "the second one too", 120)
            assert info2.sandbox_id == sb2.sandbox_id
            # one without checkpoints failed with its node, as before
            lost = (await c.connect(plain.sandbox_id)).info
            assert lost.state == "failed" and lost.error == "node lost", lost
            # it keeps being checkpointed where it runs now
            n = len(await sb.checkpoints())
            later = await _checkpoints(sb, n + 1)
            assert later[-1].edge == info.edge, later[-1]
            events = await _api(rc, "GET", "/v1/fleet/events", params={"sandbox_id": sb.sandbox_id})
            assert any(e["kind"] == "restored" for e in events), events
        finally:
            if victim not in rc.local.nodes:
                rc.local.add_node(victim)  # Ray sets signal handlers: the main thread only

        # the node is back: its edge re-adopts what still ran there, and the stale copies are
        # evicted (the restored sandbox runs on, once)
        async def evicted() -> bool:
            st = ops.status(rc.address)
            return any(e["kind"] == "stale_copy_evicted" and e.get("sandbox") == sb.sandbox_id for e in st["events"])
        await _until(evicted, "the returned edge's stale copy is evicted", 120, lambda: _brief(rc))
        assert (await sb.exec("cat /work/runs")).stdout == "run\n"
        listed = [i for i in await c.list(job="ft-lost") if i.sandbox_id == sb.sandbox_id]
        assert [i.state for i in listed] == ["running"], listed
        await c.stop_many(job="ft-lost")
        # stopped for good: its checkpoints go
        assert await sb.checkpoints() == []


async def _running_elsewhere(c: dsec.AsyncClient, sandbox_id: str, victim: str) -> dsec.SandboxInfo | None:
    try:
        info = (await c.connect(sandbox_id)).info
    except dsec.EdgeUnavailable:
        return None
    return info if info.state == "running" and info.edge != victim else None


async def _api(rc: RayDsec, method: str, path: str, status: int = 200, **kw: Any) -> Any:
    async with httpx.AsyncClient(base_url=rc.urls[0], headers={"Authorization": f"Bearer {rc.token}"},
                                 timeout=600) as h:
        r = await h.request(method, path, **kw)
    assert r.status_code == status, r.text
    return r.json()


async def test_drain_moves_checkpointed_sandboxes_and_leaves_the_others(rc: RayDsec) -> None:
    async with rc.client(rc.url) as c:
        [sb] = await _on_non_head(c, dsec.ContainerArgs(image="base/busybox", job="ft-drain",
                                                        checkpoint_every_s=3600))
        source = _edge(sb.sandbox_id)
        await sb.exec("mkdir -p /work && echo kept > /work/f && echo x > /work/gone && rm /work/gone")
        plain = await c.run_container(dsec.ContainerArgs(image="base/busybox", job="ft-drain"))
        report = await _api(rc, "POST", f"/v1/nodes/{source}/drain")
        assert list(report["moved"]) == [sb.sandbox_id] and report["moved"][sb.sandbox_id] != source, report
        if _edge(plain.sandbox_id) == source:
            assert plain.sandbox_id in report["left"], report
        info = await sb.refresh()
        assert info.edge == report["moved"][sb.sandbox_id] and info.state == "running"
        assert (await sb.exec("cat /work/f")).stdout == "kept\n"
        assert (await sb.exec("test -e /work/gone")).exit_code == 1
        # one move: its freeze was one checkpoint; the source no longer lists it
        cps = await sb.checkpoints()
        assert cps and cps[-1].edge == source and cps[-1].freeze_ms < 1000
        on_source = [i for i in await c.list(job="ft-drain") if i.edge == source and i.state == "running"]
        assert sb.sandbox_id not in [i.sandbox_id for i in on_source]
        # and it moves again, by hand, keeping its files
        moved = await sb.move()
        assert moved.edge != info.edge and (await sb.exec("cat /work/f")).stdout == "kept\n"
        # bad input
        with pytest.raises(dsec.InvalidRequest, match="checkpoint_every_s"):
            await plain.move()
        with pytest.raises(dsec.InvalidRequest, match="only a sandbox of a lost edge"):
            await (await c.connect(sb.sandbox_id)).restore()
        assert "nope" in (await _api(rc, "POST", "/v1/nodes/nope/drain", 404))["message"]
        await c.stop_many(job="ft-drain")


async def test_checkpoint_retention_and_bad_input(rc: RayDsec) -> None:
    async with rc.client(rc.url) as c:
        sb = await c.run_container(dsec.ContainerArgs(image="base/busybox", job="ft-keep"))
        await sb.exec("mkdir -p /work")
        cps = []
        for i in range(18):  # over two chains of 8
            await sb.exec(f"echo {i} > /work/n{i % 3}")
            cps.append(await sb.checkpoint())
        kinds = [cp.kind for cp in cps]
        assert kinds[0] == "full" and kinds[8] == "full" and kinds[16] == "full", kinds
        kept = await sb.checkpoints()
        # two chains: the newest full and the one before, with their deltas
        assert [cp.seq for cp in kept] == list(range(9, 19)), [cp.seq for cp in kept]
        full = await sb.checkpoint(full=True)
        assert full.kind == "full" and len(full.stack) == 1
        # a job's interval is its sandboxes' default; their own wins
        job = await c.create_job("ft-job", checkpoint_every_s=3600)
        assert job.info.checkpoint_every_s == 3600
        in_job = await c.run_container(dsec.ContainerArgs(image="base/busybox", job="ft-job"))
        own = await c.run_container(dsec.ContainerArgs(image="base/busybox", job="ft-job", checkpoint_every_s=60))
        assert (in_job.info.checkpoint_every_s, own.info.checkpoint_every_s) == (3600, 60)
        await c.stop_many(job="ft-job")
        with pytest.raises(pydantic.ValidationError, match="checkpoint_every_s"):
            dsec.ContainerArgs(checkpoint_every_s=1)
        bad = await _api(rc, "POST", "/v1/sandboxes", 400, json={"args": {"checkpoint_every_s": 1}})
        assert "checkpoint_every_s" in json.dumps(bad)
        with pytest.raises(dsec.NotFound):
            await (await _connect_missing(c)).checkpoint()
        store = rc.local.store
        dropped = [cp.digest for cp in cps[:8] if cp.digest]
        await sb.stop()
        assert await sb.checkpoints() == []
        blobs = os.path.join(store, "blobs", "sha256")
        assert not [d for d in dropped if os.path.exists(os.path.join(blobs, f"{d}.erofs"))]
        assert not [d for d in [full.digest] if d and os.path.exists(os.path.join(blobs, f"{d}.erofs"))]


async def test_a_vm_moves_with_its_memory_processes_and_disk(rc: RayDsec) -> None:
    """A VM's checkpoint is its memory snapshot and disk: moved to another edge it runs on
    from that state, its processes (same pids) and shell session included."""
    async with rc.client(rc.url) as c:
        vm = await c.run_microvm(dsec.MicroVMArgs(memory_mb=256, job="ft-vm", checkpoint_every_s=3600))
        try:
            await vm.run_shell("cd /srv && export KEEP=kept && (sleep 1000 >/dev/null 2>&1 &)")
            await vm.write_file("/root/state", b"before the move")
            sleeper = (await vm.exec("pgrep -x sleep")).stdout
            assert sleeper.strip()
            cp = await vm.checkpoint()
            assert (cp.kind, cp.files, cp.stack) == ("full", 0, []) and cp.bytes > 0 and cp.freeze_ms > 0, cp
            # it ran on from the checkpoint where it was (QEMU was down for the copy)
            assert (await vm.exec("pgrep -x sleep")).stdout == sleeper
            before = vm.info.edge
            moved = await vm.move()
            assert moved.edge != before and moved.sandbox_id == vm.sandbox_id
            assert moved.vm is not None and moved.vm.started_from == "checkpoint", moved.vm
            assert (await vm.exec("pgrep -x sleep")).stdout == sleeper  # the same process, memory and all
            assert (await vm.run_shell("echo $PWD $KEEP")).stdout.split() == ["/srv", "kept"]
            assert await vm.read_file("/root/state") == b"before the move"
            kinds = {cp.kind for cp in await vm.checkpoints()}
            assert kinds == {"full"}
        finally:
            await c.stop_many(job="ft-vm")
        assert await vm.checkpoints() == []


async def _connect_missing(c: dsec.AsyncClient) -> dsec.AsyncSandbox:
    info = dsec.SandboxInfo(sandbox_id=f"{NAMES[1]}-aaaaaaaaaaaa", edge=NAMES[1], backend="container",
                            state="running", image="base/busybox", layers=[], created_at=time.time(),
                            last_active_at=time.time(), memory_limit_mb=64, cpu_cores_limit=1.0)
    return dsec.AsyncSandbox(c, info)
