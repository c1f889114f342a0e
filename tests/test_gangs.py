"""Gang admission and a job's creation-rate budget, on a real PostgreSQL across two
apiserver replicas (``dsec apiserver --db``, A and B) in front of one real edge daemon.

What is checked: a batch made all or nothing holds its project's quota and edge room for
every item before it is accepted, or is refused at once naming the shortfall with nothing
made, also when two gangs race for the last units from two replicas; a gang whose item
cannot be made fails whole (what it made is stopped, what it reserved is freed); a job's
creates per second are one budget for every replica (a 429 ``rate_limited`` with
Retry-After past it), and a batch's items wait for it instead of failing; the SDK, REST and
CLI faces of both. Real parts: Debian's PostgreSQL 15, crun sandboxes on the edge."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio
from conftest import TOKEN, Service

import dsec
from dsec.shared.wire.iam import ProjectQuota
from dsec.shared.wire.jobs import JobQuota
from tests.test_db_outage import Outage

pytestmark = pytest.mark.asyncio(loop_scope="module")
PROJECT = "gangs"
SMALL = dict(image="base/busybox", memory_limit_mb=64, cpu_cores_limit=0.25)


class TwoReplicas(Outage):
    """PostgreSQL, an edge in its registry, replica A (the Outage's) and replica B."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        b_dir = os.path.join(root, "api-b")
        os.makedirs(b_dir)
        argv = list(self.api.argv)
        argv[argv.index("--data-dir") + 1] = b_dir
        self.api_b = Service(argv, os.path.join(b_dir, "apiserver.log"))
        self.api_b.argv[self.api_b.argv.index("--port") + 1] = str(self.api_b.port)

    def start(self) -> None:
        super().start()
        self.api_b.start()

    def stop(self) -> None:
        self.api_b.stop()
        super().stop()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoReplicas]:
    t = TwoReplicas(str(tmp_path_factory.mktemp("gangs")))
    try:
        t.start()
        yield t
    finally:
        t.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def token(two: TwoReplicas) -> AsyncIterator[str]:
    """A runner of the project, whose quota is 6 sandboxes."""
    async with dsec.AsyncClient(url=two.api.url, token=TOKEN) as admin:
        await admin.projects.create(PROJECT, ProjectQuota(sandboxes=6))
        made = await admin.create_token(PROJECT, "runner", "trainer")
    yield made.token
    async with dsec.AsyncClient(url=two.api.url, token=TOKEN) as admin:
        await admin.stop_many(labels={"dsec.project": PROJECT})


async def _usage(c: dsec.AsyncClient) -> int:
    async with dsec.AsyncClient(url=c.url, token=TOKEN) as admin:
        return (await admin.projects.get(PROJECT)).usage.sandboxes


async def _until_usage(c: dsec.AsyncClient, want: int, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := await _usage(c)) != want:
        assert time.monotonic() < deadline, f"{what}: the project holds {got} sandboxes, not {want}"
        await asyncio.sleep(0.2)


async def test_two_gangs_racing_from_two_replicas_for_the_last_units_one_wins_whole(
        two: TwoReplicas, token: str) -> None:
    async with dsec.AsyncClient(url=two.api.url, token=token) as a, \
            dsec.AsyncClient(url=two.api_b.url, token=token) as b:
        args = dsec.ContainerArgs(**SMALL)  # type: ignore[arg-type]
        outcomes = await asyncio.gather(a.create_many(args, 4, all_or_nothing=True),
                                        b.create_many(args, 4, all_or_nothing=True), return_exceptions=True)
        won = [o for o in outcomes if isinstance(o, dsec.AsyncBatch)]
        lost = [o for o in outcomes if isinstance(o, dsec.QuotaExceeded)]
        assert len(won) == 1 and len(lost) == 1, outcomes
        assert "these 4 sandboxes need 4 sandboxes" in lost[0].message and lost[0].field == "quota.sandboxes"
        assert won[0].info.all_or_nothing
        made, failed = await won[0].result(timeout=120)
        assert len(made) == 4 and not failed and (await won[0].get()).state == "done"

        # 2 left of 6: a gang of 3 is refused at once and makes nothing; one of 2 is whole
        with pytest.raises(dsec.QuotaExceeded) as e:
            await b.create_many(args, 3, all_or_nothing=True)
        assert "'gangs'" in e.value.message and "2 of" not in e.value.message
        assert len(await a.list()) == 4 and await _usage(a) == 4
        second = await b.create_many(args, 2, all_or_nothing=True)
        made2, failed2 = await second.result(timeout=120)
        assert len(made2) == 2 and not failed2
        assert await _usage(b) == 6
        await a.stop_many(labels={"dsec.project": PROJECT})
        await _until_usage(a, 0, "after the stops")


async def test_a_gang_larger_than_the_fleet_is_refused_naming_the_room_and_holds_nothing(
        two: TwoReplicas, token: str) -> None:
    async with dsec.AsyncClient(url=two.api_b.url, token=token) as b:
        big = dsec.ContainerArgs(image="base/busybox", memory_limit_mb=1024 * 1024, memory_request_mb=1024 * 1024)
        with pytest.raises(dsec.AdmissionRejected) as e:
            await b.create_many(big, 2, all_or_nothing=True)
        assert "room for 0 of these 2 sandboxes" in e.value.message and e.value.field == "n"
        assert await _usage(b) == 0 and not await b.list()
        # a plain batch of the same is accepted, and its items fail one by one (the difference)
        plain = await b.create_many(big, 2)
        made, failed = await plain.result(timeout=60)
        assert not made and len(failed) == 2


async def test_a_jobs_creation_rate_is_one_budget_for_every_replica(two: TwoReplicas, token: str) -> None:
    async with dsec.AsyncClient(url=two.api.url, token=TOKEN) as admin:
        await admin.create_job("paced", quota=JobQuota(creates_per_s=2), project=PROJECT)
    async with dsec.AsyncClient(url=two.api.url, token=token) as a, \
            dsec.AsyncClient(url=two.api_b.url, token=token) as b:
        args = dsec.ContainerArgs(job="paced", **SMALL)  # type: ignore[arg-type]
        started = time.monotonic()
        outcomes = await asyncio.gather(*(c.run_container(args) for c in (a, b, a, b, a, b)),
                                        return_exceptions=True)
        elapsed = time.monotonic() - started
        made = [o for o in outcomes if isinstance(o, dsec.AsyncSandbox)]
        limited = [o for o in outcomes if isinstance(o, dsec.RateLimited)]
        assert len(made) + len(limited) == 6, outcomes
        # a second's worth at once (2), and what 2/s refills while they ran, never more
        assert 2 <= len(made) <= 2 + int(elapsed * 2) + 1 and limited, (len(made), elapsed)
        assert all(0 < e.retry_after <= 1.0 and e.field == "quota.creates_per_s" and e.infra for e in limited)
        assert all(s.info.sandbox_id.split("-")[0] == "n1" for s in made)
        # the HTTP face: 429, Retry-After in whole seconds, the exact wait in the body
        for _ in range(5):
            async with httpx.AsyncClient() as h:
                r = await h.post(f"{two.api_b.url}/v1/sandboxes", headers={"Authorization": f"Bearer {token}"},
                                 json={"args": {"backend": "container", "job": "paced", **SMALL}})
            if r.status_code == 429:
                break
            assert r.status_code == 200, r.text
            made.append(await b.connect(r.json()["sandbox_id"]))
        assert r.status_code == 429 and r.json()["error"] == "rate_limited", r.text
        assert r.headers["Retry-After"] == "1" and 0 < r.json()["retry_after"] <= 1.0
        await a.stop_many(job="paced")
        await _until_usage(a, 0, "after the stops")

        # a batch's items wait for the budget instead of failing: 4 made, paced at 2/s
        await asyncio.sleep(1.0)
        batch = await b.create_many(args, 4, all_or_nothing=True)
        made2, failed2 = await batch.result(timeout=60)
        assert len(made2) == 4 and not failed2
        times = sorted([(await s.refresh()).created_at for s in made2])
        assert times[-1] - times[0] >= 0.5, times  # 2 at once, then one each half second
        await a.stop_many(job="paced")
        await _until_usage(a, 0, "after the stops")


async def test_a_gang_whose_item_cannot_be_made_fails_whole(two: TwoReplicas, token: str) -> None:
    async with dsec.AsyncClient(url=two.api.url, token=TOKEN) as admin:
        await admin.create_job("brittle", quota=JobQuota(creates_per_s=1), project=PROJECT)
    async with dsec.AsyncClient(url=two.api.url, token=token) as a:
        args = dsec.ContainerArgs(job="brittle", **SMALL)  # type: ignore[arg-type]
        gang = await a.create_many(args, 4, all_or_nothing=True)
        assert await _usage(a) == 4  # all four held before the call returned
        deadline = time.monotonic() + 30
        while not (await gang.get()).counts.running:
            assert time.monotonic() < deadline, await gang.get()
            await asyncio.sleep(0.1)
        job = await a.job("brittle")
        await job.pause()  # its next item gets 409 job_not_active: the gang cannot be whole
        info = await gang.wait(timeout=60)
        assert info.state == "failed" and info.reason and "all or nothing" in info.reason, info
        assert info.counts.failed >= 1 and info.counts.queued == 0
        deadline = time.monotonic() + 30
        while [s for s in await a.list(job="brittle") if s.state in ("running", "paused", "creating")]:
            assert time.monotonic() < deadline, "what the failed gang made was not stopped"
            await asyncio.sleep(0.2)
        await _until_usage(a, 0, "what the failed gang held")
        # another replica answers the same from the database, once A's flusher wrote it (0.25 s)
        async with dsec.AsyncClient(url=two.api_b.url, token=token) as b:
            deadline = time.monotonic() + 10
            while (seen := await (await b.batch(gang.id)).get()).state == "running":
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.1)
            assert seen.state == "failed" and seen.all_or_nothing and seen.reason


async def _cli(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "dsec.client.cli.main", *argv],
                                   capture_output=True, text=True, timeout=timeout)


async def test_the_cli_makes_a_gang_or_says_why_not(two: TwoReplicas, token: str) -> None:
    auth = ["--url", two.api_b.url, "--token", token]
    small = ["--image", "base/busybox", "--memory-mb", "64", "--cpus", "0.25"]
    ok = await _cli(["create", *small, "--count", "3", "--all-or-nothing", *auth], 120)
    assert ok.returncode == 0, ok.stderr
    ids = ok.stdout.split()
    assert len(ids) == 3 and all(i.startswith("n1-") for i in ids), ok.stdout
    refused = await _cli(["create", *small, "--count", "4", "--all-or-nothing", *auth], 60)
    assert refused.returncode == 2 and "quota_exceeded" in refused.stderr and "these 4 sandboxes need" in \
        refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    job = await _cli(["job", "create", "cli-paced", "--creates-per-s", "5", *auth], 60)
    assert job.returncode == 0 and '"creates_per_s":5.0' in job.stdout, job.stdout + job.stderr
    bad = await _cli(["job", "create", "cli-bad", "--creates-per-s", "0", *auth], 60)
    assert bad.returncode == 2 and "creates_per_s" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    stop = await _cli(["stop", *ids, *auth], 60)
    assert stop.returncode == 0, stop.stderr
