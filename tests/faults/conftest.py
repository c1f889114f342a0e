"""The fault-injection suite's checks. Every case ends with the same four: the faulty
sandbox stops within :data:`STOP_BOUND_S`, a bystander on the same edge kept answering
while the fault ran, nothing of the faulty sandbox is left on the host, and the edge's
API answered throughout. Bounds here are hang detectors, not timings: the measured
numbers are bench/faults.py's (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import pytest

import dsec
from tests.conftest import Platform, leftovers, wait_for

# What dsec states for a stop (docs/reliability.md): the kill retries for at most 10 s,
# each release step is bounded; measured stops of hostile sandboxes take well under 1 s.
STOP_BOUND_S = 15.0
# a bystander's `echo` or the edge's /healthz taking this long means something hangs
PROBE_BOUND_S = 10.0


class Probe:
    """While a fault runs: the bystander's exec and the edge's /healthz, again and again.
    Whatever did not answer, or answered wrong, is a failure of the case."""

    def __init__(self, platform: Platform, bystander: dsec.AsyncSandbox | None) -> None:
        self.platform, self.bystander = platform, bystander
        self.failures: list[str] = []
        self.rounds = 0
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Probe:
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        # a case body that ends before the loop's first turn (its checks are quick, some
        # block the loop) still gets one full round: the edge answered after the fault
        deadline = time.monotonic() + 2 * PROBE_BOUND_S
        while self.rounds < 1 and not self._task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        if exc[0] is None:
            assert not self.failures, self.failures
            assert self.rounds >= 1, "the probe never completed a round"

    async def _loop(self) -> None:
        async with httpx.AsyncClient(base_url=self.platform.url, timeout=PROBE_BOUND_S) as http:
            while True:
                t0 = time.monotonic()
                try:
                    if self.bystander is not None:
                        r = await asyncio.wait_for(self.bystander.exec(["echo", "ok"]), PROBE_BOUND_S)
                        if r.stdout != "ok\n":
                            self.failures.append(f"bystander answered {r!r}")
                    h = await http.get("/healthz")
                    if h.status_code != 200:
                        self.failures.append(f"/healthz {h.status_code}")
                except (TimeoutError, httpx.HTTPError, dsec.DsecError) as e:
                    self.failures.append(f"{type(e).__name__}: {e}")
                self.worst = max(self.worst, time.monotonic() - t0)
                self.rounds += 1
                await asyncio.sleep(0.2)


async def stop_within_bound(platform: Platform, sb: dsec.AsyncSandbox) -> float:
    """Stop ``sb``; it must end stopped within the bound and leave nothing behind."""
    t0 = time.monotonic()
    info = await asyncio.wait_for(sb.stop(), STOP_BOUND_S)
    took = time.monotonic() - t0
    assert info.state == dsec.SandboxState.stopped, info
    assert wait_for(lambda: not leftovers(platform, sb.sandbox_id), 5), leftovers(platform, sb.sandbox_id)
    return took


@pytest.fixture(scope="module")
async def bystander(platform: Platform) -> AsyncIterator[dsec.AsyncSandbox]:
    """A default sandbox on the same edge as the faults."""
    from tests.conftest import TOKEN

    async with dsec.AsyncClient(url=platform.url, token=TOKEN) as c:
        sb = await c.run_container(dsec.ContainerArgs(image="base/busybox"))
        yield sb
        await sb.stop()
