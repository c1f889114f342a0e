"""The SDK's job handle: a job's record plus the client, with its status, its sandboxes,
and pause / resume / stop of all of them. Like a sandbox handle it holds nothing of its
own: a new trainer process gets the same job back with ``client.job(name)``."""

from __future__ import annotations

import builtins
from typing import Protocol

from dsec.client.sdk.batches import AsyncBatch
from dsec.client.sdk.sandbox import AsyncSandbox
from dsec.client.sdk.transport import Api
from dsec.shared.wire.jobs import JobAction, JobInfo, JobStatus
from dsec.shared.wire.models import ContainerArgs, MicroVMArgs, SandboxInfo, VMArgs


class JobsApi(Api, Protocol):
    """The client's requests, and its creates (a job's sandboxes are made as any others)."""

    async def _create(self, args: ContainerArgs | MicroVMArgs | VMArgs, timeout: float) -> AsyncSandbox: ...

    async def create_many(self, args: ContainerArgs | MicroVMArgs | VMArgs, n: int, job: str | None = None,
                          *, all_or_nothing: bool = False) -> AsyncBatch: ...


class AsyncJob:
    def __init__(self, client: JobsApi, info: JobInfo) -> None:
        self._client = client
        self.info = info
        self.name = info.name

    def __repr__(self) -> str:
        return f"<AsyncJob {self.name} {self.info.state}>"

    @property
    def _base(self) -> str:
        return f"/v1/jobs/{self.name}"

    @property
    def _params(self) -> dict[str, str]:
        return {"project": self.info.project}

    async def get(self) -> JobInfo:
        """The job's record now (its state, quota, labels)."""
        self.info = JobInfo.model_validate(await self._client._json("GET", self._base, params=self._params))
        return self.info

    async def status(self, usage: bool = False) -> JobStatus:
        """Its sandboxes counted by state, backend and edge; what they hold against the quota;
        creations in the last minute; ``usage=True`` adds what they use now."""
        params = {**self._params, "usage": str(usage).lower()}
        st = JobStatus.model_validate(await self._client._json("GET", f"{self._base}/status", params=params))
        self.info = st.job
        return st

    async def sandboxes(self, usage: bool = False) -> builtins.list[SandboxInfo]:
        """Every sandbox of the job, on every edge."""
        params = {**self._params, "usage": str(usage).lower()}
        return [SandboxInfo.model_validate(x)
                for x in await self._client._json("GET", f"{self._base}/sandboxes", params=params)]

    async def run(self, args: ContainerArgs | MicroVMArgs | VMArgs | None = None, *,
                  timeout: float = 300.0) -> AsyncSandbox:
        """A sandbox of this job (``args.job`` set to it), counted against its quota."""
        a = (args or ContainerArgs()).model_copy(update={"job": self.name})
        return await self._client._create(a, timeout)

    async def create_many(self, args: ContainerArgs | MicroVMArgs | VMArgs, n: int, *,
                          all_or_nothing: bool = False) -> AsyncBatch:
        """``n`` sandboxes of this job as a batch (``client.create_many``); the quota is checked per
        item: those past it fail with ``quota_exceeded``, the others are made. ``all_or_nothing``:
        a gang, all n held before it is accepted or none (``client.create_many``)."""
        return await self._client.create_many(args, n, job=self.name, all_or_nothing=all_or_nothing)

    async def _act(self, what: str, timeout: float) -> JobAction:
        r = JobAction.model_validate(await self._client._json("POST", f"{self._base}/{what}", params=self._params,
                                                              timeout=timeout))
        self.info = r.job
        return r

    async def pause(self, *, timeout: float = 600.0) -> JobAction:
        """No new sandboxes for the job (creates get 409 ``job_not_active``) and every running one
        paused: memory reclaimed, state kept. What a trainer's SIGTERM handler calls."""
        return await self._act("pause", timeout)

    async def resume(self, *, timeout: float = 600.0) -> JobAction:
        """New sandboxes allowed again and every paused one resumed."""
        return await self._act("resume", timeout)

    async def stop(self, *, timeout: float = 600.0) -> JobAction:
        """Every sandbox of the job stopped; the job takes none again."""
        return await self._act("stop", timeout)
