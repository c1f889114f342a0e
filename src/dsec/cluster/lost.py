"""What stands in for an edge whose node is lost: its sandboxes, from the cluster's
index, reported ``failed`` with the reason; a stop forgets one; everything else is
EdgeUnavailable naming the loss. The apiserver sees it as one more edge, so routing,
lists and job operations need no special case."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from dsec.edge import api
from dsec.edge.remote.ops import Op, ops
from dsec.errors import EdgeUnavailable, NotFound
from dsec.meta.registry import Registry
from dsec.wire.models import SandboxInfo


class LostEdge(api.SandboxOps, api.ExecOps, api.FileOps, api.NetworkOps, api.NodeOps, api.LayerOps,
               api.FnCallOps):
    def __init__(self, name: str, reason: str, registry: Registry) -> None:
        self.name, self.reason, self.registry = name, reason, registry

    def unavailable(self, sandbox_id: str | None = None) -> EdgeUnavailable:
        return EdgeUnavailable(f"edge {self.name} was lost ({self.reason}); its sandboxes failed with it",
                               sandbox_id=sandbox_id)

    async def _lost(self) -> list[SandboxInfo]:
        return await asyncio.to_thread(self.registry.lost, self.name)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        for info in await self._lost():
            if info.sandbox_id == sandbox_id:
                return info
        raise NotFound(f"no sandbox {sandbox_id!r} (its edge {self.name} was lost)", field="sandbox_id")

    async def list_sandboxes(self, job: str | None = None, labels: dict[str, str] | None = None,
                             usage: bool = False) -> list[SandboxInfo]:
        want = (labels or {}).items()
        return [i for i in await self._lost()
                if (job is None or i.job == job) and all(i.labels.get(k) == v for k, v in want)]

    async def stop(self, sandbox_id: str) -> SandboxInfo:
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
            raise self.unavailable(sandbox_of(args, kwargs))
            yield  # an async generator, like every stream of the contract
        fn: Any = stream
    else:
        async def call(self: LostEdge, *args: Any, **kwargs: Any) -> Any:
            raise self.unavailable(sandbox_of(args, kwargs))
        fn = call
    fn.__name__ = fn.__qualname__ = op.name
    return fn


for _name, _op in ops().items():
    if _name not in LostEdge.__dict__:
        setattr(LostEdge, _name, _refusing(_op))


def lost_edge(name: str, reason: str, registry: Registry) -> LostEdge:
    return LostEdge(name, reason, registry)  # type: ignore[abstract]
