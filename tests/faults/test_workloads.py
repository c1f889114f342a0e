"""Hostile workloads at the default limits: each runs while a bystander on the same edge
is probed, then its sandbox is stopped (within the bound, leaving nothing)."""

from __future__ import annotations

import asyncio
import glob
import time

import pytest

import dsec
from dsec.shared.wire.models import SandboxEvent
from tests.conftest import TOKEN, Platform
from tests.faults.conftest import Probe, stop_within_bound

pytestmark = pytest.mark.timeout(300)


def _pids(sandbox_id: str) -> int:
    """How many tasks the sandbox's workload cgroup holds (the pids controller's count)."""
    (path,) = glob.glob(f"/sys/fs/cgroup/pids/*/{sandbox_id}/w/pids.current") or glob.glob(
        f"/sys/fs/cgroup/*/{sandbox_id}/w/pids.current")
    with open(path) as f:
        return int(f.read())


async def _detached(sb: dsec.AsyncSandbox, script: str) -> None:
    """Start ``script`` in its own session so that it outlives the exec that started it."""
    r = await sb.exec(f"setsid sh -c {_quote(script)} >/dev/null 2>&1 < /dev/null &")
    assert r.exit_code == 0, r


def _quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


async def _events(sb: dsec.AsyncSandbox, *kinds: str, timeout: float = 20) -> list[SandboxEvent]:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in await sb.events() if e.kind in kinds]
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.5)


async def _hostile(platform: Platform, bystander: dsec.AsyncSandbox, args: dsec.ContainerArgs, script: str,
                   running: float = 3.0, min_pids: int = 1) -> tuple[dsec.AsyncSandbox, Probe]:
    """Start ``script`` detached in a new sandbox and let it run for ``running`` s under
    the probe; the caller checks what it needs, then stops it."""
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        sb = await c.run_container(args)
    await _detached(sb, script)
    async with Probe(platform, bystander) as probe:
        await asyncio.sleep(running)
        assert _pids(sb.sandbox_id) >= min_pids  # the fault really is running
    return sb, probe


async def test_fork_bomb_at_the_defaults(platform: Platform, bystander: dsec.AsyncSandbox) -> None:
    """The bomb of the report: defaults, 128 MiB; then the defaults as they are."""
    for args in (dsec.ContainerArgs(memory_limit_mb=128), dsec.ContainerArgs()):
        sb, _ = await _hostile(platform, bystander, args, "bomb() { bomb | bomb & }; bomb", min_pids=100)
        async with Probe(platform, bystander):
            await stop_within_bound(platform, sb)


async def test_every_process_spinning_at_the_cpu_limit(platform: Platform, bystander: dsec.AsyncSandbox) -> None:
    sb, _ = await _hostile(platform, bystander, dsec.ContainerArgs(),
                           "for i in $(seq 64); do (while :; do :; done) & done; wait", min_pids=64)
    assert (await sb.exec(["echo", "still here"], timeout=30)).stdout == "still here\n"  # its agent too
    async with Probe(platform, bystander):
        await stop_within_bound(platform, sb)


IGNORE_ALL = """python3 -c '
import os, signal, time
for s in range(1, signal.NSIG):
    try:
        signal.signal(s, signal.SIG_IGN)
    except (OSError, ValueError):
        pass
signal.pthread_sigmask(signal.SIG_BLOCK, range(1, signal.NSIG))
os.setsid()
for _ in range(5):
    os.fork()
while True:
    time.sleep(0.01)
'"""


async def test_processes_ignoring_and_blocking_every_signal(platform: Platform,
                                                            bystander: dsec.AsyncSandbox) -> None:
    sb, _ = await _hostile(platform, bystander, dsec.ContainerArgs(), IGNORE_ALL, min_pids=32)
    term = await sb.exec("pkill -TERM python3; pkill -INT python3; pkill -HUP python3; sleep 0.5; pgrep -c python3")
    assert int(term.stdout) >= 32, term  # nothing catchable reaches them
    async with Probe(platform, bystander):
        await stop_within_bound(platform, sb)


THRASH = """python3 -c '
a = bytearray(300 << 20)
while True:
    for i in range(0, len(a), 4096):
        a[i] = 1
'"""


async def test_memory_at_the_limit_thrashing_swap(platform: Platform, bystander: dsec.AsyncSandbox) -> None:
    """A working set over the limit: it swaps or is OOM-killed, again and again. That is
    its own problem: an event on it, and the node still admits new sandboxes."""
    sb, _ = await _hostile(platform, bystander, dsec.ContainerArgs(memory_limit_mb=128),
                           f"while :; do {THRASH}; done", running=5)
    async with Probe(platform, bystander), dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        assert await _events(sb, "memory_pressure", "oom_killed"), await sb.events()
        newcomer = await c.run_container(dsec.ContainerArgs(image="base/busybox"))  # not refused
        assert (await newcomer.exec(["echo", "in"])).stdout == "in\n"
        await newcomer.stop()
        assert (await sb.exec(["echo", "controllable"], timeout=60)).stdout == "controllable\n"
        await stop_within_bound(platform, sb)


async def test_disk_quota_filled(platform: Platform, bystander: dsec.AsyncSandbox) -> None:
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        sb = await c.run_container(dsec.ContainerArgs(disk_limit_mb=64))
    async with Probe(platform, bystander):
        r = await sb.exec("dd if=/dev/zero of=/root/fill bs=1M count=512", timeout=120)
        assert r.exit_code != 0 and ("quota" in r.stderr or "No space" in r.stderr), r
        r = await sb.exec("i=0; while touch /root/f$i 2>/dev/null; do i=$((i+1)); done; echo $i", timeout=120)
        assert int(r.stdout) < 1_000_000, r  # files are bounded by the same quota
        assert (await sb.exec(["echo", "ok"])).stdout == "ok\n"  # full, and still controllable
        await stop_within_bound(platform, sb)


def _rss_mb(platform: Platform) -> float:
    assert platform.proc is not None
    with open(f"/proc/{platform.proc.pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024


async def test_unbounded_output_with_no_reader(platform: Platform, bystander: dsec.AsyncSandbox) -> None:
    """`yes` into an exec that caps its capture, into a stream nobody reads, and into a
    session's background job: the edge's memory stays bounded and the stop is not held."""
    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        sb = await c.run_container(dsec.ContainerArgs())
    rss0 = _rss_mb(platform)
    async with Probe(platform, bystander):
        r = await sb.exec("yes", timeout=3, max_output_bytes=1 << 20)
        assert r.exit_code != 0 and len(r.stdout) <= 1 << 20, (r.exit_code, len(r.stdout))
        await sb.run_shell("yes > /dev/stdout &")  # a session's job writing on with nobody reading
        stream = sb.exec_stream("yes", timeout=60)
        first = await stream.__anext__()  # then nobody reads
        assert first.data
        await asyncio.sleep(5)
        assert _rss_mb(platform) - rss0 < 256, (rss0, _rss_mb(platform))
        await stop_within_bound(platform, sb)
        await stream.aclose()
