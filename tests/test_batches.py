"""Batch creates against the real platform: a batch made in full with progress seen rising,
per-item failures (a job's quota), cancel with and without stopping what was made, a plain
create that does not wait behind a queued batch, the per-edge bound on creates starting at
once, a batch that survives an apiserver restart, and bad input."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dsec
from tests.conftest import TOKEN, Platform, own_platform

SMALL = dict(image="base/busybox", memory_limit_mb=32, cpu_cores_limit=0.1)
BOUND = 8  # DSEC_BATCH_STARTING_PER_EDGE's default


async def _stop(sandboxes: list[dsec.AsyncSandbox]) -> None:
    await asyncio.gather(*(s.stop() for s in sandboxes), return_exceptions=True)


async def test_a_batch_of_40_all_run_and_progress_rises(client: dsec.AsyncClient) -> None:
    batch = await client.create_many(dsec.ContainerArgs(**SMALL), n=40)
    assert batch.id.startswith("b-") and batch.info.n == 40
    seen: list[int] = []
    async for counts in batch.progress():
        seen.append(counts.running)
    made, failures = await batch.result()
    try:
        assert failures == []
        assert len(made) == 40 and len({s.sandbox_id for s in made}) == 40
        assert seen == sorted(seen) and seen[-1] == 40 and len(set(seen)) >= 3  # rose in steps, never fell
        info = await batch.get()
        assert info.state == "done" and info.counts.running == 40 and info.finished_at is not None
        one = await made[17].refresh()
        assert one.state == "running" and one.labels["dsec.batch"] == f"{batch.id}/17"
        page = await batch.get(offset=30, limit=20)
        assert [i.index for i in page.items] == list(range(30, 40)) and page.next_offset is None
    finally:
        await _stop(made)


async def test_items_past_the_job_quota_fail_with_its_reason(client: dsec.AsyncClient) -> None:
    job = await client.create_job(f"batch-quota-{uuid.uuid4().hex[:8]}", quota=dsec.JobQuota(sandboxes=10))
    try:
        batch = await job.create_many(dsec.ContainerArgs(**SMALL), n=15)
        made, failures = await batch.result()
        assert len(made) == 10 and len(failures) == 5
        assert all(f.state == "failed" and f.error == "quota_exceeded" and "10 sandboxes" in (f.reason or "")
                   for f in failures)
        assert (await batch.get()).counts.model_dump() == {"queued": 0, "starting": 0, "running": 10, "failed": 5,
                                                           "cancelled": 0}
        assert (await job.status()).usage.sandboxes == 10
        assert (await made[0].refresh()).job == job.name
    finally:
        await job.stop()


async def test_cancel_leaves_made_sandboxes_unless_stop(client: dsec.AsyncClient) -> None:
    batch = await client.create_many(dsec.ContainerArgs(**SMALL), n=80)
    async for counts in batch.progress():
        if counts.running >= 4:
            break
    info = await batch.cancel()
    assert info.state == "cancelled" and info.counts.cancelled > 0
    made, rest = await batch.result()
    try:
        assert len(made) + len(rest) == 80 and len(made) >= 4
        assert all(r.state == "cancelled" and r.reason == "the batch was cancelled" for r in rest)
        assert (await made[0].refresh()).state == "running"  # started ones stay
        await batch.cancel(stop=True)
        assert (await made[0].refresh()).state == "stopped"
        assert (await made[-1].refresh()).state == "stopped"
    finally:
        await _stop(made)


async def test_a_plain_create_does_not_wait_behind_a_batch_and_starting_is_bounded(
        client: dsec.AsyncClient) -> None:
    batch = await client.create_many(dsec.ContainerArgs(**SMALL), n=200)
    samples: list[int] = []
    stop_sampling = asyncio.Event()

    async def sample() -> None:
        while not stop_sampling.is_set():
            adm = (await client._json("GET", "/v1/batches/admission"))
            samples.append(sum(adm["starting"].values()))
            await asyncio.sleep(0.05)
    sampler = asyncio.create_task(sample())
    made: list[dsec.AsyncSandbox] = []
    try:
        async for counts in batch.progress():
            if counts.running >= 10:
                break
        t0 = time.monotonic()
        single = await client.run_container(dsec.ContainerArgs(**SMALL))
        took = time.monotonic() - t0
        made.append(single)
        mid = await batch.get()
        assert mid.counts.queued > 100, "the batch was nearly drained: the single create proves nothing"
        assert took < 10, f"a plain create took {took:.1f}s next to a batch"
        await asyncio.sleep(1.0)
        stop_sampling.set()
        await sampler
        adm = await client._json("GET", "/v1/batches/admission")
        assert adm["per_edge_starting"] == BOUND
        assert max(adm["peak_starting"].values()) <= BOUND + 1  # the batch's 8, and the plain create
        assert samples and max(samples) <= BOUND + 1 and max(samples) >= 2
    finally:
        stop_sampling.set()
        await batch.cancel(stop=True)
        await batch.wait()
        await _stop(made)
    info = await batch.get()
    assert info.counts.cancelled > 0 and info.state == "cancelled"


@pytest.fixture(scope="module")
def restartable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    yield from own_platform(tmp_path_factory, "dsec-batches", env={"DSEC_BATCH_STARTING_PER_EDGE": "2"})


# enough items that the batch is still unfinished when the apiserver goes (24 were all made,
# two at a time, before the first progress event once a create took 20 ms)
N_RESTART = 60


@pytest.mark.parametrize("crash", [False, True], ids=["sigterm", "sigkill"])
async def test_a_batch_survives_an_apiserver_restart(restartable: Platform, crash: bool) -> None:
    async with dsec.AsyncClient(url=restartable.url, token=TOKEN) as c:
        batch = await c.create_many(dsec.ContainerArgs(**SMALL), n=N_RESTART)
        async for counts in batch.progress():
            if counts.running >= 3:
                break
        assert counts.queued > 0  # unfinished when the apiserver goes
    restartable.restart(crash=crash)
    async with dsec.AsyncClient(url=restartable.url, token=TOKEN) as c:
        b = await c.batch(batch.id)
        made, failures = await b.result(timeout=120)
        try:
            assert failures == [] and len(made) == N_RESTART
            live = [s for s in await c.list() if s.labels.get("dsec.batch", "").startswith(batch.id + "/")]
            # none made twice: one live sandbox per item
            assert sorted(s.labels["dsec.batch"] for s in live) == sorted(f"{batch.id}/{i}" for i in range(N_RESTART))
            assert {s.sandbox_id for s in live} == {s.sandbox_id for s in made}
        finally:
            await _stop([await c.connect(s.sandbox_id) for s in made])


def test_bad_input_names_the_field(platform: Platform) -> None:
    h = {"Authorization": f"Bearer {TOKEN}"}
    for n in (0, 32_769):
        r = httpx.post(f"{platform.url}/v1/batches", json={"args": SMALL, "n": n}, headers=h)
        assert r.status_code == 400 and r.json()["field"] == "n", r.text
    r = httpx.post(f"{platform.url}/v1/batches", json={"args": {**SMALL, "memory_limit_mb": 1}, "n": 2}, headers=h)
    assert r.status_code == 400 and r.json()["field"] == "memory_limit_mb", r.text
    for path in ("/v1/batches/b-0000000000000000", "/v1/batches/b-0000000000000000/events"):
        r = httpx.get(f"{platform.url}{path}", headers=h)
        assert r.status_code == 404 and r.json()["field"] == "batch_id", r.text
    r = httpx.post(f"{platform.url}/v1/batches/b-0000000000000000/cancel", headers=h)
    assert r.status_code == 404 and r.json()["field"] == "batch_id"
    with dsec.Client(url=platform.url, token=TOKEN) as c, pytest.raises(dsec.InvalidRequest) as e:
        c.create_many(dsec.ContainerArgs(**SMALL), 0)
    assert e.value.field == "n"


async def test_a_small_batch_of_another_job_is_not_starved_by_a_big_one(client: dsec.AsyncClient) -> None:
    big = await client.create_many(dsec.ContainerArgs(**SMALL), n=200, job=f"big-{uuid.uuid4().hex[:6]}")
    small = await client.create_many(dsec.ContainerArgs(**SMALL), n=6, job=f"small-{uuid.uuid4().hex[:6]}")
    made: list[dsec.AsyncSandbox] = []
    try:
        made, failures = await small.result(timeout=60)
        assert len(made) == 6 and failures == []
        assert (await big.get()).counts.queued > 100  # round-robin: the small one did not wait for the big one
    finally:
        await big.cancel(stop=True)
        await big.wait()
        await _stop(made)


def test_one_apiserver_takes_an_orphaned_batch_over(tmp_path: Path) -> None:
    from dsec.control.batches.store import BatchRow, BatchStore
    from dsec.shared.meta import open_db, sqlite_url
    store = BatchStore(open_db(sqlite_url(str(tmp_path))))
    store.create(BatchRow(id="b-1", project="default", job=None, n=3, args="{}", state="running", created_at=1.0,
                          finished_at=None, owner="a", heartbeat_at=10.0))
    assert store.orphans(stale_before=5.0) == []  # its owner was heard of since
    [row] = store.orphans(stale_before=20.0)
    assert store.claim(row, "b", 30.0) and not store.claim(row, "c", 30.0)  # one of two takes it
    assert store.heartbeat("a", ["b-1"], 31.0) == set()  # the old owner learns it lost it
    assert store.heartbeat("b", ["b-1"], 31.0) == {"b-1"}
    store.record([{"batch_id": "b-1", "idx": 0, "state": "running", "sandbox_id": "e-1", "error": None,
                   "reason": None}], [])
    store.record([{"batch_id": "b-1", "idx": 0, "state": "failed", "sandbox_id": None, "error": "x",
                   "reason": "y"}], [("b-1", "done", 40.0)])  # a second outcome for an item is ignored
    assert [(i.idx, i.sandbox_id) for i in store.items("b-1")] == [(0, "e-1")]
    assert store.get("b-1").state == "done"  # type: ignore[union-attr]


async def test_throttled_batches_hold_no_slot_from_another_jobs_batch(client: dsec.AsyncClient) -> None:
    """Red team: jobs paced at one create per 100 s, each with a batch of 2, once held every
    one of a replica's 8 batch slots while their second items waited for a token, so
    another project's batches (and gangs, holding their reserved quota) sat queued for up
    to 15 minutes. A throttled batch now waits holding no slot: the other batch is made."""
    tag = uuid.uuid4().hex[:6]
    throttled = []
    for k in range(8):
        await client.create_job(f"slow{k}-{tag}", quota=dsec.JobQuota(creates_per_s=0.01))
        throttled.append(await client.create_many(dsec.ContainerArgs(**SMALL), 2, job=f"slow{k}-{tag}"))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(1.5)  # each first item took its job's one token; each second waits 100 s
        other = await client.create_many(dsec.ContainerArgs(**SMALL), 4, job=f"fast-{tag}")  # type: ignore[arg-type]
        made, failed = await other.result(timeout=30)
        assert len(made) == 4 and not failed
        for b in throttled:
            info = await b.get()
            assert info.state == "running" and info.counts.running == 1 and info.counts.queued == 1, info.counts
        await _stop(made)
    finally:
        for b in throttled:
            await b.cancel(stop=True)
    with pytest.raises(dsec.InvalidRequest) as e:  # a rate too slow to mean anything
        await client.create_job(f"never-{tag}", quota=dsec.JobQuota.model_construct(creates_per_s=5e-324))
    assert "creates_per_s" in (e.value.field or "") + e.value.message


def test_finished_batches_are_forgotten_and_a_project_holds_a_bounded_number_of_items(tmp_path: Path) -> None:
    """Red team: finished batches and their items' rows were never deleted, so a project with
    no quota grew the metadata database by ~2 MB a request. Finished ones go after
    DSEC_BATCH_KEEP_S (24 h), and a project's running batches hold at most 4 x 32768 items."""
    from dsec.control.batches.runner import MAX_PENDING_ITEMS
    from dsec.control.batches.store import BatchRow, BatchStore
    from dsec.shared.meta import open_db, sqlite_url
    store = BatchStore(open_db(sqlite_url(str(tmp_path))))
    for i, (state, finished) in enumerate([("done", 100.0), ("failed", 100.0), ("done", 5000.0), ("running", None)]):
        store.create(BatchRow(id=f"b-{i}", project="p", job=None, n=10 * (i + 1), args="{}", state=state,
                              created_at=1.0, finished_at=finished))
        store.record([{"batch_id": f"b-{i}", "idx": 0, "state": "failed", "sandbox_id": None, "error": "x",
                       "reason": "y"}], [])
    assert store.pending_items("p") == 40 and store.pending_items("q") == 0
    assert store.prune(finished_before=1000.0) == 2
    assert store.get("b-0") is None and store.get("b-1") is None and store.items("b-0") == []
    assert store.get("b-2") is not None and store.get("b-3") is not None and len(store.items("b-3")) == 1
    assert MAX_PENDING_ITEMS == 4 * 32768
