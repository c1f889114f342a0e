"""The apiserver's batch queue: a batch's items are made through ``Apiserver.create`` (so a
job's quota is checked per item) by a dispatcher that keeps at most ``per_edge_starting``
creates starting per edge (the edge's semaphore in ``Apiserver._place``) and takes items
round-robin across jobs, then across a job's batches, so one job's 10K burst never starves
another's batch. A plain ``POST /v1/sandboxes`` does not go through this queue at all: it
never waits behind a batch.

Every item's outcome is written to the metadata database (a flusher batches the writes),
and the batch row names the apiserver process running it, with a heartbeat. A batch whose
owner released it (a clean shutdown) or has not been heard of for ``STALE_S`` (a crash) is
taken over by the first apiserver that sees it (a compare-and-set on the heartbeat, so one
does): items with an outcome keep it, a sandbox carrying the label
``dsec.batch=<id>/<index>`` (made before the crash, outcome not yet written) is taken as that
item's, and only the rest are made, so none is made twice. A process that finds its batch
taken over (its heartbeat was late) drops it. Any replica answers a batch's progress from
the database."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import secrets
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import TypeAdapter
from sqlalchemy.exc import SQLAlchemyError

from dsec.control.batches.store import BatchRow, BatchStore
from dsec.control.iam import PROJECT_LABEL
from dsec.control.iam.bound import TOKEN_LABEL, on_behalf_of
from dsec.shared.errors import DsecError, MetadataUnavailable, NotFound, QuotaExceeded, RateLimited
from dsec.shared.meta.db import unavailable
from dsec.shared.wire.batches import (
    BATCH_LABEL,
    MAX_BATCH,
    BatchAdmission,
    BatchCounts,
    BatchInfo,
    BatchItem,
    BatchRequest,
)
from dsec.shared.wire.models import AnySandboxArgs, CreateRequest, SandboxInfo, SandboxState

if TYPE_CHECKING:
    from dsec.control.iam.quota import ProjectQuotas
    from dsec.control.placement.engine import Placement, Plan
    from dsec.node.edge.api import EdgeAPI

log = logging.getLogger("dsec.batches")
FLUSH_S = 0.25
HEARTBEAT_S = 1.0
STALE_S = 5.0  # an owner not heard of for this long has crashed: its batches are taken over
STARTING_RETRY_S = 0.1  # an item waiting for its project's creates in flight to go below the cap
STARTING_WAIT_S = 900.0  # ... at most this long (a stale hold goes after as long: dsec.control.iam.quota)
KEEP_FINISHED = 64  # finished batches kept in memory (older ones are answered from the database)
# ... and in the database this long (their items' rows too: what a tenant's batches can grow it by)
KEEP_FINISHED_S = float(os.environ.get("DSEC_BATCH_KEEP_S", 24 * 3600))
PRUNE_EVERY_S = 60.0
MAX_PENDING_ITEMS = 4 * MAX_BATCH  # items of one project's running batches, all replicas
MAX_STARTING = int(os.environ.get("DSEC_BATCH_STARTING_PER_REPLICA", "64"))
_ARGS: TypeAdapter[Any] = TypeAdapter(AnySandboxArgs)
LIVE = (SandboxState.creating, SandboxState.running, SandboxState.paused)


class BatchHost(Protocol):
    """What the runner needs of the apiserver it runs in (``dsec.control.apiserver.core.Apiserver``):
    its creates, stops and listing, the gang reservation, and the counts of creates
    starting per edge that bound a batch's share."""

    edges: Mapping[str, EdgeAPI]
    placement: Placement
    quotas: ProjectQuotas
    starting: Counter[str]
    peak_starting: Counter[str]

    async def create(self, req: CreateRequest, bounded: bool = False, hold: str | None = None,
                     plan: Plan | None = None) -> SandboxInfo: ...
    async def reserve_gang(self, args: AnySandboxArgs, n: int, batch_id: str) -> Plan: ...
    async def list(self, job: str | None, labels: dict[str, str], usage: bool = False) -> list[SandboxInfo]: ...
    def edge_for(self, sandbox_id: str) -> EdgeAPI: ...
    async def stop(self, sandbox_id: str) -> SandboxInfo: ...


@dataclass
class _Batch:
    id: str
    project: str
    job: str | None
    n: int
    args: Any
    created_at: float
    state: str = "running"
    finished_at: float | None = None
    states: list[str] = field(default_factory=list)
    sandbox: dict[int, str] = field(default_factory=dict)
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    queue: deque[int] = field(default_factory=deque)
    counts: Counter[str] = field(default_factory=Counter)
    stop_made: bool = False
    # backpressure (its job's creation rate, its project's cap of creates starting at once):
    # no item is dispatched before this (monotonic), and none holds a slot meanwhile
    not_before: float = 0.0
    waiting_since: float | None = None
    lost: bool = False  # taken over by another apiserver: its outcomes are that one's to finish
    gang: bool = False  # all or nothing: each item starts a reserved hold "<id>/<i>" (dsec.control.iam.quota)
    plan: Plan | None = None  # the edge room the gang holds on this replica (none once taken over)
    reason: str | None = None  # why a gang failed

    def set(self, i: int, state: str) -> None:
        self.counts[self.states[i]] -= 1
        self.states[i] = state
        self.counts[state] += 1

    def info(self, offset: int, limit: int) -> BatchInfo:
        items = [BatchItem(index=i, state=self.states[i], sandbox_id=self.sandbox.get(i),  # type: ignore[arg-type]
                           error=self.errors.get(i, (None, None))[0], reason=self.errors.get(i, (None, None))[1])
                 for i in range(offset, min(self.n, offset + limit))]
        nxt = offset + limit if offset + limit < self.n and limit > 0 else None
        return BatchInfo(id=self.id, project=self.project, job=self.job, n=self.n, state=self.state,  # type: ignore[arg-type]
                         counts=BatchCounts(**{k: v for k, v in self.counts.items() if v}),
                         created_at=self.created_at, finished_at=self.finished_at, items=items, next_offset=nxt,
                         all_or_nothing=self.gang, reason=self.reason)


class BatchRunner:
    def __init__(self, api: BatchHost, store: BatchStore, per_edge_starting: int = 8) -> None:
        self.api = api
        self.store = store
        self.per_edge_starting = per_edge_starting
        self.batches: dict[str, _Batch] = {}
        self.lanes: OrderedDict[tuple[str, str], deque[str]] = OrderedDict()  # (project, job) -> its batches
        self.active = 0
        self._wake = asyncio.Event()
        self._rows: list[dict[str, Any]] = []
        self._finished: list[tuple[str, str, float]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.Task[None] | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._reclaimer: asyncio.Task[None] | None = None
        self.owner = secrets.token_hex(8)

    @property
    def slots(self) -> int:
        """Items starting at once on this replica: 8 per edge, at most MAX_STARTING. Per edge
        alone, a replica in front of 160 edges started 1280 creates at once: its own loop and
        database connections were the queue, and the edges' answers to the fleet view's polls
        (one event loop of a hollow fleet, bench/scale.py) came too late."""
        return min(self.per_edge_starting * max(1, len(self.api.edges)), MAX_STARTING)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.create_task(self._dispatch(), context=contextvars.Context())
        self._flusher = asyncio.create_task(self._flush_forever(), context=contextvars.Context())
        self._reclaimer = asyncio.create_task(self._reclaim_forever(), context=contextvars.Context())

    async def close(self) -> None:
        for t in (self._loop, self._flusher, self._reclaimer, *self._tasks):
            if t is not None:
                t.cancel()
        await self._flush()  # what is known so far; the rest is found by label when it is taken over
        try:  # released: the next apiserver takes them over at once
            await asyncio.to_thread(self.store.heartbeat, self.owner, self._running(), None)
        except Exception as e:
            log.warning("batches not released (taken over in %.0f s): %s", STALE_S, e)

    def _running(self) -> list[str]:
        return [b.id for b in self.batches.values() if b.finished_at is None]

    async def _reclaim_forever(self) -> None:
        pruned_at = 0.0
        while True:
            try:
                await self._reclaim()
                if time.monotonic() - pruned_at > PRUNE_EVERY_S:  # (every replica: the deletes agree)
                    pruned_at = time.monotonic()
                    if n := await asyncio.to_thread(self.store.prune, time.time() - KEEP_FINISHED_S):
                        log.info("forgot %d batches finished over %.0f h ago", n, KEEP_FINISHED_S / 3600)
            except Exception as e:  # the database may be back next time
                log.warning("orphaned batches not looked for: %s", e)
            await asyncio.sleep(HEARTBEAT_S)

    async def _reclaim(self) -> None:
        now = time.time()
        rows = [r for r in await asyncio.to_thread(self.store.orphans, now - STALE_S) if r.id not in self.batches]
        claimed = [r for r in rows if await asyncio.to_thread(self.store.claim, r, self.owner, now)]
        if not claimed:
            return
        listed = await self.api.list(None, {})
        for row in claimed:
            b = _Batch(id=row.id, project=row.project, job=row.job, n=row.n, args=_ARGS.validate_json(row.args),
                       created_at=row.created_at, states=["queued"] * row.n, gang=row.gang)
            b.counts["queued"] = row.n
            done = {r.idx: r for r in await asyncio.to_thread(self.store.items, row.id)}
            for r in done.values():
                b.set(r.idx, r.state)
                if r.sandbox_id:
                    b.sandbox[r.idx] = r.sandbox_id
                if r.error:
                    b.errors[r.idx] = (r.error, r.reason or "")
            for s in listed:  # made before the crash, its outcome not written: it is that item's
                bid, _, idx = s.labels.get(BATCH_LABEL, "").partition("/")
                if (bid == row.id and s.labels.get(PROJECT_LABEL, "default") == row.project
                        and idx.isdigit() and int(idx) < row.n and int(idx) not in done
                        and s.state in LIVE and b.states[int(idx)] == "queued"):
                    self._outcome(b, int(idx), "running", s.sandbox_id)
            b.queue.extend(i for i in range(row.n) if b.states[i] == "queued")
            log.warning("batch %s taken over: %d of %d items still to make", b.id, len(b.queue), b.n)
            self._add(b)
            self._maybe_finish(b)

    # -- the API's calls --------------------------------------------------------------------

    async def submit(self, req: BatchRequest, project: str) -> BatchInfo:
        """Accept a batch; an all-or-nothing one only once its quota and edge room are held
        (``Apiserver.reserve_gang``), else its shortfall is raised and nothing is made."""
        job = req.job or req.args.job
        args = req.args.model_copy(update={"job": job})
        b = _Batch(id="b-" + secrets.token_hex(8), project=project, job=job, n=req.n, args=args,
                   created_at=time.time(), states=["queued"] * req.n, queue=deque(range(req.n)),
                   gang=req.all_or_nothing)
        b.counts["queued"] = req.n
        pending = await asyncio.to_thread(self.store.pending_items, project)
        if pending + req.n > MAX_PENDING_ITEMS:
            raise QuotaExceeded(f"project {project!r} has {pending} items in running batches; at most "
                                f"{MAX_PENDING_ITEMS} at once: wait for some to finish, or cancel some",
                                field="n")
        if b.gang:
            b.plan = await self.api.reserve_gang(args, req.n, b.id)
        try:
            await asyncio.to_thread(self.store.create, BatchRow(
                id=b.id, project=project, job=job, n=req.n, args=_ARGS.dump_json(args).decode(), state="running",
                created_at=b.created_at, finished_at=None, owner=self.owner, heartbeat_at=b.created_at, gang=b.gang))
        except BaseException:
            if b.gang:
                await self._let_go(b)
            raise
        self._add(b)
        return b.info(0, 0)

    async def get(self, batch_id: str, offset: int = 0, limit: int = 1000) -> BatchInfo:
        b = self.batches.get(batch_id)
        if b is not None:
            return b.info(offset, limit)
        row = await asyncio.to_thread(self.store.get, batch_id)
        if row is None:
            raise NotFound(f"no batch {batch_id!r}", field="batch_id")
        counts = await asyncio.to_thread(self.store.counts, batch_id)
        known = {r.idx: r for r in await asyncio.to_thread(self.store.items, batch_id, offset, limit)}
        pending = "queued" if row.state == "running" else "cancelled"
        counts[pending] = counts.get(pending, 0) + row.n - sum(counts.values())
        items = [BatchItem(index=i, state=known[i].state if i in known else pending,  # type: ignore[arg-type]
                           sandbox_id=known[i].sandbox_id if i in known else None,
                           error=known[i].error if i in known else None, reason=known[i].reason if i in known else None)
                 for i in range(offset, min(row.n, offset + limit))]
        return BatchInfo(id=row.id, project=row.project, job=row.job, n=row.n, state=row.state,  # type: ignore[arg-type]
                         counts=BatchCounts(**{k: v for k, v in counts.items() if v}), created_at=row.created_at,
                         finished_at=row.finished_at, items=items, all_or_nothing=row.gang,
                         reason="an item was not made; the batch is all or nothing" if row.state == "failed" else None,
                         next_offset=offset + limit if 0 < limit and offset + limit < row.n else None)

    async def cancel(self, batch_id: str, stop: bool) -> BatchInfo:
        """Queued items are cancelled; made ones stay, or with ``stop`` are stopped (and so are
        the ones starting now, once made)."""
        b = self.batches.get(batch_id)
        if b is None:
            await self.get(batch_id)  # 404 if unknown
            raise NotFound(f"batch {batch_id!r} is not run by this apiserver replica (or has ended)",
                           field="batch_id")
        while b.queue:
            self._outcome(b, b.queue.popleft(), "cancelled", None, ("cancelled", "the batch was cancelled"))
        if b.state == "running":
            b.state = "cancelled"
        if b.gang:
            await self._let_go(b)
        if stop:
            b.stop_made = True
            await asyncio.gather(*(self._stop(sid) for sid in list(b.sandbox.values())), return_exceptions=True)
        self._maybe_finish(b)
        return b.info(0, 0)

    async def _let_go(self, b: _Batch) -> None:
        """A gang needs no more of what it holds for items not started: its edge room here
        and its reserved quota (the sweep frees the quota should this fail)."""
        if b.plan is not None:
            self.api.placement.release(b.plan)
        try:
            await self.api.quotas.run(self.api.quotas.release_reserved, b.id)
        except Exception as e:
            log.warning("batch %s's reserved quota not released (the sweep will): %s", b.id, e)

    async def _fail_gang(self, b: _Batch, i: int, error: tuple[str, str]) -> None:
        """An item of an all-or-nothing batch was not made: the batch fails, nothing more is
        made, and what it made (or is making) is stopped."""
        if b.state != "running":
            return
        b.state = "failed"
        b.reason = f"item {i} was not made ({error[0]}: {error[1]}); the batch is all or nothing"
        log.warning("batch %s failed: %s", b.id, b.reason)
        while b.queue:
            self._outcome(b, b.queue.popleft(), "cancelled", None, ("cancelled", b.reason))
        b.stop_made = True
        await self._let_go(b)
        await asyncio.gather(*(self._stop(sid) for sid in list(b.sandbox.values())), return_exceptions=True)

    def admission(self, sees: Callable[[str], bool] = lambda _: True) -> BatchAdmission:
        """The queue as it stands; ``queued`` counts the items of the projects ``sees`` (a
        project token's caller: its own subtree's, never another project's backlog). The
        creates starting per edge are the node's, whoever made them."""
        return BatchAdmission(per_edge_starting=self.per_edge_starting, starting=dict(self.api.starting),
                              peak_starting=dict(self.api.peak_starting),
                              queued=sum(len(b.queue) for b in list(self.batches.values()) if sees(b.project)))

    def owns(self, batch_id: str) -> _Batch | None:
        return self.batches.get(batch_id)

    # -- the queue --------------------------------------------------------------------------

    def _add(self, b: _Batch) -> None:
        self.batches[b.id] = b
        if b.queue:
            self.lanes.setdefault((b.project, b.job or ""), deque()).append(b.id)
        self._wake.set()
        done = [x for x in self.batches.values() if x.finished_at is not None]
        for old in done[:max(0, len(done) - KEEP_FINISHED)]:
            del self.batches[old.id]

    def _next(self) -> tuple[_Batch, int] | None:
        """Round-robin: the next job's lane, the next batch of that job."""
        for _ in range(len(self.lanes)):
            key, lane = next(iter(self.lanes.items()))
            self.lanes.move_to_end(key)
            for _ in range(len(lane)):
                b = self.batches.get(lane[0])
                if b is None or not b.queue:
                    lane.popleft()
                    continue
                lane.rotate(-1)
                if b.not_before <= time.monotonic():  # (a batch held back keeps its place, no slot)
                    return b, b.queue.popleft()
            if not lane:
                del self.lanes[key]
        return None

    async def _dispatch(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.active < self.slots:
                nxt = self._next()
                if nxt is None:
                    break
                b, i = nxt
                b.set(i, "starting")
                self.active += 1
                t = asyncio.create_task(self._make(b, i))
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

    async def _make(self, b: _Batch, i: int) -> None:
        args = b.args.model_copy(update={"labels": {**b.args.labels, BATCH_LABEL: f"{b.id}/{i}"}})
        # bound to its submitter's token (set on its args when it was accepted), not the runner's;
        # this task's own context, so nothing else sees it
        on_behalf_of.set(b.args.labels.get(TOKEN_LABEL))
        try:
            try:
                info = await self.api.create(CreateRequest(args=args), bounded=True,
                                             hold=f"{b.id}/{i}" if b.gang else None, plan=b.plan)
            except SQLAlchemyError as e:  # the database away: the typed 503 a request would get
                away = unavailable(e)
                if away is None:
                    raise
                raise away from e
            b.waiting_since = None
        except (RateLimited, QuotaExceeded, MetadataUnavailable) as e:
            if not self._held_back(b, i, e):
                self._outcome(b, i, "failed", None, (e.code, e.message))
                if b.gang:
                    await self._fail_gang(b, i, (e.code, e.message))
        except DsecError as e:
            self._outcome(b, i, "failed", None, (e.code, e.message))
            if b.gang:
                await self._fail_gang(b, i, (e.code, e.message))
        except Exception as e:  # noqa: BLE001 - an item's failure is reported, never the batch's
            log.exception("batch %s item %d failed", b.id, i)
            self._outcome(b, i, "failed", None, ("internal", str(e) or type(e).__name__))
            if b.gang:
                await self._fail_gang(b, i, ("internal", str(e) or type(e).__name__))
        else:
            self._outcome(b, i, "running", info.sandbox_id)
            if b.stop_made:
                await self._stop(info.sandbox_id)
        finally:
            self.active -= 1
            self._wake.set()
            self._maybe_finish(b)

    def _held_back(self, b: _Batch, i: int, e: RateLimited | QuotaExceeded | MetadataUnavailable) -> bool:
        """Backpressure is not a refusal: an item refused by its job's creation rate (until
        its next token), by its project's cap of creates starting at once (a cap of 0
        refuses) or by a database that did not answer (a restart: a second later) goes back to
        the head of its batch's queue, and the batch dispatches nothing before then: it holds
        none of the replica's slots meanwhile, so one tenant's throttled batches never hold
        up another's, and a database's blip does not fail a thousand items. At most
        ``STARTING_WAIT_S`` of it per batch."""
        if isinstance(e, MetadataUnavailable):
            delay = 1.0
        elif isinstance(e, RateLimited):
            delay = min(max(e.retry_after, 0.01), 60.0)
        elif e.field == "quota.starting" and e.limit:
            delay = STARTING_RETRY_S
        else:
            return False
        now = time.monotonic()
        if b.state != "running" or now - (b.waiting_since or now) > STARTING_WAIT_S:
            return False
        b.waiting_since = b.waiting_since or now
        b.set(i, "queued")
        b.queue.appendleft(i)
        lane = self.lanes.setdefault((b.project, b.job or ""), deque())
        if b.id not in lane:
            lane.append(b.id)
        b.not_before = max(b.not_before, now + delay)
        asyncio.get_running_loop().call_later(delay, self._wake.set)
        return True

    async def _stop(self, sandbox_id: str) -> None:
        try:
            await self.api.stop(sandbox_id)
        except DsecError as e:
            log.warning("batch sandbox %s not stopped: %s", sandbox_id, e)

    def _outcome(self, b: _Batch, i: int, state: str, sandbox_id: str | None,
                 error: tuple[str, str] | None = None) -> None:
        b.set(i, state)
        if sandbox_id:
            b.sandbox[i] = sandbox_id
        if error:
            b.errors[i] = error
        self._rows.append({"batch_id": b.id, "idx": i, "state": state, "sandbox_id": sandbox_id,
                           "error": error[0] if error else None, "reason": error[1] if error else None})

    def _maybe_finish(self, b: _Batch) -> None:
        if not b.lost and b.finished_at is None and not b.queue and not b.counts["starting"] and not b.counts["queued"]:
            b.finished_at = time.time()
            if b.state == "running":
                b.state = "done"
            self._finished.append((b.id, b.state, b.finished_at))
            if b.plan is not None and b.plan.left:  # (every item took its room: normally nothing)
                self.api.placement.release(b.plan)

    async def _flush(self) -> None:
        rows, self._rows = self._rows, []
        finished, self._finished = self._finished, []
        if rows or finished:
            try:
                await asyncio.to_thread(self.store.record, rows, finished)
            except Exception as e:  # kept for the next flush
                log.warning("batch outcomes not written (will retry): %s", e)
                self._rows[:0], self._finished[:0] = rows, finished

    async def _flush_forever(self) -> None:
        beat = 0.0
        while True:
            await asyncio.sleep(FLUSH_S)
            await self._flush()
            if time.monotonic() - beat >= HEARTBEAT_S:
                beat = time.monotonic()
                await self._heartbeat()

    async def _heartbeat(self) -> None:
        ids = self._running()
        try:
            mine = await asyncio.to_thread(self.store.heartbeat, self.owner, ids, time.time())
        except Exception as e:  # late: after STALE_S another apiserver may take them over
            log.warning("batch heartbeat not written: %s", e)
            return
        for lost in set(ids) - mine:  # another apiserver took it over: it makes the rest
            b = self.batches.pop(lost)
            b.lost = True
            log.warning("batch %s was taken over by another apiserver: %d queued items left to it", lost, len(b.queue))
            b.queue.clear()
