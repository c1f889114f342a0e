"""Batch records in the metadata database: a row per batch, a row per item with an outcome
(items without one are queued or starting). Blocking calls: the runner runs them in a thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Engine, delete, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from dsec.shared.meta.batches_schema import batch_items, batches


@dataclass
class BatchRow:
    id: str
    project: str
    job: str | None
    n: int
    args: str
    state: str
    created_at: float
    finished_at: float | None
    owner: str | None = None
    heartbeat_at: float | None = None
    gang: bool = False  # all or nothing: its items hold reserved quota (dsec.control.iam.quota)


@dataclass
class ItemRow:
    idx: int
    state: str
    sandbox_id: str | None
    error: str | None
    reason: str | None


class BatchStore:
    def __init__(self, db: Engine) -> None:
        self.db = db

    def create(self, row: BatchRow) -> None:
        with self.db.begin() as c:
            c.execute(insert(batches).values(**row.__dict__))

    def get(self, batch_id: str) -> BatchRow | None:
        with self.db.connect() as c:
            r = c.execute(select(batches).where(batches.c.id == batch_id)).mappings().first()
        return BatchRow(**dict(r)) if r else None

    def pending_items(self, project: str) -> int:
        """How many items the project's running batches hold (made or not), every replica's."""
        with self.db.connect() as c:
            return int(c.execute(select(func.coalesce(func.sum(batches.c.n), 0)).where(
                batches.c.project == project, batches.c.state == "running")).scalar() or 0)

    def prune(self, finished_before: float, limit: int = 1000) -> int:
        """Forget up to ``limit`` batches that finished before ``finished_before``, with
        their items; how many."""
        with self.db.begin() as c:
            ids = list(c.execute(select(batches.c.id).where(batches.c.state != "running",
                                                            batches.c.finished_at < finished_before)
                                 .limit(limit)).scalars())
            if ids:
                c.execute(delete(batch_items).where(batch_items.c.batch_id.in_(ids)))
                c.execute(delete(batches).where(batches.c.id.in_(ids)))
        return len(ids)

    def running(self) -> set[str]:
        """The ids of every batch still running (whichever replica runs it)."""
        with self.db.connect() as c:
            return set(c.execute(select(batches.c.id).where(batches.c.state == "running")).scalars())

    def orphans(self, stale_before: float) -> list[BatchRow]:
        """Unfinished batches whose owner released them or has not been heard of since ``stale_before``."""
        with self.db.connect() as c:
            rows = c.execute(select(batches).where(
                batches.c.state == "running",
                or_(batches.c.heartbeat_at.is_(None), batches.c.heartbeat_at < stale_before))
                .order_by(batches.c.created_at)).mappings().all()
        return [BatchRow(**dict(r)) for r in rows]

    def claim(self, row: BatchRow, owner: str, now: float) -> bool:
        """Take an orphan over, unless another process took it first (compare-and-set on its heartbeat)."""
        hb = (batches.c.heartbeat_at.is_(None) if row.heartbeat_at is None
              else batches.c.heartbeat_at == row.heartbeat_at)
        with self.db.begin() as c:
            r = c.execute(update(batches).where(batches.c.id == row.id, batches.c.state == "running", hb)
                          .values(owner=owner, heartbeat_at=now))
        return r.rowcount == 1

    def heartbeat(self, owner: str, ids: list[str], now: float | None) -> set[str]:
        """Renew (or with ``now=None`` release) this owner's batches; those still its own."""
        if not ids:
            return set()
        with self.db.begin() as c:
            c.execute(update(batches).where(batches.c.id.in_(ids), batches.c.owner == owner)
                      .values(heartbeat_at=now))
            rows = c.execute(select(batches.c.id).where(batches.c.id.in_(ids), batches.c.owner == owner)).all()
        return {r[0] for r in rows}

    def items(self, batch_id: str, offset: int = 0, limit: int | None = None) -> list[ItemRow]:
        q = select(batch_items).where(batch_items.c.batch_id == batch_id, batch_items.c.idx >= offset)
        q = q.order_by(batch_items.c.idx)
        if limit is not None:
            q = q.where(batch_items.c.idx < offset + limit)
        with self.db.connect() as c:
            return [ItemRow(idx=r["idx"], state=r["state"], sandbox_id=r["sandbox_id"], error=r["error"],
                            reason=r["reason"]) for r in c.execute(q).mappings()]

    def recent(self, where: ColumnElement[bool] | None, job: str | None, limit: int) -> list[str]:
        """The newest batches' ids (``where``: the caller's projects), newest first."""
        q = select(batches.c.id).order_by(batches.c.created_at.desc()).limit(limit)
        if where is not None:
            q = q.where(where)
        if job is not None:
            q = q.where(batches.c.job == job)
        with self.db.connect() as c:
            return [r[0] for r in c.execute(q).all()]

    def failure_reasons(self, batch_id: str, limit: int = 10) -> dict[str, int]:
        """Why its failed items failed, the most common reasons first."""
        n = func.count()
        with self.db.connect() as c:
            rows = c.execute(select(func.coalesce(batch_items.c.reason, batch_items.c.error), n)
                             .where(batch_items.c.batch_id == batch_id, batch_items.c.state == "failed")
                             .group_by(func.coalesce(batch_items.c.reason, batch_items.c.error))
                             .order_by(n.desc()).limit(limit)).all()
        return {str(r or "unknown"): int(k) for r, k in rows}

    def counts(self, batch_id: str) -> dict[str, int]:
        with self.db.connect() as c:
            rows = c.execute(select(batch_items.c.state, func.count()).where(batch_items.c.batch_id == batch_id)
                             .group_by(batch_items.c.state)).all()
        return {str(s): int(n) for s, n in rows}

    def record(self, rows: list[dict[str, Any]], finished: list[tuple[str, str, float]]) -> None:
        """Item outcomes (each once: an item's outcome is final) and batches that ended, in one transaction."""
        with self.db.begin() as c:
            if rows:  # an outcome already written (by a process that took the batch over) stays
                c.execute(_insert_new(self.db.dialect.name), rows)
            for batch_id, state, at in finished:
                c.execute(update(batches).where(batches.c.id == batch_id).values(state=state, finished_at=at))


def _insert_new(dialect: str) -> Any:
    if dialect == "postgresql":
        return pg_insert(batch_items).on_conflict_do_nothing()
    return sqlite_insert(batch_items).on_conflict_do_nothing()
