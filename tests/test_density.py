"""Density mechanisms on real cgroups and swap: pausing a container freezes it and pushes
its memory out to the node's zram swap, any request resumes it (memory prefetched, then
thawed), TTLs pause and stop idle sandboxes, best-effort sandboxes run under SCHED_IDLE.
Nothing is mocked."""

from __future__ import annotations

import asyncio
import glob
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

import dsec
from tests.conftest import TOKEN, Platform, _seed_layers, leftovers, stop_all

HOG = (b"import hashlib, os, time\n"
       b"b = bytearray(os.urandom(32 << 20)) + bytearray(b'x' * (128 << 20))\n"
       b"open('/tmp/sum', 'w').write(hashlib.sha256(b).hexdigest())\n"
       b"while True:\n"
       b"    time.sleep(0.5)\n"
       b"    open('/tmp/sum2.tmp', 'w').write(hashlib.sha256(b).hexdigest())\n"
       b"    os.rename('/tmp/sum2.tmp', '/tmp/sum2')\n")


async def _start_hog(sb: dsec.AsyncSandbox) -> str:
    await sb.write_file("/root/hog.py", HOG)
    await sb.exec("nohup python3 /root/hog.py >/dev/null 2>&1 &")
    for _ in range(200):
        r = await sb.exec("cat /tmp/sum 2>/dev/null")
        if r.stdout:
            return r.stdout
        await asyncio.sleep(0.1)
    raise AssertionError("the memory hog did not start")


async def _usage_when(sb: dsec.AsyncSandbox, ok: Callable[[dsec.SandboxUsage], bool]) -> dsec.SandboxUsage:
    """The sandbox's usage once ``ok`` holds of it (within 10 s), else the last reading."""
    for _ in range(50):
        u = await sb.usage()
        if ok(u):
            break
        await asyncio.sleep(0.2)
    return u


async def test_pause_pushes_memory_out_and_resume_brings_it_back(platform: Platform,
                                                                 client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(memory_limit_mb=512))
    try:
        digest = await _start_hog(sb)
        info = await sb.pause()
        assert info.state == "paused" and info.pause is not None and info.paused_at
        p = info.pause
        assert p.memory_before_bytes > 150 << 20
        # pushed out while frozen (most of it: under a loaded machine the kernel left 21% once)
        assert p.memory_after_bytes < p.memory_before_bytes // 4
        assert p.swap_bytes > 100 << 20
        # a paused sandbox is frozen: its processes do not run
        with open(glob.glob(f"/sys/fs/cgroup/freezer/*/{sb.sandbox_id}/freezer.state")[0]) as f:
            assert f.read().strip() == "FROZEN"
        # any request resumes it; the process and its memory are intact
        assert await sb.read_file("/tmp/sum") == digest.encode()
        info = await sb.refresh()
        assert info.state == "running" and info.paused_at is None
        assert info.pause is not None and info.pause.resume_s is not None
        # it runs again: it hashes its memory anew (swapped back in) and gets the same
        deadline = time.monotonic() + 30
        while not (again := (await sb.exec("cat /tmp/sum2 2>/dev/null")).stdout) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert again == digest
        kinds = [e.kind for e in await sb.events()]
        assert "paused" in kinds and "resumed" in kinds
    finally:
        await sb.stop()
    assert leftovers(platform, sb.sandbox_id) == []


async def test_pause_refused_while_a_command_runs(client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox"))
    try:
        task = asyncio.create_task(sb.exec("sleep 2"))
        await asyncio.sleep(0.5)
        with pytest.raises(dsec.SandboxBusy):
            await sb.pause()
        assert (await task).exit_code == 0
        assert (await sb.pause()).state == "paused"
        assert (await sb.run_shell("echo ok")).stdout == "ok\n"  # a session command resumes it too
    finally:
        await sb.stop()


async def test_pause_and_resume_a_job(client: dsec.AsyncClient) -> None:
    sbs = [await client.run_container(dsec.ContainerArgs(image="base/busybox", job="rl-pause-7"))
           for _ in range(3)]
    other = await client.run_container(dsec.ContainerArgs(image="base/busybox", job="other"))
    try:
        paused = await client.pause_many(job="rl-pause-7")
        assert sorted(i.sandbox_id for i in paused) == sorted(s.sandbox_id for s in sbs)
        assert {i.state for i in paused} == {"paused"}
        assert (await other.refresh()).state == "running"
        resumed = await client.resume_many(job="rl-pause-7")
        assert {i.state for i in resumed} == {"running"} and len(resumed) == 3
        with pytest.raises(dsec.InvalidRequest):
            await client.pause_many()
        for s in sbs:  # a live shell session in each: stopping must not wait on a frozen init
            await s.run_shell("cd /tmp && sleep 300 &")
        await client.pause_many(job="rl-pause-7")
        stopped = await asyncio.wait_for(client.stop_many(job="rl-pause-7"), 30)  # paused ones are stopped too
        assert len(stopped) == 3 and {i.state for i in stopped} == {"stopped"}
    finally:
        for s in [*sbs, other]:
            await s.stop()


async def test_idle_ttls_pause_then_stop_across_an_edge_restart(platform: Platform,
                                                                client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox", ttl_running_pause=1,
                                                       ttl_paused_stop=4))
    for _ in range(50):
        if (await sb.refresh()).state == "paused":
            break
        await asyncio.sleep(0.2)
    assert sb.info.state == "paused"
    platform.restart(crash=True)  # the TTLs are the edge's, kept in its records, not a client's
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c2:
        again = await c2.connect(sb.sandbox_id)
        assert again.info.state == "paused"
        for _ in range(80):
            if (await again.refresh()).state == "stopped":
                break
            await asyncio.sleep(0.2)
        assert again.info.state == "stopped"
    assert leftovers(platform, sb.sandbox_id) == []


async def test_best_effort_runs_under_sched_idle(platform: Platform, client: dsec.AsyncClient) -> None:
    be = await client.run_container(dsec.ContainerArgs())
    ls = await client.run_container(dsec.ContainerArgs(qos="latency_sensitive"))
    probe = "python3 -c 'import os; print(os.sched_getscheduler(0))'"
    escape = ("python3 -c 'import os\ntry:\n    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))\n"
              "    print(\"escaped\")\nexcept PermissionError:\n    print(\"refused\")'")
    try:
        assert (await be.exec(probe)).stdout.strip() == "5"  # SCHED_IDLE, inherited from its init
        assert (await be.run_shell(probe)).stdout.strip() == "5"
        assert (await be.exec(escape)).stdout.strip() == "refused"  # root in it cannot lift itself out
        assert (await ls.exec(probe)).stdout.strip() == "0"  # SCHED_OTHER
        cpu = {}
        for sb in (be, ls):
            (d,) = glob.glob(f"/sys/fs/cgroup/cpu/*/{sb.sandbox_id}/w") or glob.glob(
                f"/sys/fs/cgroup/cpu,cpuacct/*/{sb.sandbox_id}/w")  # the workload's cgroup
            with open(f"{d}/cpu.shares") as f, open(f"{d}/cpu.idle") as g:
                cpu[sb.sandbox_id] = (int(f.read()), int(g.read()))
        assert cpu[be.sandbox_id][1] == 1 and cpu[ls.sandbox_id] == (1024, 0)
    finally:
        await be.stop()
        await ls.stop()


def test_node_info_reports_swap_and_qos(platform: Platform) -> None:
    out = subprocess.run([sys.executable, "-m", "dsec.client.cli.main", "node", "info", "--json", "--url", platform.url,
                          "--token", TOKEN], check=True, capture_output=True, text=True).stdout
    (node,) = json.loads(out)
    d = node["density"]
    assert d["sched_idle"] is True
    assert "zram" in d["swap"] or "MiB" in d["swap"]
    if not d["core_scheduling"]:
        assert "no core scheduling" in d["qos"]  # said, not hidden


async def test_usage_accounting_api_ps_and_metrics(platform: Platform, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(memory_limit_mb=512, job="usage-acct"))
    try:
        await sb.exec("head -c 20000000 /dev/urandom > /root/blob")
        await _start_hog(sb)
        # memory.stat is flushed at most every 2 s (v1): poll rather than read once
        u = await _usage_when(sb, lambda u: u.anon_bytes >= 150 << 20)
        assert u.disk_bytes >= 20_000_000  # the writable layer
        assert u.anon_bytes >= 150 << 20 and u.memory_bytes >= u.anon_bytes
        assert u.pids >= 2 and u.cpu_s > 0 and u.oom_kills == 0
        await sb.pause()
        paused = await _usage_when(sb, lambda p: p.anon_bytes < u.anon_bytes // 4)
        assert (await sb.refresh()).state == "paused"  # reading usage does not resume it
        assert paused.swap_bytes >= 100 << 20 and paused.anon_bytes < u.anon_bytes // 4
        (listed,) = await client.list(job="usage-acct", usage=True)
        assert listed.usage is not None and listed.usage.swap_bytes >= 100 << 20
        assert (await client.list(job="usage-acct"))[0].usage is None
        metrics = (await client._request("GET", "/metrics")).text
        line = next(x for x in metrics.splitlines()
                    if x.startswith("dsec_sandbox_swap_bytes") and sb.sandbox_id in x)
        assert float(line.split()[-1]) >= 100 << 20
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "dsec.client.cli.main", "ps", "--usage",
                                                       "--json",
                                                       "--job", "usage-acct", "--url", platform.url, "--token", TOKEN],
                                      capture_output=True, text=True, check=True)
        (row,) = json.loads(out.stdout)
        assert row["sandbox_id"] == sb.sandbox_id and row["usage"]["swap_bytes"] >= 100 << 20
    finally:
        await sb.stop()


@pytest.fixture(scope="module")
def pressured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """A node told that any amount of available memory is too little (a threshold above its
    RAM), so its real pressure check always fires."""
    data_dir = str(tmp_path_factory.mktemp("pressured"))
    _seed_layers(data_dir)
    p = Platform(data_dir, ["--pause-below-mb", str(1 << 30)])
    p.start()
    yield p
    stop_all(p)


async def test_memory_pressure_pauses_idle_best_effort_first(pressured: Platform) -> None:
    async with dsec.AsyncClient(url=pressured.url, token=TOKEN) as c:
        be = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
        ls = await c.run_container(dsec.ContainerArgs(image="base/busybox", qos="latency_sensitive"))
        for _ in range(100):
            if (await be.refresh()).state == "paused":
                break
            await asyncio.sleep(0.2)
        assert be.info.state == "paused"
        assert any(e.kind == "pressure" and "available" in e.message for e in await be.events())
        assert (await ls.refresh()).state == "running"  # latency-sensitive work is not paused for pressure
        for sb in (be, ls):
            await sb.stop()


def test_admission_refuses_under_memory_pressure(tmp_path: str) -> None:
    data_dir = str(tmp_path)
    _seed_layers(data_dir)
    # any pressure, even none, is over the limit, and memory counts as short below 2 TiB
    p = Platform(data_dir, ["--admit-max-psi", "-1", "--pause-below-mb", str(1 << 20)])
    p.start()
    try:
        with dsec.Client(url=p.url, token=TOKEN) as c, pytest.raises(dsec.AdmissionRejected, match="pressure"):
            c.run_container(dsec.ContainerArgs(image="base/busybox"))
    finally:
        stop_all(p)


async def test_a_burst_of_default_creates_is_admitted(platform: Platform, client: dsec.AsyncClient) -> None:
    """32 default sandboxes at once on this (2-core) node: admission reserves what a
    best-effort sandbox requests (5% of a core, 1/8 of its memory), not its limits, so
    none is refused (it refused the 17th when it reserved limits)."""
    made = await asyncio.gather(*(client.run_container(dsec.ContainerArgs(job="burst")) for _ in range(32)),
                                return_exceptions=True)
    try:
        refused = [m for m in made if isinstance(m, BaseException)]
        assert not refused, refused[:3]
        (node,) = await client.nodes()
        assert node.cpu_reserved >= 32 * 0.05 and node.cpu_reserved < node.cpus  # requests, not limits
        r = await made[-1].exec(["echo", "ok"])  # type: ignore[union-attr]
        assert r.stdout == "ok\n"
    finally:
        await client.stop_many(job="burst")
