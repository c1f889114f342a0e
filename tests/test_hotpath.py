"""The hot path's mechanisms (docs/performance.md): what makes a create, an exec or a stop
cheap must also stay correct. Timings are bench/hotpath.py's; these tests assert behaviour."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest

import dsec
from dsec.node.backends.container.runtime import _wait_child
from dsec.node.host import linux
from dsec.node.host.prep import _super_options, cgroup_mode, prepare_cgroups
from dsec.shared.errors import DeadlineExceeded
from tests.conftest import TOKEN, Platform, own_platform


def _spawn(*argv: str) -> int:
    return os.posix_spawn(argv[0], list(argv), dict(os.environ))


def _reaped(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def _cgroup2() -> str:
    return "/sys/fs/cgroup" if cgroup_mode() == "v2" else "/sys/fs/cgroup/unified"


def test_prepare_cgroups_sets_favordynmods_and_keeps_the_other_options() -> None:
    target = _cgroup2()
    before = _super_options(target)
    assert before is not None, f"no cgroup2 mount at {target}"
    others = [o for o in before if o not in ("rw", "ro", "favordynmods")]
    # as a fresh host has it: without the option
    linux.mount("cgroup2", target, "cgroup2", linux.MS_REMOUNT, ",".join(others))
    try:
        assert "favordynmods" not in (_super_options(target) or [])
        prepare_cgroups()
        after = _super_options(target) or []
        assert "favordynmods" in after
        assert set(others) <= set(after), (others, after)
        prepare_cgroups()  # idempotent
        assert (_super_options(target) or []).count("favordynmods") == 1
    finally:
        prepare_cgroups()


async def test_wait_child_returns_the_moment_the_child_exits() -> None:
    pid = _spawn("/bin/sh", "-c", "exit 7")
    status = await _wait_child(pid, 10, "sh")
    assert os.waitstatus_to_exitcode(status) == 7
    assert _reaped(pid)  # no zombie left


async def test_wait_child_kills_and_reaps_past_its_deadline() -> None:
    pid = _spawn("/bin/sleep", "60")
    t = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="did not finish within 0.3 s"):
        await _wait_child(pid, 0.3, "sleep")
    assert time.monotonic() - t < 5
    assert _reaped(pid)


async def test_wait_child_cancelled_kills_and_reaps() -> None:
    pid = _spawn("/bin/sleep", "60")
    task = asyncio.ensure_future(_wait_child(pid, 60, "sleep"))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _reaped(pid)
    # and the loop holds no reader for the closed pidfd: another wait works
    pid2 = _spawn("/bin/true")
    assert os.waitstatus_to_exitcode(await _wait_child(pid2, 10, "true")) == 0


async def test_wait_child_of_a_child_killed_by_a_signal() -> None:
    pid = _spawn("/bin/sleep", "60")
    os.kill(pid, signal.SIGKILL)
    status = await _wait_child(pid, 10, "sleep")
    assert os.waitstatus_to_exitcode(status) == -signal.SIGKILL


@pytest.fixture(scope="module")
def durable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    yield from own_platform(tmp_path_factory, "dsec-durable")


async def test_creates_that_returned_survive_a_sigkill_with_exact_quotas(durable: Platform) -> None:
    """Nothing durable moved off the hot path: a ``dsec serve`` SIGKILLed the moment N
    creates have returned has all N on record after its restart, running, with the
    project's usage exactly N sandboxes and nothing left starting."""
    n = 8
    async with dsec.AsyncClient(url=durable.url, token=TOKEN) as c:
        made = await asyncio.gather(*(c.run_container(dsec.ContainerArgs(
            image="base/busybox", memory_limit_mb=64, cpu_cores_limit=0.5)) for _ in range(n)))
    durable.stop(crash=True)  # SIGKILL: no shutdown, no flush
    durable.start()
    async with dsec.AsyncClient(url=durable.url, token=TOKEN) as c:
        listed = {i.sandbox_id: i for i in await c.list()}
        assert {sb.sandbox_id for sb in made} <= set(listed)
        for sb in made:
            assert listed[sb.sandbox_id].state == "running"
            assert (await (await c.connect(sb.sandbox_id)).exec(["echo", "ok"])).stdout == "ok\n"
        usage = (await c.projects.get("default")).usage
        assert (usage.sandboxes, usage.starting, usage.cpu_cores, usage.memory_mb) == (n, 0, n * 0.5, n * 64)
        await asyncio.gather(*(sb.stop() for sb in made))
        usage = (await c.projects.get("default")).usage
        assert (usage.sandboxes, usage.starting, usage.memory_mb) == (0, 0, 0)


def _freezer_state(sandbox_id: str) -> str | None:
    """The sandbox's freezer as the kernel reports it ("FROZEN", "THAWED"; v2: "1", "0")."""
    v2 = cgroup_mode() == "v2"
    for root, dirs, _ in os.walk("/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/freezer"):
        if sandbox_id in dirs:
            d = os.path.join(root, sandbox_id)
            if v2:
                with open(os.path.join(d, "cgroup.events")) as f:
                    return next(line.split()[1] for line in f if line.startswith("frozen "))
            with open(os.path.join(d, "freezer.state")) as f:
                return f.read().strip()
    return None


async def test_pause_freezes_through_the_cgroup_and_resume_thaws(durable: Platform) -> None:
    """Pause freezes the sandbox's cgroup itself (no ``crun pause``): the kernel reports it
    frozen before pause answers; resume thaws it and a process that was running goes on;
    a paused sandbox stops cleanly (its cgroup is gone)."""
    async with dsec.AsyncClient(url=durable.url, token=TOKEN) as c:
        sb = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
        await sb.run_shell("(i=0; while true; do i=$((i+1)); echo $i > /tmp/t; mv /tmp/t /tmp/tick; usleep 20000; "
                           "done) >/dev/null 2>&1 &")  # a session's background job outlives the command
        await asyncio.sleep(0.2)
        info = await sb.pause()
        assert info.state == "paused" and _freezer_state(sb.sandbox_id) in ("FROZEN", "1")
        info = await sb.resume()
        assert info.state == "running" and _freezer_state(sb.sandbox_id) in ("THAWED", "0")
        first = int((await sb.exec("cat /tmp/tick")).stdout)
        await asyncio.sleep(0.3)
        assert int((await sb.exec("cat /tmp/tick")).stdout) > first  # the loop runs again
        await sb.pause()
        await sb.stop()
        assert _freezer_state(sb.sandbox_id) is None
