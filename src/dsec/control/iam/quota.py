"""Admission against the project tree's quotas, exact across apiserver replicas.

Every admitted create holds its share in the metadata database: a ``project_holds`` row,
and the same amounts added to the ``u_*`` counters of the project and each ancestor, in
one transaction. Each counter moves by a conditional UPDATE (``... WHERE u + need <= q``),
root first, so two replicas racing for the last unit serialize on the row: PostgreSQL
re-checks the condition against the committed row after the lock wait, SQLite has one
writer at a time. Whoever comes second matches no row and is refused with the project and
the resource; nothing is left half-charged because the transaction rolls back.

A hold is ``starting`` until the edge made the sandbox (then ``running``; the ``starting``
quota counts these), and goes when the sandbox is stopped through any replica. What the
apiserver does not see, the sweep (:meth:`ProjectQuotas.reconcile`) takes from the edges,
which are the truth of what runs: sandboxes that ended on their own (TTL, crash, a lost
node) free their share, ones made without a hold (a response lost in flight, a database
restored from backup) are adopted, and a paused sandbox's CPU is not counted while it is
paused. Blocking calls: the apiserver runs them in a thread.

A gang (a batch created all or nothing) holds all its sandboxes' shares at once: one
transaction charges n times the need and writes n ``reserved`` holds, ids
``<batch id>/<index>``, or refuses naming the shortfall. A reserved hold counts against
every resource but the creates starting at once; its item's create turns it ``starting``
(taking one of those, :meth:`ProjectQuotas.start`) and then ``running`` as any other. What
the batch no longer needs (its end, a cancel) is released at once, and the sweep releases
the reserved holds of a batch that is no longer running.

On PostgreSQL a replica admits most creates from a block of quota charged to it ahead
(dsec.control.iam.blocks): such a create has no hold until its bind, which writes the hold and moves
its amounts from the block's row to it (the counters do not change).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, Executable, Update, and_, bindparam, delete, insert, or_, select, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.sql.elements import ColumnElement

from dsec.shared.errors import NotFound, QuotaExceeded
from dsec.shared.meta.schema import project_holds, projects, quota_blocks
from dsec.shared.wire.iam import lineage
from dsec.shared.wire.models import SandboxInfo, SandboxState, parse_sandbox_id

log = logging.getLogger("dsec.iam.quota")
T = TypeVar("T")

# a hold still "starting" this long after admission belongs to a create that will never
# report back (its replica died): the sweep releases it (an edge create is bounded well below)
STARTING_STALE_S = 900.0
# a sandbox running without a hold is adopted only once it is this old: younger ones may be
# a create still on its way back to the replica that admitted it
ADOPT_GRACE_S = 60.0
MAX_GROUP = 64  # binds committed together at most
# after a refusal, a project's admissions read its counters before they write, this long
REFUSED_READ_S = 1.0
# a deadlock should not happen (rows are locked in name order, see _lock); should one, an
# admission is tried again this many times
DEADLOCK_RETRIES = 5
# each resource's (usage counter, quota) columns of the projects table
COLUMNS = {
    "sandboxes": ("u_sandboxes", "q_sandboxes"),
    "cpu_cores": ("u_cpu_milli", "q_cpu_milli"),
    "memory_mb": ("u_memory_mb", "q_memory_mb"),
    "disk_mb": ("u_disk_mb", "q_disk_mb"),
    "starting": ("u_starting", "q_starting"),
}




def _charge_stmt() -> Update:
    """One conditional UPDATE of every row of a lineage (``names``, expanding) adding the
    amounts ``a_<resource>`` where each stays within its quota. Built once: making the
    expression per call cost more than running it (the hot path, docs/performance.md)."""
    t = projects.c
    conds = [or_(t[q].is_(None), t[u] + bindparam(f"a_{r}") <= t[q]) for r, (u, q) in COLUMNS.items()]
    return update(projects).where(t.name.in_(bindparam("names", expanding=True)), *conds).values(
        {u: t[u] + bindparam(f"a_{r}") for r, (u, _) in COLUMNS.items()})


def _move_stmt() -> Update:
    """Add ``a_<resource>`` (negative: free) to the counters of every row of ``names``."""
    t = projects.c
    return update(projects).where(t.name.in_(bindparam("names", expanding=True))).values(
        {u: t[u] + bindparam(f"a_{r}") for r, (u, _) in COLUMNS.items()})


def _start_stmt() -> Update:
    """One more create starting in every row of ``names`` that has room for it."""
    t = projects.c
    return update(projects).where(t.name.in_(bindparam("names", expanding=True)),
                                  or_(t.q_starting.is_(None), t.u_starting + 1 <= t.q_starting)
                                  ).values(u_starting=t.u_starting + 1)


CHARGE, MOVE, START = _charge_stmt(), _move_stmt(), _start_stmt()
_RESERVED_TO_STARTING = (update(project_holds).where(project_holds.c.id == bindparam("hold"),
                                                     project_holds.c.state == "reserved")
                         .values(state="starting").returning(project_holds.c.project))
HOLD_INSERT = insert(project_holds)
_h = project_holds.c
BIND = (update(project_holds).where(_h.id == bindparam("hold"), _h.state == "starting")
        .values(sandbox_id=bindparam("sandbox_id"), state="running", bound_at=bindparam("now"))
        .returning(_h.project))


_b = quota_blocks.c
# a bound create's amounts leave its block's row for its hold (the counters keep them)
BLOCK_DEBIT = (update(quota_blocks).where(_b.id == bindparam("block"))
               .values(sandboxes=_b.sandboxes - bindparam("d_sandboxes"), cpu_milli=_b.cpu_milli - bindparam("d_cpu"),
                       memory_mb=_b.memory_mb - bindparam("d_memory"), disk_mb=_b.disk_mb - bindparam("d_disk"),
                       renewed_at=bindparam("now"))
               .returning(_b.id))


@dataclass(frozen=True)
class Need:
    """What one sandbox holds of its project's quota."""

    cpu_milli: int
    memory_mb: int
    disk_mb: int

    @classmethod
    def of(cls, cpu_cores: float, memory_mb: int, disk_mb: int | None) -> Need:
        return cls(round(cpu_cores * 1000), int(memory_mb), int(disk_mb or 0))

    @classmethod
    def of_info(cls, info: SandboxInfo) -> Need:
        disk = info.disk_limit_mb if info.disk_limit_mb is not None else (info.vm.disk_mb if info.vm else 0)
        return cls.of(info.cpu_cores_limit, info.memory_limit_mb, disk)

    def amounts(self, n: int = 1, starting: bool = True) -> dict[str, int]:
        """What ``n`` of it add to each resource's counter (``starting``: one create in flight
        each; a gang's reservation starts none)."""
        return {"sandboxes": n, "cpu_cores": n * self.cpu_milli, "memory_mb": n * self.memory_mb,
                "disk_mb": n * self.disk_mb, "starting": n if starting else 0}


@dataclass(frozen=True)
class FromBlock:
    """A create admitted from a quota block (dsec.control.iam.blocks): what its bind writes."""

    block: str
    project: str
    job: str | None
    need: Need
    admitted_at: float


def show(resource: str, value: int | float, unit: bool = True) -> str:
    """A counter's value as people read it (CPU is kept in millicores); ``unit``: also name
    counted resources ("8000 sandboxes", not "8000")."""
    if resource == "cpu_cores":
        return f"{value / 1000:g} CPU cores"
    if resource.endswith("_mb"):
        return f"{value} MiB"
    return f"{value} {resource}" if unit else str(value)


def _insert_root(c: Connection, project: str) -> None:
    c.execute(insert(projects).values(name=project, parent=None, description="", created_at=time.time(),
                                      created_by=None))


class ProjectQuotas:
    def __init__(self, db: Engine) -> None:
        self.db = db
        # SQLite has one writer: serializing here keeps threads off its busy-wait
        self._serial = threading.Lock() if db.dialect.name == "sqlite" else None
        self._warned: set[str] = set()
        self._refused: dict[str, float] = {}  # project -> when an admission last found it full
        self._binds: list[tuple[Bind, asyncio.Future[bool]]] = []
        self._binding: asyncio.Task[None] | None = None

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args)`` of this class from the event loop: in place on a SQLite file (a
        commit there is a few writes to the OS's cache, ~0.3 ms: cheaper than the hop to a
        thread and back, which under a burst of creates waited for the GIL each way), on a
        thread for PostgreSQL (a network round trip), shielded: a caller cancelled meanwhile
        does not leave it half known (in place, nothing can interrupt it)."""
        if self._serial is not None:
            return fn(*args, **kwargs)
        return await asyncio.shield(asyncio.to_thread(fn, *args, **kwargs))

    def serial(self) -> contextlib.AbstractContextManager[object]:
        """The lock SQLite's writers take here (nothing on PostgreSQL)."""
        return self._serial or contextlib.nullcontext()

    @contextlib.contextmanager
    def _txn(self) -> Iterator[Connection]:
        with self.serial(), self.db.begin() as c:
            yield c

    def ensure_root(self, project: str) -> None:
        """A top-level project that was never created (the "default" one, a token's project
        from before the tree) exists from its first sandbox on, with no quota."""
        try:
            with self._txn() as c:
                if c.execute(select(projects.c.name).where(projects.c.name == project)).first() is None:
                    _insert_root(c, project)
        except IntegrityError:  # another replica made it first
            pass

    def admit(self, project: str, job: str | None, need: Need) -> str:
        """Hold ``need`` (and one starting slot) in ``project`` and every ancestor; the hold's
        id. Refused with QuotaExceeded (429) naming the project and resource, or NotFound for
        a sub-project that does not exist."""
        # a read first while the project was refused lately: under a burst at a full quota, most
        # refusals then never take the write lock; otherwise the write alone (a round trip less)
        if time.monotonic() - self._refused.get(project, -REFUSED_READ_S) < REFUSED_READ_S \
                and (missing := self._check(project, need.amounts())) is not None:
            self.ensure_root(missing)
        rooted = False
        for attempt in range(DEADLOCK_RETRIES + 2):
            try:
                with self._txn() as c:
                    if not self._charge(c, project, need):
                        raise _Refused
                    hold = uuid.uuid4().hex
                    c.execute(HOLD_INSERT, {
                        "id": hold, "sandbox_id": None, "project": project, "job": job, "state": "starting",
                        "cpu_milli": need.cpu_milli, "memory_mb": need.memory_mb, "disk_mb": need.disk_mb,
                        "charged_cpu_milli": need.cpu_milli, "created_at": time.time()})
                    return hold
            except _Refused:
                # raises, naming the project and resource; or a top-level project never made (the
                # "default" one, a token's project from before the tree): made, then once more
                try:
                    missing = self._check(project, need.amounts())
                except QuotaExceeded:
                    if len(self._refused) > 100_000:
                        self._refused.clear()
                    self._refused[project] = time.monotonic()
                    raise
                if not rooted:  # a top-level project made now, or by another admission meanwhile: once more
                    if missing is not None:
                        self.ensure_root(missing)
                    rooted = True
                    continue
                self._refused[project] = time.monotonic()
                raise QuotaExceeded(f"project {project!r} had no room for this sandbox (its usage changed "
                                    "meanwhile: try again)", field="quota") from None
            except OperationalError as e:  # PostgreSQL broke a lock cycle by failing this one: again
                if "deadlock" not in str(e).lower() or attempt == DEADLOCK_RETRIES:
                    raise
        raise AssertionError("unreachable")

    def reserve(self, project: str, job: str | None, need: Need, n: int, batch_id: str) -> list[str]:
        """A gang's shares: ``n`` times ``need`` held in ``project`` and every ancestor in one
        transaction, as ``n`` reserved holds (ids ``<batch_id>/<i>``), or nothing and
        QuotaExceeded naming the project, the resource and what the gang needs."""
        amounts = need.amounts(n, starting=False)
        # (its items start one at a time: a cap of 0 creates starting at once refuses it now)
        if (missing := self._check(project, {**amounts, "starting": 1}, f"these {n} sandboxes need")) is not None:
            self.ensure_root(missing)
        ids = [f"{batch_id}/{i}" for i in range(n)]
        now = time.time()
        for attempt in range(DEADLOCK_RETRIES + 1):
            try:
                with self._txn() as c:
                    names = lineage(project)
                    _lock(c, names)
                    if c.execute(CHARGE, {"names": names, **{f"a_{r}": v for r, v in amounts.items()}}
                                 ).rowcount != len(names):
                        raise _Refused
                    c.execute(HOLD_INSERT, [{
                        "id": hid, "sandbox_id": None, "project": project, "job": job, "state": "reserved",
                        "cpu_milli": need.cpu_milli, "memory_mb": need.memory_mb, "disk_mb": need.disk_mb,
                        "charged_cpu_milli": need.cpu_milli, "created_at": now} for hid in ids])
                    return ids
            except _Refused:
                self._check(project, amounts, f"these {n} sandboxes need")
                raise QuotaExceeded(f"project {project!r} had no room for these {n} sandboxes (its usage "
                                    "changed meanwhile: try again)", field="quota") from None
            except OperationalError as e:
                if "deadlock" not in str(e).lower() or attempt == DEADLOCK_RETRIES:
                    raise
        raise AssertionError("unreachable")

    def start(self, hold: str) -> bool:
        """A gang's item begins its create: its reserved hold takes one of the creates
        starting at once (QuotaExceeded on ``quota.starting`` when its project is at that
        cap: the batch waits, as for any item). False if the hold is gone (released)."""
        project: str | None = None
        try:
            with self._txn() as c:
                project = c.execute(_RESERVED_TO_STARTING, {"hold": hold}).scalar()
                if project is None:
                    return False
                names = lineage(project)
                _lock(c, names)
                if c.execute(START, {"names": names}).rowcount != len(names):
                    raise _Refused
                return True
        except _Refused:
            assert project is not None
            self._check(project, {"sandboxes": 0, "cpu_cores": 0, "memory_mb": 0, "disk_mb": 0, "starting": 1})
            err = QuotaExceeded(f"project {project!r} is at its cap of sandboxes starting at once",
                                field="quota.starting")
            err.limit = 1  # some cap other than 0 (the read after saw room): the batch waits, as for any item
            raise err from None

    def release_reserved(self, batch_id: str) -> int:
        """Free what a gang reserved and no item has started: its end, a cancel, a failure."""
        h = project_holds.c
        prefix = batch_id.replace("_", "\\_").replace("%", "\\%") + "/%"
        with self._txn() as c:
            rows = c.execute(delete(project_holds).where(h.id.like(prefix, escape="\\"), h.state == "reserved")
                             .returning(h.project, h.charged_cpu_milli, h.memory_mb, h.disk_mb)).all()
            by_project: dict[str, list[int]] = {}
            for project, cpu, mem, disk in rows:
                tot = by_project.setdefault(project, [0, 0, 0, 0])
                tot[0] += 1
                tot[1] += cpu
                tot[2] += mem
                tot[3] += disk
            for project, (count, cpu, mem, disk) in by_project.items():
                self._move(c, project, -count, -cpu, -mem, -disk, 0)
        return len(rows)

    @staticmethod
    def _charge(c: Connection, project: str, need: Need) -> bool:
        """One conditional UPDATE of every row of the lineage: all or (rolled back) nothing.
        PostgreSQL locks the rows as it updates them; a concurrent admission that updated
        one first makes it wait, then re-check the condition against that row's new values."""
        names = lineage(project)
        _lock(c, names)
        return c.execute(CHARGE, {"names": names, **{f"a_{r}": v for r, v in need.amounts().items()}}
                         ).rowcount == len(names)

    def _check(self, project: str, amounts: dict[str, int], needs: str = "this sandbox needs") -> str | None:
        """Whether ``project`` and its ancestors have room for ``amounts``, as last committed:
        QuotaExceeded naming the project and resource, or NotFound for a missing
        sub-project, is raised; a missing top-level project is returned."""
        names = lineage(project)
        with self.db.connect() as c:
            rows = {r["name"]: r for r in c.execute(select(projects).where(projects.c.name.in_(names))).mappings()}
        for p in names:
            row = rows.get(p)
            if row is None:
                if "/" not in p:
                    return p
                raise NotFound(f"no project {p!r}: create it first (dsec project create {p})", field="project")
            for r, (u, q) in COLUMNS.items():
                if row[q] is not None and row[u] + amounts[r] > row[q]:
                    what = "sandboxes starting at once" if r == "starting" else r.replace("_mb", "").replace("_", " ")
                    err = QuotaExceeded(
                        f"project {p!r} is at its quota of {what}: {show(r, row[q])}, {show(r, row[u])} held in "
                        f"its subtree, {needs} {show(r, amounts[r])}", field=f"quota.{r}")
                    err.limit = row[q]
                    raise err
        return None

    @staticmethod
    def _move(c: Connection, project: str, sandboxes: int, cpu_milli: int, memory_mb: int, disk_mb: int,
              starting: int) -> None:
        """Add these amounts (negative: free them) to the counters of ``project`` and its ancestors."""
        names = lineage(project)
        _lock(c, names)
        c.execute(MOVE, {"names": names, "a_sandboxes": sandboxes, "a_cpu_cores": cpu_milli, "a_memory_mb": memory_mb,
                         "a_disk_mb": disk_mb, "a_starting": starting})

    def bind(self, hold: str, sandbox_id: str, also: Also | None = None, src: FromBlock | None = None
             ) -> bool:
        """The edge made the hold's sandbox: no longer starting. ``also``: a statement to
        commit with it (the cluster's index row of the sandbox: one commit, not two).
        ``src``: the create was admitted from that block; its hold is written now. False if
        that block's row was gone (the create was counted on its own)."""
        try:
            return not self.bind_many([(hold, sandbox_id, also, src)])
        except IntegrityError:  # the sweep adopted the sandbox first: that hold counts it, not this one
            there = True
            if src is None:
                self.release(hold=hold)
            else:
                with self._txn() as c:
                    if c.execute(select(project_holds.c.id).where(project_holds.c.id == hold)).first():
                        return True  # bound already (a retry of a commit whose answer was lost)
                    there = self._debit(c, src.block, [src.need])
                    if there:  # its share leaves the block and the counters
                        n = src.need
                        self._move(c, src.project, -1, -n.cpu_milli, -n.memory_mb, -n.disk_mb, 0)
            if also is not None:  # (rolled back with the bind)
                with self._txn() as c:
                    c.execute(*also)
            return there

    async def bind_soon(self, hold: str, sandbox_id: str, also: Also | None = None,
                        src: FromBlock | None = None) -> bool:
        """:meth:`bind` from the event loop. On PostgreSQL, binds that arrive while one is
        being committed are committed together, in one transaction (group commit): under a
        burst a create's bind is then a few statements of a shared commit, not a commit of
        its own (bench/scale.py). On SQLite, one bind in place, as before."""
        if self._serial is not None:
            return self.bind(hold, sandbox_id, also, src)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._binds.append(((hold, sandbox_id, also, src), fut))
        if self._binding is None or self._binding.done():
            self._binding = asyncio.create_task(self._flush_binds())
        return await asyncio.shield(fut)

    async def _flush_binds(self) -> None:
        while self._binds:
            batch, self._binds = self._binds[:MAX_GROUP], self._binds[MAX_GROUP:]
            try:
                gone = await asyncio.to_thread(self.bind_many, [b for b, _ in batch])
            except Exception as e:  # each on its own, so that one's failure is its own
                for b, fut in batch:
                    try:
                        ok = await asyncio.to_thread(self.bind, *b)
                    except Exception as one:
                        fut.set_exception(one)
                    else:
                        fut.set_result(ok)
                log.debug("grouped binds retried one by one: %s", e)
                continue
            for b, fut in batch:
                fut.set_result(b[3] is None or b[3].block not in gone)

    def bind_many(self, items: list[Bind]) -> set[str]:
        """Several binds (and their ``also`` statements) in one transaction; the ancestors'
        rows locked once, in name order, for all of them. The blocks found gone."""
        with self._txn() as c:
            freed: Counter[str] = Counter()
            blocks: dict[str, tuple[str, list[Need]]] = {}
            now = time.time()
            for hold, sandbox_id, also, src in items:
                project = None
                if src is None:  # conditional: a release racing this one (the sweep's) must not count twice
                    project = c.execute(BIND, {"hold": hold, "sandbox_id": sandbox_id, "now": now}).scalar()
                else:
                    n = src.need
                    c.execute(HOLD_INSERT, {
                        "id": hold, "sandbox_id": sandbox_id, "project": src.project, "job": src.job,
                        "state": "running", "cpu_milli": n.cpu_milli, "memory_mb": n.memory_mb,
                        "disk_mb": n.disk_mb, "charged_cpu_milli": n.cpu_milli, "created_at": src.admitted_at,
                        "bound_at": now})
                    blocks.setdefault(src.block, (src.project, []))[1].append(n)
                if also is not None:
                    c.execute(*also)
                if project is not None:
                    freed[project] += 1
            gone: set[str] = set()
            for block, (project, needs) in sorted(blocks.items()):
                if not self._debit(c, block, needs):  # its block was freed meanwhile: counted now
                    gone.add(block)
                    self._move(c, project, len(needs), sum(n.cpu_milli for n in needs),
                               sum(n.memory_mb for n in needs), sum(n.disk_mb for n in needs), 0)
            if freed:
                _lock(c, sorted({n for p in freed for n in lineage(p)}))
                for project, k in sorted(freed.items()):
                    c.execute(MOVE, {"names": lineage(project), "a_sandboxes": 0, "a_cpu_cores": 0,
                                     "a_memory_mb": 0, "a_disk_mb": 0, "a_starting": -k})
        return gone

    @staticmethod
    def _debit(c: Connection, block: str, needs: list[Need]) -> bool:
        """Move ``needs`` out of ``block``'s row (to their holds); False if the row is gone
        (the sweep freed it, its project was deleted): its amounts are no longer counted."""
        return c.execute(BLOCK_DEBIT, {
            "block": block, "d_sandboxes": len(needs), "d_cpu": sum(n.cpu_milli for n in needs),
            "d_memory": sum(n.memory_mb for n in needs), "d_disk": sum(n.disk_mb for n in needs),
            "now": time.time()}).first() is not None

    def release(self, *, hold: str | None = None, sandbox_id: str | None = None) -> bool:
        """Free a hold (by its id, or its sandbox's); False if there was none."""
        col = project_holds.c.id if hold is not None else project_holds.c.sandbox_id
        key = hold if hold is not None else sandbox_id
        h = project_holds.c
        with self._txn() as c:
            # what is freed is the row as deleted (RETURNING), not as read before: a bind or a
            # pause committed in between changed it
            row = c.execute(delete(project_holds).where(col == key).returning(
                h.project, h.state, h.charged_cpu_milli, h.memory_mb, h.disk_mb)).mappings().first()
            if row is None:
                return False
            self._move(c, row["project"], -1, -row["charged_cpu_milli"], -row["memory_mb"], -row["disk_mb"],
                       -1 if row["state"] == "starting" else 0)
        return True

    def set_paused(self, sandbox_id: str, paused: bool) -> bool:
        """A paused sandbox holds no CPU; resumed, it holds it again (never refused: it was admitted)."""
        with self._txn() as c:
            h = c.execute(select(project_holds).where(project_holds.c.sandbox_id == sandbox_id)).mappings().first()
            want = "paused" if paused else "running"
            if h is None or h["state"] in ("starting", want):
                return False
            charged = 0 if paused else h["cpu_milli"]
            if c.execute(update(project_holds).where(project_holds.c.id == h["id"],
                                                     project_holds.c.state == h["state"])
                         .values(state=want, charged_cpu_milli=charged)).rowcount != 1:
                return False  # another replica changed or released it first
            self._move(c, h["project"], 0, charged - h["charged_cpu_milli"], 0, 0, 0)
        return True

    def adopt(self, info: SandboxInfo, project: str) -> bool:
        """Count a sandbox that runs without a hold (never refused: it exists)."""
        need = Need.of_info(info)
        paused = info.state == SandboxState.paused
        try:
            with self._txn() as c:
                known = c.execute(select(projects.c.name).where(projects.c.name.in_(lineage(project)))).scalars().all()
                if len(known) != len(lineage(project)):
                    if "/" in project:
                        if info.sandbox_id not in self._warned:  # once, not every sweep
                            self._warned.add(info.sandbox_id)
                            log.warning("sandbox %s is of project %r, which does not exist: not counted",
                                        info.sandbox_id, project)
                        return False
                    _insert_root(c, project)
                if c.execute(select(project_holds.c.id).where(project_holds.c.sandbox_id == info.sandbox_id)).first():
                    return False
                c.execute(insert(project_holds).values(
                    id=uuid.uuid4().hex, sandbox_id=info.sandbox_id, project=project, job=info.job,
                    state="paused" if paused else "running", cpu_milli=need.cpu_milli, memory_mb=need.memory_mb,
                    disk_mb=need.disk_mb, charged_cpu_milli=0 if paused else need.cpu_milli, created_at=time.time(),
                    bound_at=time.time()))
                self._move(c, project, 1, 0 if paused else need.cpu_milli, need.memory_mb, need.disk_mb, 0)
        except IntegrityError:  # another replica's sweep (or create) got there first: it counts it
            return False
        return True

    def holds(self) -> list[tuple[str, str | None, str, float, float | None]]:
        """Every hold: (id, sandbox id, state, created at, bound at). The sweep reads them
        before listing the edges: a sandbox stopped in between is then neither held nor
        listed, where read after, it would be listed but no longer held, and adopted again."""
        h = project_holds.c
        with self.db.connect() as c:
            return [tuple(r) for r in c.execute(select(h.id, h.sandbox_id, h.state, h.created_at, h.bound_at))]  # type: ignore[misc]

    def reconcile(self, holds: list[tuple[str, str | None, str, float, float | None]], listed: Iterable[SandboxInfo],
                  answered: set[str], edges: set[str], started: float, project_of: dict[str, str | None],
                  running_batches: set[str] | None = None) -> dict[str, int]:
        """Bring ``holds`` (read before the listing) to what the edges hold: ``listed`` is
        every sandbox of the edges in ``answered`` (a listing begun at ``started``), ``edges``
        every edge of the cluster. ``project_of`` gives a listed sandbox's project (None: one
        of the platform's own, never counted). ``running_batches`` (read after the holds):
        a reserved hold of a batch not in it is released (None: none is). Returns counts of
        what changed."""
        live = {i.sandbox_id: i for i in listed if i.state in (SandboxState.running, SandboxState.paused,
                                                               SandboxState.creating)}
        done = {"released": 0, "adopted": 0, "paused": 0, "resumed": 0}
        held = set()
        for hid, sid, state, created, bound in holds:
            if sid is None:
                if state == "starting" and created < started - STARTING_STALE_S:
                    done["released"] += self.release(hold=hid)
                elif state == "reserved" and running_batches is not None \
                        and hid.rpartition("/")[0] not in running_batches:
                    done["released"] += self.release(hold=hid)
                continue
            held.add(sid)
            try:
                edge = parse_sandbox_id(sid)
            except ValueError:
                edge = ""
            if sid in live:
                st = live[sid].state
                if st == SandboxState.paused and state == "running":
                    done["paused"] += self.set_paused(sid, True)
                elif st == SandboxState.running and state == "paused":
                    done["resumed"] += self.set_paused(sid, False)
            elif (edge in answered and (bound or created) < started) or edge not in edges:
                done["released"] += self.release(hold=hid)
        for sid, info in live.items():
            project = project_of.get(sid)
            if sid not in held and project is not None and info.state != SandboxState.creating \
                    and info.created_at < started - ADOPT_GRACE_S:
                done["adopted"] += self.adopt(info, project)
        return done

    def job_usage(self, under: str) -> dict[tuple[str, str], dict[str, int]]:
        """(project, job) -> held amounts, for the jobs of ``under``'s subtree."""
        h = project_holds.c
        with self.db.connect() as c:
            rows = c.execute(select(h.project, h.job, h.state, h.charged_cpu_milli, h.memory_mb, h.disk_mb).where(
                and_(h.job.is_not(None), in_subtree(h.project, under)))).all()
        out: dict[tuple[str, str], dict[str, int]] = {}
        for project, job, state, cpu, mem, disk in rows:
            u = out.setdefault((project, job), {"sandboxes": 0, "cpu_milli": 0, "memory_mb": 0, "disk_mb": 0,
                                                "starting": 0})
            u["sandboxes"] += 1
            u["cpu_milli"] += cpu
            u["memory_mb"] += mem
            u["disk_mb"] += disk
            u["starting"] += state == "starting"
        return out

    def held_in(self, under: str) -> int:
        """How many sandboxes ``under``'s subtree holds."""
        h = project_holds.c
        with self.db.connect() as c:
            return len(c.execute(select(h.id).where(in_subtree(h.project, under))).all())


def _lock(c: Connection, names: list[str]) -> None:
    """Lock the rows in name order first: two transactions updating overlapping lineages
    then never hold each other's rows (one UPDATE alone locks in scan order, which a
    sequential scan takes from the heap, and PostgreSQL would fail one as a deadlock).
    SQLite has one writer: nothing to do."""
    if c.dialect.name == "postgresql":
        c.execute(select(projects.c.name).where(projects.c.name.in_(names)).order_by(projects.c.name)
                  .with_for_update())


def in_subtree(col: ColumnElement[str], project: str) -> ColumnElement[bool]:
    """``col`` names ``project`` or one of its sub-projects. Names have no "%", but "_" is
    LIKE's any-one-character: escaped."""
    return or_(col == project, col.like(project.replace("_", "\\_") + "/%", escape="\\"))


Also = tuple[Executable, Mapping[str, object]]  # a statement to commit with a bind, and its parameters
Bind = tuple[str, str, Also | None, FromBlock | None]  # hold, sandbox id, also, block


class _Refused(Exception):
    """Some project of the lineage had no room: roll back, then say which."""
