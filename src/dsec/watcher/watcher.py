"""The watcher: polls every edge for health and load and keeps the fleet view that
placement decides on. It holds nothing durable: after a restart the first poll
rebuilds the view from scratch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Protocol

from dsec.edge.api import EdgeAPI
from dsec.wire.models import NodeStats

log = logging.getLogger("dsec.watcher")


class FleetView(Protocol):
    """What placement and the apiserver read: each edge's last known health and load.
    The Watcher polls edges itself (one apiserver); a cluster replica reads the view the
    controller's watcher shares (dsec.cluster.view)."""

    view: dict[str, NodeStats]

    async def refresh(self) -> dict[str, NodeStats]: ...
    def start(self) -> None: ...
    async def close(self) -> None: ...


async def poll_stats(name: str, edge: EdgeAPI, timeout_s: float) -> NodeStats | None:
    """One edge's stats, or None (logged) when it does not answer in time."""
    try:
        return await asyncio.wait_for(edge.stats(), timeout_s)
    except Exception as e:  # an edge that cannot answer is unhealthy, whatever the cause
        log.warning("edge %s unhealthy: %s", name, e)
        return None


class Refresher:
    """Runs ``refresh`` every ``interval_s`` in a task of its own until closed."""

    interval_s: float
    _task: asyncio.Task[None] | None = None

    async def refresh(self) -> dict[str, NodeStats]:
        raise NotImplementedError

    async def _loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


class Watcher(Refresher):
    def __init__(self, edges: Mapping[str, EdgeAPI], interval_s: float = 1.0, timeout_s: float = 2.0) -> None:
        self.edges = edges
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.view: dict[str, NodeStats] = {}
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> dict[str, NodeStats]:
        results = await asyncio.gather(*(poll_stats(n, e, self.timeout_s) for n, e in self.edges.items()))
        view = {}
        for (name, _), st in zip(self.edges.items(), results, strict=True):
            if st is None:
                old = self.view.get(name)
                if old is not None:
                    st = old.model_copy(update={"healthy": False})
                else:
                    continue
            view[name] = st
        self.view = view
        return view
