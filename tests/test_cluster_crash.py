"""The whole cluster stopped uncleanly and brought back (issue: `dsec cluster up` after a
power loss): every process of it SIGKILLed mid-load (Ray on every node, the controller, the
edge and replica daemons, PostgreSQL), then PostgreSQL, Ray and `dsec cluster up` again on
the same data. The sandboxes that still run are re-adopted by their edges, with their
files; the one that died meanwhile is reported; no edge is taken for lost.

Real parts as in tests/test_ray_cluster.py (dsec.control.cluster.local): Ray raylets on this
machine, a MooseFS store, a private PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

import dsec
from dsec.control.cluster import ops
from dsec.control.cluster.local import LocalCluster
from tests.conftest import SHARED_LAYERS, SRC_DATA, _seed_vm

pytestmark = pytest.mark.asyncio(loop_scope="module")
NAMES = ("k1", "k2")


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    lc = LocalCluster(str(tmp_path_factory.mktemp("crash")), NAMES, os.path.join(SRC_DATA, "layers"), SHARED_LAYERS,
                      apiservers=1, seed=_seed_vm)
    try:
        lc.start()
        yield lc
    finally:
        failed = lc.stop()
        assert not failed, failed


def _init_pid(sandbox_id: str) -> int:
    """The host pid of a sandbox's init (what a crash leaves running), from crun's state."""
    edge = sandbox_id.rsplit("-", 1)[0]
    for root in glob.glob(f"/run/dsec/*-{edge}/crun"):
        out = subprocess.run(["crun", "--root", root, "state", sandbox_id], capture_output=True, text=True)
        if out.returncode == 0:
            return int(json.loads(out.stdout)["pid"])
    raise AssertionError(f"no crun state for {sandbox_id}")


async def test_the_whole_cluster_comes_back_after_an_unclean_stop(local: LocalCluster) -> None:
    assert local.up is not None
    async with dsec.AsyncClient(url=local.up.apiservers[0], token=local.up.token) as c:
        sbs = [await c.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=32)) for _ in range(4)]
        assert {s.sandbox_id.rsplit("-", 1)[0] for s in sbs} == set(NAMES)  # both edges hold some
        for s in sbs:
            await s.write_file("/root/mark", s.sandbox_id.encode())

        async def load() -> None:  # creates and commands in flight when everything dies
            while True:
                with contextlib.suppress(dsec.DsecError):
                    extra = await c.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=32))
                    await extra.exec(["echo", "busy"])
        loader = asyncio.create_task(load())
        await asyncio.sleep(2)
        doomed = sbs[-1]
        pid = await asyncio.to_thread(_init_pid, doomed.sandbox_id)
        local.crash()  # Ray wants its calls from the main thread
        loader.cancel()
        with contextlib.suppress(BaseException):
            await loader
    os.kill(pid, signal.SIGKILL)  # one sandbox dies while nothing of the cluster runs
    up = local.restart()
    assert sorted(up.edges) == sorted(NAMES)
    async with dsec.AsyncClient(url=up.apiservers[0], token=up.token) as c:
        for s in sbs[:-1]:
            deadline = time.monotonic() + 60
            while True:
                try:  # a replica reads the edges' new addresses from the registry within a second
                    info = await (await c.connect(s.sandbox_id)).refresh()
                except dsec.EdgeUnavailable as e:
                    info = e  # type: ignore[assignment]
                if isinstance(info, dsec.SandboxInfo) and info.state == dsec.SandboxState.running:
                    break
                assert time.monotonic() < deadline, info
                await asyncio.sleep(0.5)
            again = await c.connect(s.sandbox_id)
            assert await again.read_file("/root/mark") == s.sandbox_id.encode()
            assert (await again.exec(["echo", "back"])).stdout == "back\n"
        gone = await (await c.connect(doomed.sandbox_id)).refresh()
        assert gone.state in (dsec.SandboxState.failed, dsec.SandboxState.stopped), gone
        st = await asyncio.to_thread(ops.status, local.address)
        assert all(e["state"] == "active" for e in st["edges"]), st["edges"]
        assert not [e for e in st["events"] if e["kind"] == "edge_lost"], st["events"]
        made = await c.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=32))
        assert (await made.exec(["echo", "new"])).stdout == "new\n"
