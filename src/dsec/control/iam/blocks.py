"""Quota blocks: a share of a project lineage's quota charged ahead to one apiserver
replica, which admits its creates from it in memory, so that a create writes no project row.

Why: an admission charges the counters of its project and of every ancestor. One
transaction per create put every create of a team (one tree) in line on the root's row, a
commit each (bench/iam.py: ~100 admissions/s per tree, bench/scale.py: ~1 ms of the
database's CPU per create). Now a replica charges a block (up to BLOCK creates' worth of the
need that asked) in one transaction and takes creates from it in memory; a create's bind,
group-committed already, writes its hold and moves its amounts from the block's row to the
hold. The counters do not move for it at all.

**Exact at the cap.** The counters always include every block whole, and a block is charged
by the same conditional UPDATE as one create: a project never exceeds its quota. A block is
at most 1/SHARE of what the lineage has left, and none is charged below MIN_BLOCK creates'
worth: near the cap, creates are admitted one by one as before. A replica refused one by
one gives its own blocks of that lineage back and tries once more; other replicas give back
a block they do not use within IDLE_S.

**Crashes.** A block's row names its replica and when it was last renewed (any write of its
own: a refill, a bind, a give-back, or a renewal every RENEW_S while it holds anything). The
quota sweep frees a block not renewed for STALE_S; the creates it had in flight are found on
the edges and adopted, as any sandbox made without a hold. A replica admits from a block only
within USE_S (< STALE_S) of its last renewal: one cut off from the database stops before the
sweep frees what it would be using. A block whose row is gone (freed by the sweep, its project
deleted) is dropped; a create it admitted is counted by its bind directly.

Blocks are for PostgreSQL (replicas share it); ``DSEC_QUOTA_BLOCKS=0`` turns them off.
SQLite (one process) admits in place, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.sql.elements import ColumnElement

from dsec.control.iam.quota import CHARGE, COLUMNS, Also, FromBlock, Need, ProjectQuotas, _lock
from dsec.shared.errors import QuotaExceeded
from dsec.shared.meta.schema import projects, quota_blocks
from dsec.shared.wire.iam import lineage

log = logging.getLogger("dsec.iam.blocks")

BLOCK = 64  # creates' worth of the asking need in one block at most
SHARE = 8  # a block is at most this fraction of what the lineage has left
MIN_BLOCK = 4  # below this many creates' worth, no block: one by one
LOW = 0.5  # refilled ahead once less than this share of a block is free
IDLE_S = 2.0  # a block not used for this long is given back
RENEW_S = 10.0
USE_S = 30.0  # admitted from only within this long of its last renewal
STALE_S = 90.0  # the sweep frees a block not renewed for this long (holder clocks within 60 s)
DENIED_S = 1.0  # after a block was refused (near the cap), one by one for this long
TICK_S = 0.5
RESOURCES = tuple(COLUMNS)  # sandboxes, cpu_cores, memory_mb, disk_mb, starting
_c = quota_blocks.c
_AMOUNT_COLS = {"sandboxes": _c.sandboxes, "cpu_cores": _c.cpu_milli, "memory_mb": _c.memory_mb,
                "disk_mb": _c.disk_mb, "starting": _c.starting}


# --- the database side (blocking: run in a thread) ------------------------------------------

def charge(quotas: ProjectQuotas, block: str, replica: str, project: str, need: Need, fresh: bool
           ) -> dict[str, int] | None:
    """Charge one more block to ``block``'s row (``fresh``: a new row): the amounts, {} if the
    lineage has no room for MIN_BLOCK creates' worth, None if the row is gone."""
    names = lineage(project)
    one = need.amounts()
    try:
        return _charge(quotas, block, replica, project, names, one, need, fresh)
    except _NoRoom:  # (raised in the transaction: a CHARGE that matched some rows is rolled back)
        return {}


def _charge(quotas: ProjectQuotas, block: str, replica: str, project: str, names: list[str],
            one: dict[str, int], need: Need, fresh: bool) -> dict[str, int] | None:
    with quotas._txn() as c:
        if not fresh and c.execute(select(_c.id).where(_c.id == block).with_for_update()).first() is None:
            return None
        _lock(c, names)
        rows = c.execute(select(projects).where(projects.c.name.in_(names))).mappings().all()
        if len(rows) != len(names):  # a project of the lineage does not exist (yet): one by one
            raise _NoRoom
        k = BLOCK
        for row in rows:
            for r, (u, q) in COLUMNS.items():
                if row[q] is not None and (one[r] or row[u] > row[q]):  # (over a lowered cap: none)
                    k = min(k, (row[q] - row[u]) // (SHARE * max(one[r], 1)))
        if k < MIN_BLOCK:
            raise _NoRoom
        amounts = need.amounts(k)
        if c.execute(CHARGE, {"names": names, **{f"a_{r}": v for r, v in amounts.items()}}).rowcount != len(names):
            raise _NoRoom
        values = {col.key: amounts[r] for r, col in _AMOUNT_COLS.items()}
        if fresh:
            c.execute(insert(quota_blocks).values(id=block, replica=replica, project=project, renewed_at=time.time(),
                                                  **values))
        else:
            c.execute(update(quota_blocks).where(_c.id == block).values(
                renewed_at=time.time(), **{col.key: col + amounts[r] for r, col in _AMOUNT_COLS.items()}))
        return amounts


def give_back(quotas: ProjectQuotas, block: str, project: str, amounts: dict[str, int]) -> bool:
    """Free ``amounts`` of ``block`` (unused): out of its row and the lineage's counters; the
    row goes once it holds nothing. False if the row is gone (its amounts were freed then)."""
    with quotas._txn() as c:
        left = c.execute(update(quota_blocks).where(_c.id == block).values(
            renewed_at=time.time(), **{col.key: col - amounts[r] for r, col in _AMOUNT_COLS.items()})
            .returning(*_AMOUNT_COLS.values())).first()
        if left is None:
            return False
        ProjectQuotas._move(c, project, *(-amounts[r] for r in RESOURCES))
        if not any(left):
            c.execute(delete(quota_blocks).where(_c.id == block))
        return True


def renew(quotas: ProjectQuotas, blocks: list[str]) -> set[str]:
    """Mark ``blocks`` alive; the ones whose row is gone."""
    with quotas._txn() as c:
        found = c.execute(update(quota_blocks).where(_c.id.in_(blocks)).values(renewed_at=time.time())
                          .returning(_c.id)).scalars().all()
    return set(blocks) - set(found)


def free_stale(quotas: ProjectQuotas, cutoff: float) -> int:
    """The sweep: free every block not renewed since ``cutoff`` (its replica is gone)."""
    return _free(quotas, _c.renewed_at < cutoff)


def free_project(c: Connection, project: str) -> None:
    """In a project's delete (``c``, its transaction): its blocks go, their amounts freed from
    its ancestors' counters; their holders find them gone at their next write."""
    _free_in(c, _c.project == project)


def _free(quotas: ProjectQuotas, cond: ColumnElement[bool]) -> int:
    with quotas._txn() as c:
        return _free_in(c, cond)


def _free_in(c: Connection, cond: ColumnElement[bool]) -> int:
    rows = c.execute(delete(quota_blocks).where(cond).returning(_c.project, *_AMOUNT_COLS.values())).all()
    for project, *vals in rows:
        ProjectQuotas._move(c, project, *(-v for v in vals))  # (columns in RESOURCES' order)
    return len(rows)


def unused(c: Connection) -> dict[str, Counter[str]]:
    """What each project's blocks hold (charged ahead, not yet any create's): counters minus
    these is what its sandboxes hold."""
    out: dict[str, Counter[str]] = {}
    for project, *vals in c.execute(select(_c.project, *_AMOUNT_COLS.values())):
        out.setdefault(project, Counter()).update(dict(zip(_AMOUNT_COLS, vals, strict=True)))
    return out


# --- the replica's side (its event loop) ---------------------------------------------------

@dataclass
class _Block:
    id: str
    project: str
    granted: Counter[str] = field(default_factory=Counter)  # as its row holds (as far as known)
    free: Counter[str] = field(default_factory=Counter)  # granted less the creates in flight
    renewed: float = 0.0  # monotonic, when the last write that renewed it began
    used: float = 0.0
    denied_until: float = 0.0
    gone: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    refilling: asyncio.Task[None] | None = None

    def fits(self, amounts: dict[str, int], now: float) -> bool:
        return not self.gone and now - self.renewed < USE_S and all(self.free[r] >= v for r, v in amounts.items())


class QuotaBlocks:
    """One replica's quota blocks: :meth:`admit` a create (from a block, or one by one),
    then :meth:`bound` or :meth:`release` it; :meth:`run` keeps the blocks (refills, gives
    back, renews) until cancelled, then gives back what is unused."""

    def __init__(self, quotas: ProjectQuotas, enabled: bool | None = None) -> None:
        self.quotas = quotas
        self.replica = secrets.token_hex(6)
        if enabled is None:
            enabled = quotas.db.dialect.name == "postgresql" and os.environ.get("DSEC_QUOTA_BLOCKS", "1") != "0"
        self.enabled = enabled
        self._blocks: dict[str, _Block] = {}  # by project
        self._pending: dict[str, tuple[_Block, FromBlock]] = {}  # hold -> its block, admitted, not bound

    async def admit(self, project: str, job: str | None, need: Need) -> str:
        """A create's hold id: from this replica's block of ``project`` if it has room, else
        admitted one by one (QuotaExceeded, NotFound as :meth:`ProjectQuotas.admit`)."""
        if self.enabled and (hold := self._take(project, job, need)) is not None:
            return hold
        try:
            return await self.quotas.run(self.quotas.admit, project, job, need)
        except QuotaExceeded:
            if not self.enabled or not await self._give_back_lineage(project):
                raise
            return await self.quotas.run(self.quotas.admit, project, job, need)

    async def bind(self, hold: str, sandbox_id: str, also: Also | None) -> None:
        """Bind a made create (group-committed, :meth:`ProjectQuotas.bind_soon`); its block
        learns the outcome even if the caller is cancelled meanwhile (the bind goes on)."""
        src = self.source(hold)
        task = asyncio.ensure_future(self.quotas.bind_soon(hold, sandbox_id, also, src))
        if src is not None:
            def done(t: asyncio.Future[bool]) -> None:
                if not t.cancelled() and t.exception() is None:
                    self.bound(hold, t.result())
            task.add_done_callback(done)
        await asyncio.shield(task)

    def source(self, hold: str) -> FromBlock | None:
        """What the bind of a create admitted from a block writes (None: one by one)."""
        got = self._pending.get(hold)
        return got[1] if got is not None else None

    def bound(self, hold: str, block_there: bool = True) -> None:
        """Its bind committed: its share is its hold's now, its starting slot the block's
        again. ``block_there``: False when the bind found the block's row gone (dropped)."""
        got = self._pending.pop(hold, None)
        if got is not None:
            b, src = got
            b.granted.subtract(src.need.amounts(starting=False))
            b.free["starting"] += 1
            b.gone |= not block_there

    async def release(self, hold: str) -> None:
        """A create not made: its share is the block's again (or freed, one by one)."""
        got = self._pending.pop(hold, None)
        if got is None:
            await self.quotas.run(self.quotas.release, hold=hold)
            return
        b, src = got
        b.free.update(src.need.amounts())

    def _take(self, project: str, job: str | None, need: Need) -> str | None:
        now = time.monotonic()
        amounts = need.amounts()
        b = self._blocks.get(project)
        if b is None or b.gone:
            b = self._blocks[project] = _Block(f"{self.replica}/{project}/{uuid.uuid4().hex[:8]}", project)
        b.used = now
        if not b.fits(amounts, now):
            self._refill(b, need, now)
            return None
        b.free.subtract(amounts)
        hold = uuid.uuid4().hex
        self._pending[hold] = (b, FromBlock(b.id, project, job, need, time.time()))
        if any(v and b.free[r] < LOW * BLOCK * v for r, v in amounts.items() if r != "starting"):
            self._refill(b, need, now)
        return hold

    def _refill(self, b: _Block, need: Need, now: float) -> None:
        if (b.refilling is not None and not b.refilling.done()) or now < b.denied_until:
            return
        b.refilling = asyncio.create_task(self._charge(b, need))

    async def _charge(self, b: _Block, need: Need) -> None:
        async with b.lock:
            if b.gone:
                return
            began = time.monotonic()
            fresh = not any(b.granted.values())
            try:
                got = await self.quotas.run(charge, self.quotas, b.id, self.replica, b.project, need, fresh)
            except Exception as e:  # the database is away: one by one meanwhile
                log.debug("block %s not charged: %s", b.id, e)
                got = {}
            if got is None:
                b.gone = True
            elif not got:
                b.denied_until = time.monotonic() + DENIED_S
            else:
                b.granted.update(got)
                b.free.update(got)
                b.renewed = began

    async def _give_back(self, b: _Block) -> bool:
        """Give ``b``'s unused share back; whether anything was."""
        async with b.lock:
            amounts = {r: max(0, b.free[r]) for r in RESOURCES}
            if b.gone or not any(amounts.values()):
                return False
            b.free.subtract(amounts)  # taken out first: no create admits from it meanwhile
            b.granted.subtract(amounts)
            began = time.monotonic()
            try:
                if not await self.quotas.run(give_back, self.quotas, b.id, b.project, amounts):
                    b.gone = True
                    return False
            except Exception as e:  # kept (it is still charged); given back next time
                log.debug("block %s not given back: %s", b.id, e)
                b.free.update(amounts)
                b.granted.update(amounts)
                return False
            b.renewed = began
            return True

    async def _give_back_lineage(self, project: str) -> bool:
        """Refused one by one: give back this replica's blocks that share a project with
        ``project``'s lineage (they may hold what it lacks); whether any were."""
        mine = set(lineage(project))
        given = False
        for b in list(self._blocks.values()):
            if mine & set(lineage(b.project)):
                b.denied_until = time.monotonic() + DENIED_S
                given |= await self._give_back(b)
        return given

    async def tick(self) -> None:
        """Give back idle blocks, renew the others, forget the empty and the gone."""
        now = time.monotonic()
        for b in list(self._blocks.values()):
            if not b.gone and now - b.used > IDLE_S and any(v > 0 for v in b.free.values()):
                await self._give_back(b)
        alive = [b for b in self._blocks.values()
                 if not b.gone and any(v > 0 for v in b.granted.values()) and now - b.renewed > RENEW_S]
        if alive:
            began = time.monotonic()
            try:
                gone = await self.quotas.run(renew, self.quotas, [b.id for b in alive])
            except Exception as e:
                log.debug("blocks not renewed: %s", e)
            else:
                for b in alive:
                    b.gone |= b.id in gone
                    if not b.gone:
                        b.renewed = began
        held = {id(b) for b, _ in self._pending.values()}
        for project, b in list(self._blocks.items()):
            busy = id(b) in held or b.lock.locked() or (b.refilling is not None and not b.refilling.done())
            if not busy and (b.gone or not any(v > 0 for v in b.granted.values())) and now - b.used > IDLE_S:
                del self._blocks[project]

    async def run(self) -> None:
        """Keep the blocks until cancelled; then give back what is unused."""
        if not self.enabled:
            return
        try:
            while True:
                await asyncio.sleep(TICK_S)
                try:
                    await self.tick()
                except Exception as e:
                    log.warning("quota blocks: %s", e)
        finally:
            for b in list(self._blocks.values()):
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._give_back(b))

    def held(self) -> dict[str, dict[str, int]]:
        """Each block's (project) granted and free amounts, for tests and the console."""
        return {b.project: {**{f"granted_{r}": b.granted[r] for r in RESOURCES},
                            **{f"free_{r}": b.free[r] for r in RESOURCES}}
                for b in self._blocks.values() if not b.gone}


class _NoRoom(Exception):
    """No block now: roll the charge back."""
