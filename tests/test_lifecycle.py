"""Lifecycle: nothing of a sandbox is left on the host after a stop, a command timeout,
a workload crash, an idle TTL or an edge restart; a restarted edge re-adopts the
sandboxes that are still running."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

import dsec
from tests.conftest import TOKEN, Platform, leftovers, wait_for


async def test_stop_releases_everything(platform: Platform, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/debian:12"))
    await sb.run_shell("sleep 1000 &")
    await sb.exec("python3 -c 'import time; time.sleep(1000)' &")
    assert leftovers(platform, sb.sandbox_id)  # the checker does see a live sandbox
    await sb.stop()
    assert leftovers(platform, sb.sandbox_id) == []


async def test_timeout_then_stop_leaves_nothing(platform: Platform, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox"))
    r = await sb.run_shell("sleep 1000", timeout=0.3)
    assert r.timed_out
    await sb.stop()
    assert leftovers(platform, sb.sandbox_id) == []


async def test_workload_crash_is_contained(platform: Platform, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/debian:12", memory_limit_mb=64))
    r = await sb.exec(["python3", "-c", "x = bytearray(512 * 1024 * 1024); print('allocated')"])
    assert r.exit_code == 137 and "allocated" not in r.stdout  # OOM-killed inside its own cgroup
    for _ in range(50):  # and said: the edge notices the kill (its TTL loop reads the cgroup's OOM count)
        events = [e for e in await sb.events() if e.kind == "oom_killed"]
        if events:
            break
        await asyncio.sleep(0.1)
    assert events and "64 MiB" in events[0].message
    assert (await sb.usage()).oom_kills == 1
    r = await sb.exec(["python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    assert r.exit_code == 128 + 11
    assert (await sb.exec("echo alive")).stdout == "alive\n"
    await sb.stop()
    assert leftovers(platform, sb.sandbox_id) == []


async def test_session_shell_killed_from_inside(platform: Platform, client: dsec.AsyncClient) -> None:
    """The sandbox kills its session's shell between two commands: the next command's write
    hits a pipe with no reader. The service takes the EPIPE (it once died of SIGPIPE)."""
    sb = await client.run_container(dsec.ContainerArgs(image="base/debian:12"))
    await sb.run_shell("(sleep 0.3; kill -9 $$) >/dev/null 2>&1 &")
    await asyncio.sleep(1.0)
    with contextlib.suppress(dsec.SandboxError):
        await sb.run_shell("echo hi")  # the shell is gone: an error, or a new shell
    assert (await sb.run_shell("echo again")).stdout == "again\n"
    assert platform.proc is not None and platform.proc.poll() is None
    await sb.stop()


async def test_idle_ttl_stops_and_releases(platform: Platform, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox", ttl_running_stop=2))
    for _ in range(3):  # activity keeps it alive past its TTL
        await sb.exec("true")
        await asyncio.sleep(1)
    assert (await sb.refresh()).state == dsec.SandboxState.running
    assert await asyncio.to_thread(wait_for, lambda: not leftovers(platform, sb.sandbox_id), 10)
    info = await sb.refresh()
    assert info.state == dsec.SandboxState.stopped


async def test_max_lifetime(platform: Platform, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs(image="base/busybox", max_lifetime_s=2))
    t0 = time.time()
    while (await sb.refresh()).state == dsec.SandboxState.running and time.time() - t0 < 10:
        try:
            await sb.exec("true")  # activity does not extend a hard lifetime
        except dsec.SandboxNotRunning:
            break
        await asyncio.sleep(0.3)
    assert await asyncio.to_thread(wait_for, lambda: not leftovers(platform, sb.sandbox_id), 10)
    assert (await sb.refresh()).state == dsec.SandboxState.stopped
    assert time.time() - t0 < 6


@pytest.mark.parametrize("crash", [True, False], ids=["sigkill", "sigterm"])
def test_edge_restart_readopts_running_sandboxes(platform: Platform, crash: bool) -> None:
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        keep = c.run_container(dsec.ContainerArgs(image="base/debian:12", ttl_running_stop=600))
        gone = c.run_container(dsec.ContainerArgs(image="base/busybox"))
        keep.write_file("/root/state.txt", "before restart")
        keep.exec("sleep 1000 >/dev/null 2>&1 &")
        keep.run_shell("cd /tmp; export KEEP=across-restart; sleep 500 &", session="agent")
        keep_id, gone_id = keep.sandbox_id, gone.sandbox_id
    platform.stop(crash=crash)
    # while the edge is down, one sandbox dies by itself
    import subprocess
    subprocess.run(["crun", "--root", _crun_root(gone_id), "kill", gone_id, "KILL"], check=True)
    platform.start()
    with dsec.Client(url=platform.url, token=TOKEN) as c:
        sb = c.connect(keep_id)
        assert sb.info.state == dsec.SandboxState.running
        assert sb.read_file("/root/state.txt") == b"before restart"
        assert sb.exec("pgrep -c sleep").stdout.strip() == "2"
        assert sb.run_shell("echo works").stdout == "works\n"
        # the shell session outlived the edge: cwd, exports and its background job
        r = sb.run_shell("echo $PWD $KEEP; jobs | wc -l", session="agent")
        assert r.stdout.split() == ["/tmp", "across-restart", "1"]
        lost = c.connect(gone_id).info
        assert lost.state == dsec.SandboxState.failed and lost.error
        assert leftovers(platform, gone_id) == []
        sb.stop()
    assert leftovers(platform, keep_id) == []


def _crun_root(sandbox_id: str) -> str:
    import glob

    found = glob.glob(f"/run/dsec/*/crun/{sandbox_id}")
    assert found, "crun state of the sandbox not found"
    return found[0].rsplit("/", 1)[0]


async def test_concurrent_creates_are_placed_and_isolated(client: dsec.AsyncClient) -> None:
    sbs = await asyncio.gather(*(client.run_container(dsec.ContainerArgs(image="base/busybox", memory_limit_mb=32))
                                 for _ in range(8)))
    try:
        assert len({s.sandbox_id for s in sbs}) == 8
        await asyncio.gather(*(s.write_file("/root/me", s.sandbox_id) for s in sbs))
        outs = await asyncio.gather(*(s.exec("cat /root/me") for s in sbs))
        assert [o.stdout for o in outs] == [s.sandbox_id for s in sbs]
    finally:
        await asyncio.gather(*(s.stop() for s in sbs))


@pytest.mark.parametrize("crash", [True, False], ids=["sigkill", "sigterm"])
async def test_a_client_outlives_a_server_restart(platform: Platform, crash: bool) -> None:
    """Its pooled connections die with the server; idempotent requests on such a connection
    are sent again (aiohttp does this itself). A POST on a dead pooled connection is not
    repeated, since the server may have acted on it: the caller gets EdgeUnavailable.
    (The restart blocks this test's loop, so the client only finds out when it sends.)"""
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        assert await c.nodes()
        platform.restart(crash=crash)
        assert (await c.nodes())[0].edge == "edge0"
        assert isinstance(await c.list(), list)
