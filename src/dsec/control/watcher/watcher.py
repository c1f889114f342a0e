"""The watcher: polls every edge for health and load and keeps the fleet view that
placement decides on. It holds nothing durable: after a restart the first poll
rebuilds the view from scratch. Each round goes through the fleet's health detector
(dsec.control.health.fleet), whose verdicts and cordons live in the metadata database."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError

from dsec.control.health.fleet import FleetHealth, overlay
from dsec.node.edge.api import EdgeAPI
from dsec.shared.meta.registry import EdgeRow
from dsec.shared.wire.models import NodeStats

log = logging.getLogger("dsec.watcher")


class FleetView(Protocol):
    """What placement and the apiserver read: each edge's last known health and load.
    The Watcher polls edges itself (one apiserver); a cluster replica reads the view the
    controller's watcher shares (dsec.control.cluster.view)."""

    view: dict[str, NodeStats]

    @property
    def health(self) -> FleetHealth | None:
        """The edges' health records and the operator's cordons (None: not kept)."""

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
    """Polls edges named by hand (``dsec serve``'s own, ``dsec apiserver --edges``). With
    ``health``, each gets an ``edges`` row in that database (registered at its first
    round) for its verdict and cordon, so a cordon outlives an apiserver restart."""

    def __init__(self, edges: Mapping[str, EdgeAPI], interval_s: float = 1.0, timeout_s: float = 2.0,
                 health: FleetHealth | None = None) -> None:
        self.edges = edges
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.health = health
        self.view: dict[str, NodeStats] = {}
        self.rows: dict[str, EdgeRow] = {}
        self._registered: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> dict[str, NodeStats]:
        results = await asyncio.gather(*(poll_stats(n, e, self.timeout_s) for n, e in self.edges.items()))
        polled = dict(zip(self.edges, results, strict=True))
        view = {}
        for name, st in polled.items():
            if st is None:
                old = self.view.get(name)
                if old is not None:
                    st = old.model_copy(update={"healthy": False})
                else:
                    continue
            view[name] = st
        if self.health is not None:
            try:
                await self._register()
                self.rows = await self.health.round(polled, self.edges)
            except SQLAlchemyError as e:  # the database is away: judge again next round
                log.warning("edge health not judged: %s", e)
            view = overlay(view, self.rows)
        self.view = view
        return view

    async def _register(self) -> None:
        assert self.health is not None
        for name in [n for n in self.edges if n not in self._registered]:
            url = getattr(self.edges[name], "url", "in-process")
            await asyncio.to_thread(self.health.registry.ensure, name, url)
            self._registered.add(name)
