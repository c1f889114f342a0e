"""The SDK's batch handle: up to 32,768 sandboxes of one args made by the platform in the
background (``client.create_many``), with progress as it goes, per-item outcomes, cancel.
Like a job handle it holds only the id: ``client.batch(id)`` gets it back in a new process."""

from __future__ import annotations

import builtins
import json
from collections.abc import AsyncIterator

import aiohttp

from dsec.client.sdk.sandbox import AsyncSandbox
from dsec.client.sdk.transport import Api, Response, _raise_for
from dsec.shared.wire.batches import BatchCounts, BatchInfo, BatchItem
from dsec.shared.wire.models import SandboxInfo, SandboxState, parse_sandbox_id

PAGE = 5000


class AsyncBatch:
    def __init__(self, client: Api, info: BatchInfo) -> None:
        self._client = client
        self.info = info
        self.id = info.id

    def __repr__(self) -> str:
        return f"<AsyncBatch {self.id} {self.info.state} {self.info.counts}>"

    @property
    def _base(self) -> str:
        return f"/v1/batches/{self.id}"

    async def get(self, offset: int = 0, limit: int = 0) -> BatchInfo:
        """Its counts now, and items offset..offset+limit."""
        self.info = BatchInfo.model_validate(await self._client._json(
            "GET", self._base, params={"offset": offset, "limit": limit}))
        return self.info

    async def progress(self, *, timeout: float = 3600.0) -> AsyncIterator[BatchCounts]:
        """Its counts now, then each time they change, until every item has an outcome."""
        resp = await self._client._open("GET", f"{self._base}/events", {
            "timeout": aiohttp.ClientTimeout(total=timeout)}, timeout)
        async with resp:
            if resp.status >= 400:
                _raise_for(Response(resp.status, await resp.read()), "GET", f"{self._base}/events")
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        self.info = BatchInfo.model_validate(json.loads(line))
                        yield self.info.counts

    async def wait(self, *, timeout: float = 3600.0) -> BatchInfo:
        """Until every item has an outcome (made, failed or cancelled)."""
        async for _ in self.progress(timeout=timeout):
            pass
        return await self.get()

    async def items(self) -> builtins.list[BatchItem]:
        """Every item's state and outcome, in index order (paged from the platform)."""
        out: list[BatchItem] = []
        offset: int | None = 0
        while offset is not None:
            page = await self.get(offset, PAGE)
            out += page.items
            offset = page.next_offset
        return out

    async def result(self, *, timeout: float = 3600.0
                     ) -> tuple[builtins.list[AsyncSandbox], builtins.list[BatchItem]]:
        """Once it ends: the sandboxes made (handles, in item order) and the items that were not
        (failed with their ``error`` and ``reason``, or cancelled). A batch not made all or
        nothing may have both; an all-or-nothing one that ``failed`` stopped what it made.
        A sandbox made and stopped since is still listed (its item's outcome was made)."""
        await self.wait(timeout=timeout)
        items = await self.items()
        # a handle needs only the id: its ``info`` is a stub until ``refresh()`` (one GET each)
        made = [AsyncSandbox(self._client, SandboxInfo.model_construct(
            sandbox_id=i.sandbox_id, edge=parse_sandbox_id(i.sandbox_id), state=SandboxState.running,
            labels={}, job=self.info.job)) for i in items if i.sandbox_id]
        return made, [i for i in items if not i.sandbox_id]

    async def cancel(self, stop: bool = False) -> BatchInfo:
        """Queued items are cancelled; the sandboxes made stay, unless ``stop``."""
        self.info = BatchInfo.model_validate(await self._client._json(
            "POST", f"{self._base}/cancel", params={"stop": str(stop).lower()}))
        return self.info
