"""The SDK's console face (``client.console``, docs/console.md): what the web console and
``dsec top`` read, typed. The fleet at a glance (edges with load and health, the caller's
sandboxes by state, the recent history), a sandbox query the edges answer for themselves
(filtered, sorted by CPU time or memory, paged), the newest batches with their failures,
FnCall pool occupancy and the layer catalog's lineage. Everything is scoped to the token's
project, as the rest of the API is."""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

from dsec.client.sdk.transport import Api
from dsec.shared.wire.batches import BatchInfo
from dsec.shared.wire.console import FleetOverview, FnCallStats, LayerCatalog, SandboxPage, SortKey


class AsyncConsole:
    def __init__(self, client: Api) -> None:
        self._client = client

    async def fleet(self, since: float = 0.0) -> FleetOverview:
        """Every edge's load and health as the watcher last saw it, the caller's sandboxes
        counted by state, backend and job (no items), the fleet's history samples taken
        after ``since`` (a time.time()), and for the cluster's admin the newest fleet events."""
        return FleetOverview.model_validate(await self._client._json("GET", "/v1/console/fleet",
                                                                     params={"since": since}))

    async def sandboxes(self, *, q: str = "", state: Sequence[str] = (), backend: Sequence[str] = (),
                        job: str | None = None, labels: dict[str, str] | None = None, project: str | None = None,
                        edge: str | None = None, sort: SortKey = "-created", offset: int = 0, limit: int = 50,
                        usage: bool = False) -> SandboxPage:
        """One page of the caller's sandboxes matching every filter given, in ``sort`` order
        (created, last_active, cpu (CPU time used) or memory; a leading '-' is descending),
        with the counts of all that match by state, backend and job. Sorting by cpu or
        memory fills each item's usage; ``usage=True`` fills it for any order."""
        params: builtins.list[tuple[str, Any]] = [("sort", sort), ("offset", offset), ("limit", limit)]
        params += [("state", s) for s in state] + [("backend", b) for b in backend]
        params += [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        params += [(k, v) for k, v in (("q", q), ("job", job), ("project", project), ("edge", edge)) if v]
        if usage:
            params.append(("usage", "true"))
        return SandboxPage.model_validate(await self._client._json("GET", "/v1/console/sandboxes", params=params))

    async def batches(self, job: str | None = None, limit: int = 20) -> builtins.list[BatchInfo]:
        """The newest batches of the caller's projects, newest first: counts by item state
        and, where items failed, why (no items)."""
        params: dict[str, Any] = {"limit": limit, **({"job": job} if job else {})}
        return [BatchInfo.model_validate(x) for x in await self._client._json("GET", "/v1/batches", params=params)]

    async def fncall(self) -> builtins.list[FnCallStats]:
        """Per edge: its FnCall pools (containers, busy workers, calls waiting) and what its
        calls came to (results by status, test cases by verdict)."""
        return [FnCallStats.model_validate(x) for x in await self._client._json("GET", "/v1/console/fncall")]

    async def layers(self, q: str = "", offset: int = 0, limit: int = 100) -> LayerCatalog:
        """The layers the caller may see, newest first, with their lineage and on-demand
        cache hit rates over all edges."""
        params: dict[str, Any] = {"offset": offset, "limit": limit, **({"q": q} if q else {})}
        return LayerCatalog.model_validate(await self._client._json("GET", "/v1/console/layers", params=params))
