"""An edge's reservations are running sums (dsec.node.edge.reservations) that each create,
pause, resume and stop moves: after every step they equal the sum from scratch, an
admission refuses on them exactly at the edge's limit and takes again once a sandbox
left, and a missed update is found and corrected by the recount. Run in this process on
a hollow edge (the real edge over a runtime that starts nothing), so each step is read
from the edge object itself."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from dsec.node.edge.remote.hollow import start_fleet, stop_fleet
from dsec.node.edge.reservations import share_of
from dsec.node.edge.service import Edge
from dsec.shared.errors import AdmissionRejected
from dsec.shared.wire.models import ContainerArgs


@pytest.fixture
async def edge(tmp_path: os.PathLike[str]) -> AsyncIterator[Edge]:
    fleet = await start_fleet(1, "r", os.path.join(tmp_path, "fleet"), "secret-" + "x" * 32,
                              cfg={"hollow_cpus": 4, "hollow_memory_mb": 8192, "max_sandboxes": 4})
    try:
        yield fleet[0].edge
    finally:
        await stop_fleet(fleet)


def _from_scratch(edge: Edge) -> tuple[float, int, int, dict[str, int]]:
    shares = [s for sb in edge.sandboxes.values() if (s := share_of(sb)) is not None]
    jobs: dict[str, int] = {}
    for s in shares:
        if s.job:
            jobs[s.job] = jobs.get(s.job, 0) + 1
    return sum(s.cpu_u for s in shares) / 1e6, sum(s.memory_mb for s in shares), len(shares), jobs


async def _agrees(edge: Edge) -> tuple[float, int, int]:
    st = await edge.stats()
    cpu, mem, n, jobs = _from_scratch(edge)
    assert (st.cpu_reserved, st.memory_reserved_mb, st.sandboxes, st.per_job) == (cpu, mem, n, jobs)
    assert edge.held.recount(edge.sandboxes.values()) == 0
    return cpu, mem, n


async def test_sums_follow_every_step_and_admission_refuses_exactly_at_the_limit(edge: Edge) -> None:
    be = await edge.create(ContainerArgs(image="base/busybox", job="j1"))  # best effort: a share of its limit
    ls = await edge.create(ContainerArgs(image="base/busybox", qos="latency_sensitive", cpu_cores_limit=1.5,
                                         memory_limit_mb=700, job="j1"))
    req = await edge.create(ContainerArgs(image="base/busybox", cpu_request=0.3, memory_request_mb=100, job="j2"))
    cpu, mem, n = await _agrees(edge)
    assert n == 3 and mem >= 800 and cpu >= 1.8 and (await edge.stats()).per_job == {"j1": 2, "j2": 1}

    await edge.pause(ls.sandbox_id)  # a paused one reserves no CPU, only the memory it still holds
    p_cpu, p_mem, p_n = await _agrees(edge)
    assert p_n == 3 and p_cpu == pytest.approx(cpu - 1.5) and p_mem < mem - 600
    await edge.resume(ls.sandbox_id)
    assert await _agrees(edge) == (cpu, mem, n)

    await edge.create(ContainerArgs(image="base/busybox", cpu_request=0.1, memory_request_mb=16))
    with pytest.raises(AdmissionRejected, match="sandbox"):  # max_sandboxes=4
        await edge.create(ContainerArgs(image="base/busybox", cpu_request=0.1, memory_request_mb=16))
    await edge.stop(be.sandbox_id)
    assert (await _agrees(edge))[2] == 3 and (await edge.stats()).per_job == {"j1": 1, "j2": 1}
    await edge.create(ContainerArgs(image="base/busybox", cpu_request=0.1, memory_request_mb=16))  # room again
    for sid in [*edge.sandboxes]:
        await edge.stop(sid)
    assert await _agrees(edge) == (0.0, 0, 0)
    assert req.sandbox_id not in edge.sandboxes


async def test_a_missed_update_is_found_and_corrected_by_the_recount(edge: Edge) -> None:
    info = await edge.create(ContainerArgs(image="base/busybox", memory_request_mb=64))
    sb = edge.sandboxes[info.sandbox_id]
    sb.memory_held_mb = 5000  # as if a memory sample had skipped its update
    assert edge.held.totals().memory_mb < 5000
    assert edge.held.recount(edge.sandboxes.values()) == 1
    assert edge.held.totals().memory_mb == 5000
    assert edge.held.recount(edge.sandboxes.values()) == 0
