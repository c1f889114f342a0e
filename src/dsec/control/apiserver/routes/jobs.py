"""Jobs: create, get, list, status, and pause / resume / stop of every sandbox of a job on
every edge. A job belongs to the project of the token that made it (an admin token names
one with ``?project=``, else ``default``); its record is in the metadata database, so any
replica serves it. Its quota is enforced on create (dsec.control.jobs.quota)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Query

from dsec.control.apiserver.core import Apiserver, all_edges_answered, parse_labels
from dsec.control.iam import acting_project, project_scope
from dsec.shared.errors import InvalidRequest, JobNotActive, NotFound, SandboxBusy
from dsec.shared.wire.jobs import JobAction, JobInfo, JobQuota, JobSpec, JobState, JobStatus, JobUsage, check_job_name
from dsec.shared.wire.models import SandboxInfo, SandboxState

# a job-wide pause or stop first lets this replica's admitted creates of the job finish
DRAIN_S = 30.0
LIVE = (SandboxState.creating, SandboxState.running, SandboxState.paused)


def _name(name: str) -> str:
    try:
        return check_job_name(name)
    except ValueError as e:
        raise InvalidRequest(str(e), field="name") from None


def routes(api: Apiserver) -> APIRouter:
    router = APIRouter()
    store = api.job_store

    async def _get(project: str, name: str) -> JobInfo:
        info = await asyncio.to_thread(store.get, project, _name(name))
        if info is None:
            raise NotFound(f"no job {name!r} in project {project!r}", field="name")
        return info

    @router.post("/v1/jobs", status_code=201)
    async def create_job(spec: JobSpec, project: str | None = None) -> JobInfo:
        """409 ``job_exists`` if the project has a job of that name (even a stopped one);
        409 ``quota_conflict`` for a quota larger than its project's."""
        project = acting_project(project)
        q = spec.quota
        await asyncio.to_thread(api.projects.check_job_quota, project, q.sandboxes, q.cpu_cores, q.memory_mb)
        return await asyncio.to_thread(store.create, project, spec)

    @router.get("/v1/jobs")
    async def list_jobs(label: list[str] = Query(default=[]), state: JobState | None = None,
                        project: str | None = None) -> list[JobInfo]:
        """The caller's project's jobs (an admin token: every project's, unless ``project`` is given)."""
        scope = project_scope(project)
        return await asyncio.to_thread(store.list, scope, parse_labels(label), state)

    @router.get("/v1/jobs/{name}")
    async def get_job(name: str, project: str | None = None) -> JobInfo:
        return await _get(acting_project(project), name)

    @router.get("/v1/jobs/{name}/sandboxes", response_model=list[SandboxInfo])
    async def job_sandboxes(name: str, project: str | None = None, usage: bool = False) -> list[SandboxInfo]:
        """Every sandbox of the job on every edge that answered (the others are named in the status)."""
        job = await _get(acting_project(project), name)
        items, _ = await api.job_sandboxes(job.project, job.name, usage)
        return items

    @router.get("/v1/jobs/{name}/status")
    async def job_status(name: str, project: str | None = None, usage: bool = False) -> JobStatus:
        """Counts by state, backend and edge; what the live ones hold against the quota; creations in
        the last minute; ``usage=true`` adds what they use now (CPU time, memory, swap)."""
        job = await _get(acting_project(project), name)
        items, missing = await api.job_sandboxes(job.project, job.name, usage)
        live = [i for i in items if i.state in LIVE]
        used = JobUsage(sandboxes=len(live), cpu_cores=sum(i.cpu_cores_limit for i in live),
                        memory_mb=sum(i.memory_limit_mb for i in live))
        if usage:
            measured = [i.usage for i in live if i.usage is not None]
            used.cpu_s = sum(u.cpu_s for u in measured)
            used.memory_bytes = sum(u.memory_bytes for u in measured)
            used.swap_bytes = sum(u.swap_bytes for u in measured)
        q = job.quota
        free = JobQuota(
            sandboxes=None if q.sandboxes is None else max(0, q.sandboxes - used.sandboxes),
            cpu_cores=None if q.cpu_cores is None else max(0.0, q.cpu_cores - used.cpu_cores),
            memory_mb=None if q.memory_mb is None else max(0, q.memory_mb - used.memory_mb))
        now = time.time()
        return JobStatus(job=job, by_state=dict(Counter(i.state.value for i in items)),
                         by_backend=dict(Counter(i.backend.value for i in live)),
                         by_edge=dict(Counter(i.edge for i in live)), usage=used, quota_free=free,
                         created_last_minute=sum(1 for i in items if i.created_at >= now - 60),
                         unreachable_edges=list(missing))

    async def _each(job: JobInfo, states: tuple[SandboxState, ...], what: str,
                    op: Callable[[str], Awaitable[SandboxInfo]]) -> JobAction:
        await api.jobs.drain(job.project, job.name, DRAIN_S)
        items, _ = await api.job_sandboxes(job.project, job.name)
        targets = [i for i in items if i.state in states]

        async def one(i: SandboxInfo) -> str | None:
            try:
                await op(i.sandbox_id)  # (the project's CPU follows: docs/iam.md)
                return i.sandbox_id
            except SandboxBusy:
                return None
        done = await asyncio.gather(*(one(i) for i in targets))
        api.jobs.invalidate(job.project, job.name)
        all_edges_answered(what)  # the record already says what the job is: a retry reaches the rest
        changed = [sid for sid in done if sid is not None]
        return JobAction(job=job, changed=changed, skipped=[i.sandbox_id for i, d in zip(targets, done, strict=True)
                                                             if d is None])

    async def _transition(name: str, project: str | None, state: JobState) -> JobInfo:
        job = await _get(acting_project(project), name)
        if job.state == "stopped":
            raise JobNotActive(f"job {job.name!r} is stopped", field="name")
        updated = await asyncio.to_thread(store.set_state, job.project, job.name, state)
        assert updated is not None
        return updated

    @router.post("/v1/jobs/{name}/pause")
    async def pause_job(name: str, project: str | None = None) -> JobAction:
        """The job takes no new sandboxes (409 ``job_not_active``) and every running one is paused;
        busy ones (requests in flight) are left running and listed in ``skipped``."""
        job = await _transition(name, project, "paused")
        return await _each(job, (SandboxState.running,), "paused", api.pause)

    @router.post("/v1/jobs/{name}/resume")
    async def resume_job(name: str, project: str | None = None) -> JobAction:
        """The job takes new sandboxes again and every paused one is resumed."""
        job = await _transition(name, project, "active")
        return await _each(job, (SandboxState.paused,), "resumed", api.resume)

    @router.post("/v1/jobs/{name}/stop")
    async def stop_job(name: str, project: str | None = None) -> JobAction:
        """Every sandbox of the job is stopped, and it takes none again (its name stays taken)."""
        job = await _get(acting_project(project), name)
        if job.state != "stopped":
            updated = await asyncio.to_thread(store.set_state, job.project, job.name, "stopped")
            assert updated is not None
            job = updated
        return await _each(job, (SandboxState.running, SandboxState.paused), "stopped", api.stop)
    return router
