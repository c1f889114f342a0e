"""Quota blocks (dsec.control.iam.blocks) on a real PostgreSQL, two replicas each with an engine of
its own: creates admitted from a block write no project row; creates racing from two
replicas for the last units never overshoot, and once the blocks are given back the quota
fills exactly to its cap; a block its replica stopped renewing (a crash) is freed by the
sweep and its create still in flight is counted at its bind; a project's delete frees its
blocks; usage shown is what sandboxes hold, not what is charged ahead; a block refused over
a lowered cap charges nothing; a bind retried after its commit's answer was lost counts once."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import Engine, event, select, update

from dsec.control.iam import blocks as blocks_mod
from dsec.control.iam.blocks import QuotaBlocks, free_stale
from dsec.control.iam.projects import ProjectStore
from dsec.control.iam.quota import Need, ProjectQuotas
from dsec.shared.errors import QuotaExceeded
from dsec.shared.meta import open_db
from dsec.shared.meta.schema import project_holds, projects, quota_blocks
from dsec.shared.wire.iam import ProjectPatch, ProjectQuota, ProjectSpec
from tests.test_catalog_db import db_url, pg_url  # noqa: F401  (fixtures: a PostgreSQL server, a database)

pytestmark = pytest.mark.asyncio
ONE = Need.of(1.0, 512, 1024)
_ids = itertools.count()


class Replica:
    """One apiserver replica's quota side: its engine, store, blocks and their keeper."""

    def __init__(self, url: str) -> None:
        self.db: Engine = open_db(url)
        self.quotas = ProjectQuotas(self.db)
        self.store = ProjectStore(self.db, self.quotas)
        self.blocks = QuotaBlocks(self.quotas, enabled=True)
        self.keeper: asyncio.Task[None] | None = None
        self.project_writes = 0

        @event.listens_for(self.db, "before_cursor_execute")
        def _count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if statement.lstrip().upper().startswith("UPDATE PROJECTS"):
                self.project_writes += 1

    def start(self) -> None:
        self.keeper = asyncio.create_task(self.blocks.run())

    async def create(self, project: str) -> str | None:
        """Admit and bind one create (its sandbox id), or None if refused."""
        try:
            hold = await self.blocks.admit(project, None, ONE)
        except QuotaExceeded:
            return None
        await asyncio.sleep(0.001)  # the edge's create
        sid = f"e1-{next(_ids):012x}"
        await self.blocks.bind(hold, sid, None)
        return sid

    async def close(self) -> None:
        if self.keeper is not None:
            self.keeper.cancel()
            await asyncio.gather(self.keeper, return_exceptions=True)
        self.db.dispose()


@pytest_asyncio.fixture
async def two(db_url: str) -> AsyncIterator[tuple[Replica, Replica]]:  # noqa: F811
    a, b = Replica(db_url), Replica(db_url)
    yield a, b
    await a.close()
    await b.close()


def _counters(db: Engine, name: str) -> tuple[int, int]:
    with db.connect() as c:
        row = c.execute(select(projects.c.u_sandboxes, projects.c.u_starting).where(projects.c.name == name)).one()
    return int(row[0]), int(row[1])


def _rows(db: Engine, table: Any) -> int:
    with db.connect() as c:
        return len(c.execute(select(table)).all())


async def test_creates_from_a_block_write_no_project_row(two: tuple[Replica, Replica]) -> None:
    a, _ = two
    a.store.create(ProjectSpec(name="rl", quota=ProjectQuota(sandboxes=1000)), "admin")
    a.store.create(ProjectSpec(name="rl/team", quota=ProjectQuota(sandboxes=500)), "admin")
    a.store.create(ProjectSpec(name="rl/team/grpo"), "admin")
    a.start()
    first = await a.create("rl/team/grpo")  # one by one; it asks for a block meanwhile
    assert first is not None
    await asyncio.sleep(0.2)
    held = a.blocks.held()["rl/team/grpo"]
    assert blocks_mod.MIN_BLOCK <= held["granted_sandboxes"] <= blocks_mod.BLOCK, held
    before = a.project_writes
    made = [await a.create("rl/team/grpo") for _ in range(20)]
    assert all(made)
    assert a.project_writes == before, "a create from a block wrote a project row"
    # the counters hold the block whole; usage shown is the 21 sandboxes'
    u, starting = _counters(a.db, "rl")
    assert u == 1 + held["granted_sandboxes"], (u, held)
    assert starting == held["granted_starting"], starting  # the block's starting slots, none in flight
    for name in ("rl", "rl/team", "rl/team/grpo"):
        assert a.store.get(name).usage.sandboxes == 21, name
    assert _rows(a.db, project_holds) == 21
    # stopped, then idle: the block goes back, and the counters are exactly zero
    for sid in [first, *made]:
        assert a.quotas.release(sandbox_id=sid)
    await asyncio.sleep(blocks_mod.IDLE_S + 3 * blocks_mod.TICK_S)
    assert _counters(a.db, "rl") == (0, 0) == _counters(a.db, "rl/team/grpo")
    assert _rows(a.db, quota_blocks) == 0 and a.blocks.held() == {}


async def test_two_replicas_racing_for_the_last_units_never_overshoot(two: tuple[Replica, Replica]) -> None:
    a, b = two
    a.store.create(ProjectSpec(name="cap", quota=ProjectQuota(sandboxes=100)), "admin")
    a.store.create(ProjectSpec(name="cap/x"), "admin")
    a.start()
    b.start()
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, _counters(a.db, "cap")[0])
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        async def worker(r: Replica, n: int) -> list[str | None]:
            return [await r.create("cap/x") for _ in range(n)]

        got = await asyncio.gather(*(worker(r, 10) for r in (a, b) for _ in range(8)))
        made = [s for part in got for s in part if s]
        assert 0 < len(made) <= 100, len(made)
        assert _rows(a.db, project_holds) == len(made)
        # what the blocks held unused goes back within IDLE_S; then the quota fills to exactly 100
        await asyncio.sleep(blocks_mod.IDLE_S + 3 * blocks_mod.TICK_S)
        more = await asyncio.gather(*(worker(r, 10) for r in (a, b) for _ in range(4)))
        made += [s for part in more for s in part if s]
    finally:
        watcher.cancel()
    assert len(made) == 100 and len(set(made)) == 100, len(made)
    assert peak <= 100, peak
    assert await a.create("cap/x") is None and await b.create("cap/x") is None
    assert _counters(a.db, "cap") == (100, 0) or _rows(a.db, quota_blocks) > 0
    await asyncio.sleep(blocks_mod.IDLE_S + 3 * blocks_mod.TICK_S)
    assert _counters(a.db, "cap") == (100, 0)
    assert a.store.get("cap").usage.sandboxes == 100 == _rows(a.db, project_holds)


async def test_a_dead_replicas_block_is_freed_and_its_create_in_flight_counted(
        two: tuple[Replica, Replica]) -> None:
    a, b = two
    a.store.create(ProjectSpec(name="team", quota=ProjectQuota(sandboxes=1000)), "admin")
    await a.create("team")
    await asyncio.sleep(0.2)  # its block is charged
    granted = a.blocks.held()["team"]["granted_sandboxes"]
    in_flight = await a.blocks.admit("team", None, ONE)  # from the block; then replica A "dies"
    assert a.blocks.source(in_flight) is not None
    assert _counters(a.db, "team")[0] == 1 + granted
    # not renewed since long ago: the sweep (replica B's) frees it
    with b.db.begin() as c:
        c.execute(update(quota_blocks).values(renewed_at=time.time() - blocks_mod.STALE_S - 1))
    assert free_stale(b.quotas, time.time() - blocks_mod.STALE_S) == 1
    assert _counters(b.db, "team") == (1, 0)
    # the create in flight comes back: its bind finds the block gone and counts it on its own
    there = await a.quotas.bind_soon(in_flight, "e1-0000000fffff", None, a.blocks.source(in_flight))
    assert there is False
    a.blocks.bound(in_flight, there)
    assert _counters(b.db, "team") == (2, 0) and _rows(b.db, project_holds) == 2
    # A drops the gone block: its next create is one by one, then from a fresh block
    assert "team" not in a.blocks.held()
    assert await a.create("team") is not None
    assert b.store.get("team").usage.sandboxes == 3


async def test_a_projects_delete_frees_its_blocks(two: tuple[Replica, Replica]) -> None:
    a, b = two
    a.store.create(ProjectSpec(name="org", quota=ProjectQuota(sandboxes=50)), "admin")
    a.store.create(ProjectSpec(name="org/tmp"), "admin")
    sid = await a.create("org/tmp")
    await asyncio.sleep(0.2)
    assert a.blocks.held()["org/tmp"]["granted_sandboxes"] >= blocks_mod.MIN_BLOCK
    assert sid is not None and a.quotas.release(sandbox_id=sid)
    b.store.delete("org/tmp", "admin")
    assert _counters(b.db, "org") == (0, 0) and _rows(b.db, quota_blocks) == 0


async def test_no_block_over_a_lowered_cap_and_a_retried_bind_counts_once(two: tuple[Replica, Replica]) -> None:
    a, _ = two
    a.store.create(ProjectSpec(name="low", quota=ProjectQuota(sandboxes=1000, disk_mb=100_000)), "admin")
    a.store.create(ProjectSpec(name="low/a"), "admin")
    sid = await a.create("low/a")  # 1024 MiB of disk held; a block charged
    await asyncio.sleep(0.2)
    hold = await a.blocks.admit("low/a", None, ONE)
    src = a.blocks.source(hold)
    assert src is not None
    assert a.quotas.bind(hold, "e1-0000000eeeee", None, src)
    before = _counters(a.db, "low/a")
    assert a.quotas.bind(hold, "e1-0000000eeeee", None, src)  # again: its answer was lost, say
    assert _counters(a.db, "low/a") == before and _rows(a.db, project_holds) == 2
    a.blocks.bound(hold)
    # the cap lowered below what is held: a need of no disk gets no block, and nothing is charged
    for b in list(a.blocks._blocks.values()):
        await a.blocks._give_back(b)
    assert sid is not None
    a.store.update("low", ProjectPatch(quota=ProjectQuota(disk_mb=1000)), "admin")
    u = _counters(a.db, "low/a")
    got = blocks_mod.charge(a.quotas, "r/low/a/x", "r", "low/a", Need.of(1.0, 512, 0), fresh=True)
    assert got == {} and _counters(a.db, "low/a") == u and _rows(a.db, quota_blocks) == 0
