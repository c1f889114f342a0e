"""A stop racing whatever else the sandbox is doing: another stop, a command, a stream,
a TTY, a create, a pause, a pack_diff. The slow operations are held at a step by the
edge's failpoints (``sleep``), so the stop lands in the middle every time, not by luck.
The stop wins within the bound; the other operation ends with a result or a clear error."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
import websockets
import websockets.exceptions

import dsec
from tests.conftest import TOKEN, Platform, leftovers, own_platform, wait_for
from tests.faults.conftest import STOP_BOUND_S, Probe, stop_within_bound

pytestmark = pytest.mark.timeout(300)
HOLD_S = 3  # how long a failpoint holds a create, pause or pack_diff


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    held = ",".join(f"{step}=sleep:{HOLD_S}" for step in ("create.mounted", "pause.frozen", "pack_diff.frozen"))
    yield from own_platform(tmp_path_factory, "races", env={"DSEC_FAILPOINTS": held})


async def _other_ends(task: asyncio.Task[object]) -> object:
    """The raced operation's outcome: a result or a dsec error, within the bound."""
    done, _ = await asyncio.wait([task], timeout=STOP_BOUND_S)
    assert done, "the raced operation did not end after the stop"
    exc = task.exception()
    assert exc is None or isinstance(exc, dsec.DsecError), repr(exc)
    return exc or task.result()


async def _race(platform: Platform, bystander: dsec.AsyncSandbox, sb: dsec.AsyncSandbox,
                op: asyncio.Task[object], settle: float = 1.0) -> object:
    async with Probe(platform, bystander):
        await asyncio.sleep(settle)  # the operation is under way (held at its failpoint)
        assert not op.done(), op
        await stop_within_bound(platform, sb)
        return await _other_ends(op)


async def test_stop_racing_stop(platform: Platform, bystander: dsec.AsyncSandbox, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs())
    await sb.exec("sleep 600 &")
    a, b = await asyncio.gather(sb.stop(), (await client.connect(sb.sandbox_id)).stop())
    assert a.state == b.state == dsec.SandboxState.stopped
    assert wait_for(lambda: not leftovers(platform, sb.sandbox_id), 5)


async def test_stop_during_exec_and_stream(platform: Platform, bystander: dsec.AsyncSandbox,
                                           client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs())

    async def streamed() -> object:
        return [e async for e in sb.exec_stream("while :; do echo tick; sleep 0.1; done", timeout=600)]

    running = asyncio.gather(sb.exec("sleep 600", timeout=600), streamed(), return_exceptions=True)
    both = asyncio.ensure_future(running)
    async with Probe(platform, bystander):
        await asyncio.sleep(1)
        await stop_within_bound(platform, sb)
        done, _ = await asyncio.wait([both], timeout=STOP_BOUND_S)
        assert done
    for outcome in both.result():
        # the command was killed (its result says so) or the request failed clearly
        assert isinstance(outcome, dsec.ExecResult | list | dsec.DsecError), repr(outcome)
        if isinstance(outcome, dsec.ExecResult):
            assert outcome.exit_code != 0


async def test_stop_during_tty(platform: Platform, bystander: dsec.AsyncSandbox, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs())
    async with websockets.connect(sb.tty_url(), additional_headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
        await ws.send(b"cat\n")
        await asyncio.sleep(0.5)
        async with Probe(platform, bystander):
            await stop_within_bound(platform, sb)
            t0 = time.monotonic()
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                while True:  # the terminal ends with its sandbox
                    await asyncio.wait_for(ws.recv(), STOP_BOUND_S)
            assert time.monotonic() - t0 < STOP_BOUND_S


async def test_stop_during_create(platform: Platform, bystander: dsec.AsyncSandbox, client: dsec.AsyncClient) -> None:
    creating = asyncio.ensure_future(client.run_container(dsec.ContainerArgs(labels={"race": "create"})))
    deadline = time.monotonic() + 10
    while not (found := await client.list(labels={"race": "create"})):
        assert time.monotonic() < deadline and not creating.done(), creating
        await asyncio.sleep(0.05)
    (info,) = found
    assert info.state == dsec.SandboxState.creating
    out = await _race(platform, bystander, await client.connect(info.sandbox_id), creating, settle=0.2)
    assert isinstance(out, dsec.SandboxNotRunning) and "stopped while it was being created" in str(out), out


async def test_stop_during_pause(platform: Platform, bystander: dsec.AsyncSandbox, client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs())
    await sb.exec("sleep 600 &")
    await _race(platform, bystander, sb, asyncio.ensure_future(sb.pause()))
    assert (await sb.refresh()).state == dsec.SandboxState.stopped


async def test_stop_during_pack_diff(platform: Platform, bystander: dsec.AsyncSandbox,
                                     client: dsec.AsyncClient) -> None:
    sb = await client.run_container(dsec.ContainerArgs())
    await sb.write_file("/root/state.txt", "x" * 4096)
    out = await _race(platform, bystander, sb, asyncio.ensure_future(sb.pack_diff("ws/race-pack:v1")))
    assert (await sb.refresh()).state == dsec.SandboxState.stopped
    if isinstance(out, dsec.Layer):  # the image was built from the frozen sandbox: it is whole
        assert (await client.layer("ws/race-pack:v1")).size > 4096
    assert not [m for m in open("/proc/self/mountinfo") if os.path.basename(sb.sandbox_id) in m]
