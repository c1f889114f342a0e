"""Rollout records and journals in the metadata database (SQLite embedded, PostgreSQL in a
cluster). Every state change is a compare-and-set on the row (its state, worker and
attempt), so two workers, or a worker and a replica expiring its lease, never both win.
Blocking calls: the routes run them in a thread, or through :meth:`RolloutStore.run` (the
small ones a worker makes per step and per rollout)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from sqlalchemy import Engine, Integer, and_, bindparam, case, delete, exists, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, RowMapping
from sqlalchemy.exc import IntegrityError

from dsec.shared.errors import NotFound, RolloutLost
from dsec.shared.meta.jobs_schema import jobs
from dsec.shared.meta.rollouts_schema import rollout_steps, rollouts
from dsec.shared.wire.rollouts import (
    FINISHED,
    Claimed,
    FinishRequest,
    Held,
    RolloutCounts,
    RolloutInfo,
    RolloutSpec,
    Step,
)

T = TypeVar("T")
EXPIRE_BATCH = 200  # leases expired per claim call (the rest at the next one)


def new_id() -> str:
    return "ro-" + secrets.token_hex(8)


def _json(v: Any) -> str | None:
    return None if v is None else json.dumps(v, separators=(",", ":"))


def _text(v: str | None) -> str | None:
    """Text PostgreSQL takes (no NUL: a traceback may quote binary output)."""
    return None if v is None else v.replace("\x00", "\\0")


def _load(v: str | None) -> Any:
    return None if v is None else json.loads(v)


def _info(r: Mapping[Any, Any], spec: bool = False) -> RolloutInfo:
    out = RolloutInfo(
        id=r["id"], project=r["project"], key=r["key"], job=r["job"], agent=r["agent"], state=r["state"],
        attempts=r["attempts"], worker=r["worker"], sandbox_id=r["sandbox_id"], created_at=r["created_at"],
        started_at=r["started_at"], finished_at=r["finished_at"], consumed=bool(r["consumed"]), reward=r["reward"],
        result=_load(r["result"]), failure=r["failure"], error=r["error"], n_steps=r["n_steps"])
    if spec:
        s = RolloutSpec.model_validate_json(r["spec"])
        if s.inference is not None and s.inference.api_key:
            s = s.model_copy(update={"inference": s.inference.model_copy(update={"api_key": "***"})})
        out.spec = s
    return out


def _step(r: RowMapping) -> Step:
    return Step(seq=r["seq"], kind=r["kind"], request=_load(r["request"]), response=_load(r["response"]),
                digest=r["digest"], at=r["at"], attempt=r["attempt"])


_r, _s = rollouts.c, rollout_steps.c
# a journal write's statements, built once: the hold check (this worker, this attempt, still
# running) takes the row's lock and counts the step in one update
_seq = bindparam("seq", type_=Integer)
_STEP_HELD = (update(rollouts).where(_r.id == bindparam("rid"), _r.state == "running", _r.worker == bindparam("w"),
                                     _r.attempts == bindparam("att", type_=Integer))
              .values(n_steps=case((_r.n_steps <= _seq, _seq + 1), else_=_r.n_steps))
              .returning(_r.project))
_HOLDER = select(_r.project, _r.state, _r.worker, _r.attempts).where(_r.id == bindparam("rid"))
_STEP_AT = select(rollout_steps).where(_s.rollout_id == bindparam("rid"), _s.seq == _seq)


def _refuse(rollout_id: str, worker: str, attempt: int, r: Mapping[Any, Any] | None,
            covers: Callable[[str], bool], held: bool) -> None:
    """NotFound for no such rollout (or one the caller may not see), RolloutLost when
    ``worker`` does not hold this attempt of it (``r``: its row, or at least its project,
    state, worker and attempts)."""
    if r is None or not covers(r["project"]):
        raise NotFound(f"no rollout {rollout_id!r}", field="rollout_id")
    if not held:
        raise RolloutLost(f"rollout {rollout_id} is no longer held by {worker} (attempt {attempt}): it is "
                          f"{r['state']}, attempt {r['attempts']}, worker {r['worker']}", field="worker")


class RolloutStore:
    def __init__(self, db: Engine) -> None:
        self.db = db
        ins = pg_insert(rollout_steps) if db.dialect.name == "postgresql" else sqlite_insert(rollout_steps)
        self._step_insert = ins.on_conflict_do_nothing().returning(*rollout_steps.c)
        # SQLite has one writer: this store's writes take this lock, so one made in place on
        # the event loop never waits inside SQLite for another's transaction
        self._serial = threading.Lock() if db.dialect.name == "sqlite" else None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args)`` of this store from the event loop, for the calls that touch a row or
        two: in place on SQLite when no other write of this store is under way (~0.15 ms,
        where the hop to a thread and back waited for the GIL each way under load: the
        rollout service's journal writes took most of a turn), else on a thread; always on
        a thread for PostgreSQL (a network round trip). Shielded: a caller cancelled
        meanwhile does not leave it half known."""
        if self._serial is not None and self._serial.acquire(blocking=False):
            try:
                return fn(*args, **kwargs)
            finally:
                self._serial.release()
        return await self.on_thread(fn, *args, **kwargs)

    async def on_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args)`` on a thread, holding the store's write lock on SQLite, shielded."""
        return await asyncio.shield(asyncio.to_thread(self._serialized, fn, *args, **kwargs))

    def _serialized(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._serial or contextlib.nullcontext():
            return fn(*args, **kwargs)

    # --- the trainer's side ---

    def submit(self, project: str, specs: list[RolloutSpec]) -> tuple[list[RolloutInfo], int]:
        """Each spec as a queued rollout, or the existing one of its key. A race with another
        submit of the same key loses to it and answers its rollout."""
        for _ in range(3):
            try:
                return self._submit(project, specs)
            except IntegrityError:  # another submit took one of the keys first: look again
                continue
        return self._submit(project, specs)

    def _submit(self, project: str, specs: list[RolloutSpec]) -> tuple[list[RolloutInfo], int]:
        now = time.time()
        keys = [s.key for s in specs if s.key is not None]
        with self.db.begin() as c:
            existing: dict[str, Mapping[Any, Any]] = {}
            for i in range(0, len(keys), 500):
                for r in c.execute(select(rollouts).where(rollouts.c.project == project,
                                                          rollouts.c.key.in_(keys[i:i + 500]))).mappings():
                    existing[r["key"]] = r
            rows: list[dict[str, Any]] = []
            order: list[tuple[str, str | None]] = []  # ("new", id) or ("old", key)
            seen: dict[str, str] = {}
            for s in specs:
                if s.key is not None and s.key in existing:
                    order.append(("old", s.key))
                    continue
                if s.key is not None and s.key in seen:  # the same key twice in one call: one rollout
                    order.append(("new", seen[s.key]))
                    continue
                rid = new_id()
                if s.key is not None:
                    seen[s.key] = rid
                rows.append(dict(id=rid, project=project, key=s.key, job=s.job, agent=s.agent,
                                 spec=s.model_dump_json(), labels=json.dumps(s.labels), state="queued", attempts=0,
                                 max_attempts=s.max_attempts, created_at=now, consumed=False, n_steps=0))
                order.append(("new", rid))
            if rows:
                c.execute(insert(rollouts), rows)
        made = {r["id"]: r for r in rows}
        out: list[RolloutInfo] = []
        for kind, ref in order:
            assert ref is not None
            if kind == "old":
                out.append(_info(existing[ref]))
            else:
                m = made[ref]
                out.append(RolloutInfo(id=m["id"], project=project, key=m["key"], job=m["job"], agent=m["agent"],
                                       state="queued", created_at=now))
        return out, len(rows)

    def get(self, rollout_id: str, *, steps: bool = False, spec: bool = False) -> RolloutInfo | None:
        with self.db.connect() as c:
            r = c.execute(select(rollouts).where(rollouts.c.id == rollout_id)).mappings().first()
            if r is None:
                return None
            info = _info(r, spec)
            if steps:
                info.steps = self._steps(c, rollout_id)
        return info

    @staticmethod
    def _steps(c: Connection, rollout_id: str) -> list[Step]:
        q = select(rollout_steps).where(rollout_steps.c.rollout_id == rollout_id).order_by(rollout_steps.c.seq)
        return [_step(s) for s in c.execute(q).mappings()]

    def list(self, project: str | None, *, job: str | None = None, states: Iterable[str] = (),
             consumed: bool | None = None, labels: dict[str, str] | None = None, after: str | None = None,
             limit: int = 1000, finished_since: float | None = None) -> builtins.list[RolloutInfo]:
        """In creation order, ``after`` (an id) paging on from it; or with ``finished_since``,
        those finished since then, in the order they finished."""
        q = select(rollouts)
        if project is not None:
            q = q.where(rollouts.c.project == project)
        if job is not None:
            q = q.where(rollouts.c.job == job)
        states = list(states)
        if states:
            q = q.where(rollouts.c.state.in_(states))
        if consumed is not None:
            q = q.where(rollouts.c.consumed == consumed)
        with self.db.connect() as c:
            if after is not None:
                at = c.execute(select(rollouts.c.created_at).where(rollouts.c.id == after)).scalar()
                if at is not None:
                    q = q.where((rollouts.c.created_at > at) | and_(rollouts.c.created_at == at, rollouts.c.id > after))
            if finished_since is not None:
                q = q.where(rollouts.c.finished_at >= finished_since).order_by(rollouts.c.finished_at, rollouts.c.id)
            else:
                q = q.order_by(rollouts.c.created_at, rollouts.c.id)
            if not labels:
                return [_info(r) for r in c.execute(q.limit(limit)).mappings()]
            # labels are JSON: matched here, row by row as they stream, up to ``limit``
            items: builtins.list[RolloutInfo] = []
            for r in c.execution_options(yield_per=1000).execute(q).mappings():
                have = json.loads(r["labels"] or "{}")
                if all(have.get(k) == v for k, v in labels.items()):
                    items.append(_info(r))
                    if len(items) >= limit:
                        break
        return items

    def counts(self, project: str | None, job: str | None) -> RolloutCounts:
        q = select(rollouts.c.state, rollouts.c.consumed, func.count()).group_by(rollouts.c.state,
                                                                                  rollouts.c.consumed)
        if project is not None:
            q = q.where(rollouts.c.project == project)
        if job is not None:
            q = q.where(rollouts.c.job == job)
        out = RolloutCounts()
        with self.db.connect() as c:
            for state, consumed, n in c.execute(q).all():
                setattr(out, state, getattr(out, state) + int(n))
                if state in FINISHED and not consumed:
                    out.unconsumed += int(n)
        return out

    def ack(self, project: str | None, ids: builtins.list[str]) -> int:
        """Finished rollouts marked consumed (a trainer took them into a step)."""
        n = 0
        with self.db.begin() as c:
            for i in range(0, len(ids), 500):
                q = update(rollouts).where(rollouts.c.id.in_(ids[i:i + 500]), rollouts.c.state.in_(FINISHED))
                if project is not None:
                    q = q.where(rollouts.c.project == project)
                n += c.execute(q.values(consumed=True)).rowcount
        return n

    def cancel(self, rollout_id: str, reason: str) -> RolloutInfo | None:
        """A queued or running rollout cancelled (its worker hears it at its next heartbeat)."""
        with self.db.begin() as c:
            c.execute(update(rollouts).where(rollouts.c.id == rollout_id, rollouts.c.state.in_(("queued", "running")))
                      .values(state="cancelled", finished_at=time.time(), error=reason, lease_until=None))
        return self.get(rollout_id)

    # --- the workers' side ---

    def expire(self, project: str | None, now: float) -> builtins.list[RolloutInfo]:
        """Running rollouts (of ``project``; None: all) whose worker's lease ran out: queued
        again (the next worker replays the journal), or failed as infra once their attempts
        are used up. Returns the failed."""
        failed: builtins.list[RolloutInfo] = []
        q = select(rollouts).where(rollouts.c.state == "running", rollouts.c.lease_until < now)
        if project is not None:
            q = q.where(rollouts.c.project == project)
        with self.db.begin() as c:
            rows = c.execute(q.limit(EXPIRE_BATCH)).mappings().all()
            for r in rows:
                cas = update(rollouts).where(rollouts.c.id == r["id"], rollouts.c.state == "running",
                                             rollouts.c.lease_until == r["lease_until"])
                if r["attempts"] >= r["max_attempts"]:
                    err = (f"its worker {r['worker']} was lost (no heartbeat) on attempt {r['attempts']} of "
                           f"{r['max_attempts']}")
                    if c.execute(cas.values(state="failed", failure="infra", error=err, finished_at=now,
                                            lease_until=None)).rowcount:
                        failed.append(_info({**r, "state": "failed", "failure": "infra", "error": err}))
                else:
                    c.execute(cas.values(state="queued", worker=None, lease_until=None))
        return failed

    def cancel_stopped_jobs(self, project: str | None, now: float) -> builtins.list[str]:
        """Rollouts (of ``project``; None: all) of a job that was stopped: nobody will collect them."""
        stopped = exists().where(jobs.c.project == rollouts.c.project, jobs.c.name == rollouts.c.job,
                                 jobs.c.state == "stopped")
        q = select(rollouts.c.id).where(rollouts.c.state.in_(("queued", "running")), rollouts.c.job.is_not(None),
                                        stopped)
        if project is not None:
            q = q.where(rollouts.c.project == project)
        with self.db.begin() as c:
            ids = [r[0] for r in c.execute(q.limit(EXPIRE_BATCH)).all()]
            if ids:
                c.execute(update(rollouts).where(rollouts.c.id.in_(ids), rollouts.c.state.in_(("queued", "running")))
                          .values(state="cancelled", finished_at=now, error="its job was stopped", lease_until=None))
        return ids

    def claim(self, project: str | None, worker: str, n: int, lease_s: float, now: float) -> builtins.list[Claimed]:
        """Up to ``n`` queued rollouts (oldest first; none of a paused job) given to ``worker``."""
        if n <= 0:
            return []
        paused = exists().where(jobs.c.project == rollouts.c.project, jobs.c.name == rollouts.c.job,
                                jobs.c.state != "active")
        q = select(rollouts).where(rollouts.c.state == "queued", ~paused)
        if project is not None:
            q = q.where(rollouts.c.project == project)
        q = q.order_by(rollouts.c.created_at, rollouts.c.id).limit(n * 2)
        if self.db.dialect.name == "postgresql":  # concurrent claims take different rows, not each other's
            q = q.with_for_update(skip_locked=True)
        out: builtins.list[Claimed] = []
        with self.db.begin() as c:
            for r in c.execute(q).mappings().all():
                if len(out) >= n:
                    break
                attempt = r["attempts"] + 1
                got = c.execute(update(rollouts).where(rollouts.c.id == r["id"], rollouts.c.state == "queued",
                                                       rollouts.c.attempts == r["attempts"])
                                .values(state="running", worker=worker, lease_until=now + lease_s, attempts=attempt,
                                        started_at=func.coalesce(rollouts.c.started_at, now))).rowcount
                if not got:
                    continue
                info = _info({**r, "state": "running", "worker": worker, "attempts": attempt,
                              "started_at": r["started_at"] or now})
                out.append(Claimed(rollout=info, spec=RolloutSpec.model_validate_json(r["spec"]), steps=[],
                                   attempt=attempt))
        if out:  # the journals are read after the claim's commit: its locks are not held meanwhile
            with self.db.connect() as c:
                for cl in out:
                    cl.steps = self._steps(c, cl.rollout.id)
        return out

    def heartbeat(self, project: str | None, worker: str, ids: builtins.list[str], lease_s: float, now: float
                  ) -> builtins.list[Held]:
        """Leases renewed; each id's standing (another project's ids are as unknown as missing ones)."""
        if not ids:
            return []
        mine = rollouts.c.id.in_(ids) if project is None else and_(rollouts.c.id.in_(ids),
                                                                   rollouts.c.project == project)
        job_state = select(jobs.c.state).where(jobs.c.project == rollouts.c.project,
                                               jobs.c.name == rollouts.c.job).scalar_subquery()
        with self.db.begin() as c:
            c.execute(update(rollouts).where(mine, rollouts.c.worker == worker,
                                             rollouts.c.state == "running").values(lease_until=now + lease_s))
            rows = c.execute(select(rollouts.c.id, rollouts.c.worker, rollouts.c.state, job_state.label("job_state"))
                             .where(mine)).all()
        got = {r[0]: r for r in rows}
        out = []
        for i in ids:
            r = got.get(i)
            owned = r is not None and r[1] == worker and r[2] == "running"
            out.append(Held(id=i, owned=owned, state=r[2] if r is not None else None,
                            hold=bool(r is not None and r[3] == "paused")))
        return out

    def _owner(self, c: Connection, rollout_id: str, worker: str, attempt: int,
               covers: Callable[[str], bool] = lambda _p: True) -> RowMapping:
        """The row, if ``worker`` still holds this attempt, locked for the transaction: a no-op
        compare-and-set update first (it takes the row's lock on PostgreSQL and the write lock
        on SQLite), so a lease expiring meanwhile cannot slip between the check and the write.
        NotFound when there is no such rollout or ``covers(project)`` says the caller may not
        see it (the transaction then writes nothing)."""
        held = c.execute(update(rollouts).where(rollouts.c.id == rollout_id, rollouts.c.state == "running",
                                                rollouts.c.worker == worker, rollouts.c.attempts == attempt)
                         .values(worker=worker)).rowcount
        r = c.execute(select(rollouts).where(rollouts.c.id == rollout_id)).mappings().first()
        _refuse(rollout_id, worker, attempt, r, covers, held=bool(held))
        assert r is not None
        return r

    def check_held(self, rollout_id: str, worker: str, attempt: int, covers: Callable[[str], bool]) -> None:
        """NotFound or RolloutLost unless ``worker`` holds this attempt now (a read: the
        write that follows checks again)."""
        with self.db.connect() as c:
            r = c.execute(_HOLDER, {"rid": rollout_id}).mappings().first()
        held = r is not None and (r["state"], r["worker"], r["attempts"]) == ("running", worker, attempt)
        _refuse(rollout_id, worker, attempt, r, covers, held)

    def add_step(self, rollout_id: str, worker: str, attempt: int, step: Step,
                 covers: Callable[[str], bool] = lambda _p: True) -> Step:
        """The step journaled, unless one is there at its seq already (that one is answered:
        the first write wins). ``covers(project)``: whether the caller may see the rollout
        (else NotFound, and nothing is written). Two statements in the usual case: the
        hold check that also counts the step, and the insert."""
        row = dict(rollout_id=rollout_id, seq=step.seq, kind=step.kind, request=_json(step.request),
                   response=_json(step.response), digest=step.digest, at=step.at or time.time(), attempt=attempt)
        with self.db.begin() as c:
            project = c.execute(_STEP_HELD, {"rid": rollout_id, "w": worker, "att": attempt,
                                             "seq": step.seq}).scalar()
            if project is None or not covers(project):
                self._owner(c, rollout_id, worker, attempt, covers)  # raises NotFound or RolloutLost, saying why
                c.execute(_STEP_HELD, {"rid": rollout_id, "w": worker, "att": attempt, "seq": step.seq})
            got = c.execute(self._step_insert, row).mappings().first()
            if got is None:  # a step was at this seq already
                got = c.execute(_STEP_AT, {"rid": rollout_id, "seq": step.seq}).mappings().one()
        return _step(got)

    def set_sandbox(self, rollout_id: str, worker: str, attempt: int, sandbox_id: str,
                    covers: Callable[[str], bool] = lambda _p: True) -> None:
        with self.db.begin() as c:
            self._owner(c, rollout_id, worker, attempt, covers)
            c.execute(update(rollouts).where(rollouts.c.id == rollout_id).values(sandbox_id=sandbox_id))

    def finish(self, rollout_id: str, req: FinishRequest, covers: Callable[[str], bool] = lambda _p: True
               ) -> RolloutInfo:
        now = time.time()
        with self.db.begin() as c:
            r = self._owner(c, rollout_id, req.worker, req.attempt, covers)
            if req.release:
                c.execute(update(rollouts).where(rollouts.c.id == rollout_id).values(
                    state="queued", worker=None, lease_until=None, attempts=rollouts.c.attempts - 1))
            elif req.requeue and req.failure == "infra" and r["attempts"] < r["max_attempts"]:
                values: dict[str, Any] = dict(state="queued", worker=None, lease_until=None, error=_text(req.error))
                if req.reset:  # its sandbox is gone with the state the journal described: start over
                    c.execute(delete(rollout_steps).where(rollout_steps.c.rollout_id == rollout_id))
                    values.update(sandbox_id=None, n_steps=0)
                c.execute(update(rollouts).where(rollouts.c.id == rollout_id).values(**values))
            else:
                c.execute(update(rollouts).where(rollouts.c.id == rollout_id).values(
                    state=req.state, finished_at=now, lease_until=None, result=_json(req.result), reward=req.reward,
                    failure=req.failure, error=_text(req.error)))
        info = self.get(rollout_id)
        assert info is not None
        return info
