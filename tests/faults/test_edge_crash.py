"""The edge SIGKILLed in the middle of create, stop, pause, resume and pack_diff (at every
failpoint of each, ``DSEC_FAILPOINTS=<step>=kill``), then restarted: the sandbox it was
working on ends running or failed with a reason, never half built, and nothing leaks; a
bystander sandbox is re-adopted and answers."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator

import pytest

import dsec
from dsec.client.cli.servers import SHUTDOWN_GRACE_S
from dsec.shared.faults import POINTS
from tests.conftest import TOKEN, Platform, leftovers, own_platform, sandbox_dir, wait_for
from tests.faults.conftest import Probe, stop_within_bound

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    yield from own_platform(tmp_path_factory, "crash")


def _crash_at(platform: Platform, point: str) -> None:
    """Restart the edge (gracefully: its sandboxes run on) with a kill armed at ``point``."""
    platform.stop()
    platform.env = {"DSEC_FAILPOINTS": f"{point}=kill"}
    platform.start()


async def _died_and_restarted(platform: Platform, op: object) -> None:
    assert platform.proc is not None
    with pytest.raises(dsec.EdgeUnavailable):  # the edge died under the request
        await op  # type: ignore[misc]
    assert platform.proc.wait(timeout=30) == -9
    platform.proc = None
    platform.env = {}
    platform.start()


def _records(platform: Platform, label: str) -> list[dict[str, object]]:
    """The edge's own record of sandboxes labelled ``case=label``, stopped and failed ones
    too (the API lists live sandboxes only)."""
    db = sqlite3.connect(os.path.join(platform.data_dir, "edges", "edge0", "state.db"))
    try:
        infos = [json.loads(r[0]) for r in db.execute("SELECT info FROM sandboxes")]
    finally:
        db.close()
    return [i for i in infos if i["labels"].get("case") == label]


async def _victim(client: dsec.AsyncClient, point: str) -> dsec.AsyncSandbox:
    sb = await client.run_container(dsec.ContainerArgs(labels={"case": point}))
    await sb.write_file("/root/kept.txt", "written before the crash\n")
    await sb.exec("setsid sleep 600 >/dev/null 2>&1 < /dev/null &")
    return sb


@pytest.mark.parametrize("point", sorted(p for p in POINTS if not p.startswith("store.")))  # store.*: errors
async def test_edge_killed_mid_operation(platform: Platform, bystander: dsec.AsyncSandbox, point: str) -> None:
    op_name = point.split(".")[0]
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        victim = None if op_name == "create" else await _victim(c, point)
        if op_name == "resume":
            assert victim is not None
            await victim.pause()
    _crash_at(platform, point)
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        if victim is None:
            op = c.run_container(dsec.ContainerArgs(labels={"case": point}))
        else:
            v = await c.connect(victim.sandbox_id)
            op = {"stop": v.stop, "pause": v.pause, "resume": v.resume, "checkpoint": v.checkpoint,
                  "pack_diff": lambda: v.pack_diff(f"ws/crash-{point.replace('.', '-')}:v1")}[op_name]()
        await _died_and_restarted(platform, op)

    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c, Probe(platform, None):
        by = await c.connect(bystander.sandbox_id)  # re-adopted, answering
        assert (await by.exec(["echo", "ok"])).stdout == "ok\n"
        if op_name == "create":
            (rec,) = _records(platform, point)
            assert rec["state"] == "failed" and "restarted while it was being created" in str(rec["error"]), rec
            assert wait_for(lambda: not leftovers(platform, str(rec["sandbox_id"])), 10), \
                leftovers(platform, str(rec["sandbox_id"]))
            return
        assert victim is not None
        v = await c.connect(victim.sandbox_id)
        info = await v.refresh()
        if op_name == "stop":  # the stop it died in was finished
            assert info.state == dsec.SandboxState.stopped, info
            assert wait_for(lambda: not leftovers(platform, victim.sandbox_id), 10), \
                leftovers(platform, victim.sandbox_id)
            return
        # the kernel's freezer, not the stale record, decided: it runs, with its files and processes
        assert info.state == dsec.SandboxState.running, info
        assert (await v.exec("cat /root/kept.txt; pgrep -c sleep")).stdout == "written before the crash\n1\n"
        ref = f"ws/crash-{point.replace('.', '-')}:v1"
        if point == "pack_diff.built":  # published before the crash: whole
            assert (await c.layer(ref)).ref == ref
        elif op_name == "pack_diff":  # nothing was published: the same name is free
            assert (await v.pack_diff(ref)).ref == ref
        elif op_name == "checkpoint":  # nothing was recorded: the next one is whole, the snapshot is gone
            cp = await v.checkpoint()
            assert (cp.kind, cp.seq) == ("full", 1) and [c.seq for c in await v.checkpoints()] == [1], cp
            work = os.path.join(os.path.dirname(os.path.dirname(sandbox_dir(platform, victim.sandbox_id))),
                                "checkpoints")
            assert os.listdir(work) == [], os.listdir(work)
        await stop_within_bound(platform, v)


@pytest.fixture(scope="module")
async def bystander(platform: Platform) -> AsyncIterator[dsec.AsyncSandbox]:
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        sb = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
    yield sb
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        await (await c.connect(sb.sandbox_id)).stop()


async def test_restart_is_not_held_by_a_hostile_sandbox(platform: Platform, client: dsec.AsyncClient) -> None:
    """The report's last straw: a fork-bombed sandbox across an edge restart. The edge
    comes back and answers; the bombed sandbox is re-adopted (or failed with a reason)
    and stops within the bound."""
    sb = await client.run_container(dsec.ContainerArgs(memory_limit_mb=128))
    await sb.exec("setsid bash -c 'b() { b | b & }; b' >/dev/null 2>&1 < /dev/null &")
    await asyncio.sleep(3)
    long_exec = asyncio.ensure_future(sb.exec("sleep 600", timeout=600))  # in flight across the shutdown
    await asyncio.sleep(0.5)
    t0 = time.monotonic()
    await asyncio.to_thread(platform.stop)  # graceful: bounded although a request is in flight
    assert time.monotonic() - t0 < SHUTDOWN_GRACE_S + 10
    with pytest.raises(dsec.DsecError):
        await long_exec
    platform.start()  # within Platform's 60 s readiness wait, /healthz included
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        v = await c.connect(sb.sandbox_id)
        assert (await v.refresh()).state in (dsec.SandboxState.running, dsec.SandboxState.failed)
        if v.info.state == dsec.SandboxState.running:
            await stop_within_bound(platform, v)
        assert wait_for(lambda: not leftovers(platform, sb.sandbox_id), 10), leftovers(platform, sb.sandbox_id)
