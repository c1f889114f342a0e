"""What stands in for an edge whose node is lost: its sandboxes, from the cluster's
index, reported ``failed`` with the reason (``restoring`` while one comes back from its
checkpoint); a stop forgets one; everything else is EdgeUnavailable naming the loss. A
sandbox restored on another edge since the caller last read the moves is forwarded
there. The apiserver sees it as one more edge, so routing, lists and job operations need
no special case."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from dsec.node.edge import api
from dsec.node.edge.remote.ops import Op, ops
from dsec.shared.errors import EdgeUnavailable, NotFound
from dsec.shared.meta.registry import Registry
from dsec.shared.query import answer
from dsec.shared.wire.console import SandboxPage, SandboxQuery
from dsec.shared.wire.models import SandboxInfo


class LostEdge(api.SandboxOps, api.ExecOps, api.FileOps, api.NetworkOps, api.NodeOps, api.LayerOps,
               api.FnCallOps, api.FleetOps, api.SnapshotOps):
    def __init__(self, name: str, reason: str, registry: Registry,
                 forward: Callable[[str], api.EdgeAPI | None] = lambda _: None) -> None:
        self.name, self.reason, self.registry, self.forward = name, reason, registry, forward

    async def moved(self, sandbox_id: str | None) -> api.EdgeAPI | None:
        """The edge ``sandbox_id`` runs on now, if it moved off this one."""
        if not sandbox_id:
            return None
        edge = await asyncio.to_thread(self.forward, sandbox_id)
        return edge if edge is not None and edge.name != self.name else None

    def unavailable(self, sandbox_id: str | None = None) -> EdgeUnavailable:
        return EdgeUnavailable(f"edge {self.name} was lost ({self.reason}); its sandboxes failed with it",
                               sandbox_id=sandbox_id)

    async def _lost(self) -> list[SandboxInfo]:
        return await asyncio.to_thread(self.registry.lost, self.name)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        if (edge := await self.moved(sandbox_id)) is not None:
            return await edge.get(sandbox_id)
        for info in await self._lost():
            if info.sandbox_id == sandbox_id:
                return info
        raise NotFound(f"no sandbox {sandbox_id!r} (its edge {self.name} was lost)", field="sandbox_id")

    async def list_sandboxes(self, job: str | None = None, labels: dict[str, str] | None = None,
                             usage: bool = False) -> list[SandboxInfo]:
        want = (labels or {}).items()
        return [i for i in await self._lost()
                if (job is None or i.job == job) and all(i.labels.get(k) == v for k, v in want)]

    async def query_sandboxes(self, query: SandboxQuery) -> SandboxPage:
        return answer(await self._lost(), query)

    async def stop(self, sandbox_id: str) -> SandboxInfo:
        if (edge := await self.moved(sandbox_id)) is not None:
            return await edge.stop(sandbox_id)
        info = await self.get(sandbox_id)
        await asyncio.to_thread(self.registry.index_drop, [sandbox_id])
        return info

    async def layers_in_use(self) -> set[str]:
        return set()


def _refusing(op: Op) -> Any:
    def sandbox_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        sid = kwargs.get("sandbox_id", args[0] if args else None)
        return sid if isinstance(sid, str) else None

    if op.stream:
        async def stream(self: LostEdge, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            sid = sandbox_of(args, kwargs)
            if (edge := await self.moved(sid)) is None:
                raise self.unavailable(sid)
            async for item in getattr(edge, op.name)(*args, **kwargs):
                yield item
        fn: Any = stream
    else:
        async def call(self: LostEdge, *args: Any, **kwargs: Any) -> Any:
            sid = sandbox_of(args, kwargs)
            if (edge := await self.moved(sid)) is None:
                raise self.unavailable(sid)
            return await getattr(edge, op.name)(*args, **kwargs)
        fn = call
    fn.__name__ = fn.__qualname__ = op.name
    return fn


for _name, _op in ops().items():
    if _name not in LostEdge.__dict__:
        setattr(LostEdge, _name, _refusing(_op))


def lost_edge(name: str, reason: str, registry: Registry,
              forward: Callable[[str], api.EdgeAPI | None] = lambda _: None) -> LostEdge:
    return LostEdge(name, reason, registry, forward)  # type: ignore[abstract]
