"""Admitting a job's creates against its quota (sandboxes, CPU cores, memory of its live
sandboxes), without overshooting under concurrent creates.

What a job holds is counted from its sandboxes on every edge (a listing at most
``SNAPSHOT_TTL_S`` old, running and paused ones), plus what this replica created since
that listing, plus the creates this replica has admitted and not yet finished (their
reservations). A job's admissions are serialized by a per-job lock, so within one
apiserver replica the quota is never exceeded however many creates race. Across
replicas (cluster mode) each one admits against that same listing, which sees another
replica's sandboxes once it is refreshed: a job whose creates go through several
replicas at once may overshoot by what the others admitted in the last
``SNAPSHOT_TTL_S`` plus a create's duration. A client keeps to one replica (the SDK
does), which keeps it exact. Nothing here outlives the process: it is a cache of what the
edges and the job records say.

A job's creation rate (``creates_per_s``) is the exception: its bucket is on the job's
row (dsec.control.jobs.store), so every replica takes from the same one."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from dsec.control.jobs.store import JobStore
from dsec.shared.errors import JobNotActive, QuotaExceeded, RateLimited
from dsec.shared.wire.jobs import JobInfo, JobQuota
from dsec.shared.wire.models import SandboxInfo, SandboxState, parse_sandbox_id

SNAPSHOT_TTL_S = 1.0
# counted as held: a sandbox still "creating" on an edge is either one of this replica's
# reservations (counted there) or another replica's (see the module docstring)
HOLDING = (SandboxState.running, SandboxState.paused)
# (project, job) -> the job's sandboxes on every edge that answered, and the edges that did not
Lister = Callable[[str, str], Awaitable[tuple[list[SandboxInfo], tuple[str, ...]]]]


@dataclass(frozen=True)
class Held:
    cpu_cores: float
    memory_mb: int


@dataclass
class _Use:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    listed: dict[str, Held] = field(default_factory=dict)
    listed_at: float = float("-inf")
    recent: dict[str, tuple[Held, float]] = field(default_factory=dict)  # made here since: (held, done at)
    inflight: dict[int, Held] = field(default_factory=dict)

    def used(self) -> tuple[int, float, int]:
        held = {**self.listed, **{sid: h for sid, (h, _) in self.recent.items()}}
        items = [*held.values(), *self.inflight.values()]
        return len(items), sum(h.cpu_cores for h in items), sum(h.memory_mb for h in items)


class Admission:
    """One admitted create: ``made`` records the sandbox it produced."""

    def __init__(self) -> None:
        self.info: SandboxInfo | None = None

    def made(self, info: SandboxInfo) -> None:
        self.info = info


class JobGate:
    def __init__(self, store: JobStore, lister: Lister) -> None:
        self.store = store
        self.lister = lister
        self._uses: dict[tuple[str, str], _Use] = {}
        self._tokens = itertools.count()

    async def pace(self, rec: JobInfo, n: int = 1) -> None:
        """Take ``n`` creates from the job's creation-rate budget (JobQuota.creates_per_s),
        shared by every worker and replica of the job; RateLimited (429, Retry-After) when it
        has no room now. ``rec``: the job's record as this create read it (a job without a
        rate is not paced)."""
        rate = rec.quota.creates_per_s
        if rate is None:
            return
        wait = await asyncio.to_thread(self.store.take_creates, rec.project, rec.name, rate, n)
        if wait > 0:
            raise RateLimited(f"job {rec.name!r} is at its creation rate of {rate:g} per second"
                              + (f" ({n} at once exceed a second's worth)" if n > max(rate, 1.0) else
                                 f": try again in {wait:.2f} s"), field="quota.creates_per_s", retry_after=wait)

    @contextlib.asynccontextmanager
    async def admit(self, project: str, job: str, cpu_cores: float, memory_mb: int,
                    rec: JobInfo | None) -> AsyncIterator[Admission]:
        """Admit one create of ``job`` (``rec``, its record as this create read it: its state
        and quota), holding its share until the body ends; refused with JobNotActive (409) or
        QuotaExceeded (429). A job with no record is free-form, as a bare label: admitted."""
        adm = Admission()
        if rec is None:
            yield adm
            return
        _active(rec, job)
        q = rec.quota
        if q.sandboxes is None and q.cpu_cores is None and q.memory_mb is None:
            yield adm
            return
        use = self._uses.setdefault((project, job), _Use())
        need = Held(cpu_cores, memory_mb)
        async with use.lock:
            if time.monotonic() - use.listed_at > SNAPSHOT_TTL_S:
                await self._refresh(use, project, job)
            _check(job, q, use.used(), need)
            token = next(self._tokens)
            use.inflight[token] = need
        try:
            yield adm
        finally:
            del use.inflight[token]
            if adm.info is not None:
                use.recent[adm.info.sandbox_id] = (need, time.monotonic())

    async def check_many(self, project: str, job: str, n: int, cpu_cores: float, memory_mb: int) -> None:
        """Whether the job takes ``n`` more sandboxes at once (a gang): its state, and its
        quota against what it holds now; JobNotActive or QuotaExceeded naming the shortfall.
        Each item is still admitted as it is made (:meth:`admit`)."""
        rec = await asyncio.to_thread(self.store.get, project, job)
        if rec is None:
            return
        _active(rec, job)
        q = rec.quota
        if q.sandboxes is None and q.cpu_cores is None and q.memory_mb is None:
            return
        use = self._uses.setdefault((project, job), _Use())
        async with use.lock:
            if time.monotonic() - use.listed_at > SNAPSHOT_TTL_S:
                await self._refresh(use, project, job)
            _check(job, q, use.used(), Held(cpu_cores * n, memory_mb * n), n)

    async def _refresh(self, use: _Use, project: str, job: str) -> None:
        started = time.monotonic()
        items, missing = await self.lister(project, job)
        listed = {i.sandbox_id: Held(i.cpu_cores_limit, i.memory_limit_mb) for i in items if i.state in HOLDING}
        # an edge that did not answer still holds what it held: keep counting it
        listed.update({sid: h for sid, h in use.listed.items() if parse_sandbox_id(sid) in missing})
        use.listed = listed
        use.listed_at = started
        # what finished before the listing began is in it (if still alive)
        use.recent = {sid: v for sid, v in use.recent.items() if v[1] >= started and sid not in listed}

    def forget(self, sandbox_id: str) -> None:
        """A sandbox was stopped through this replica: its share is free at once."""
        for use in self._uses.values():
            use.listed.pop(sandbox_id, None)
            use.recent.pop(sandbox_id, None)

    def invalidate(self, project: str, job: str) -> None:
        """The job's sandboxes changed wholesale (stopped, ...): the next admission lists them again."""
        if (use := self._uses.get((project, job))) is not None:
            use.listed_at = float("-inf")

    async def drain(self, project: str, job: str, timeout: float) -> None:
        """Wait (up to ``timeout``) for this replica's admitted creates of the job to finish,
        so a job-wide pause or stop also reaches the sandboxes they make."""
        use = self._uses.get((project, job))
        deadline = time.monotonic() + timeout
        while use is not None and use.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def _active(rec: JobInfo, job: str) -> None:
    if rec.state != "active":
        raise JobNotActive(f"job {job!r} is {rec.state}: it takes no new sandboxes"
                           + (" until it is resumed" if rec.state == "paused" else ""), field="job")


def _check(job: str, q: JobQuota, used: tuple[int, float, int], need: Held, count: int = 1) -> None:
    """``need``: what ``count`` more sandboxes hold together."""
    n, cpu, mem = used
    if q.sandboxes is not None and n + count > q.sandboxes:
        raise QuotaExceeded(f"job {job!r} is at its quota of {q.sandboxes} sandboxes ({n} live or starting"
                            + (f"; these {count} need {count}" if count > 1 else "") + ")", field="quota.sandboxes")
    if q.cpu_cores is not None and cpu + need.cpu_cores > q.cpu_cores + 1e-9:
        raise QuotaExceeded(f"job {job!r}: {need.cpu_cores:g} more CPU cores would exceed its quota of "
                            f"{q.cpu_cores:g} ({cpu:g} held)", field="quota.cpu_cores")
    if q.memory_mb is not None and mem + need.memory_mb > q.memory_mb:
        raise QuotaExceeded(f"job {job!r}: {need.memory_mb} MiB more memory would exceed its quota of "
                            f"{q.memory_mb} MiB ({mem} MiB held)", field="quota.memory_mb")
