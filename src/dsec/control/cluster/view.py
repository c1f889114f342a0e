"""The cluster as one apiserver replica (or the controller) sees it: the edges in the
registry (a remote client for each active one, a LostEdge for each lost one) and the
fleet view placement decides on.

The controller's watcher polls every edge once a second and writes what it learns to
the registry; a replica reads that (one query a second, however many edges) instead of
polling every edge itself. Should the controller stop writing (it is restarting), a
replica polls the edges whose stats went stale itself, so placement never goes blind."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Iterator, Mapping

from sqlalchemy.exc import SQLAlchemyError

from dsec.control.cluster.lost import lost_edge
from dsec.control.health.detector import Detector, Settings
from dsec.control.health.fleet import FleetHealth, overlay
from dsec.control.watcher.watcher import Refresher, poll_stats
from dsec.node.edge.api import EdgeAPI
from dsec.node.edge.remote.client import RemoteEdge, remote_edge
from dsec.shared.meta.registry import EdgeRow, Registry
from dsec.shared.wire.models import NodeStats, parse_sandbox_id

log = logging.getLogger("dsec.cluster")
STALE_S = 5.0  # stats older than this are polled afresh (replica) or mark the edge unhealthy
POLL_TIMEOUT_S = 2.0
OWN_MOVES_S = 10.0  # a move this process made outranks the index read this long


class ClusterEdges(Refresher, Mapping[str, EdgeAPI]):
    """``poll=True`` (the controller): poll every active edge and write the view to the
    registry. ``poll=False`` (a replica): read the view, polling only stale edges."""

    def __init__(self, registry: Registry, secret: str, poll: bool = False, interval_s: float = 1.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.registry, self.secret, self.poll, self.interval_s = registry, secret, poll, interval_s
        self.tls = tls  # the client side of the edges' mutual TLS (their URLs are https://)
        self._edges: dict[str, EdgeAPI] = {}
        self._urls: dict[str, str] = {}
        self.rows: dict[str, EdgeRow] = {}
        self.view: dict[str, NodeStats] = {}
        self.moved: dict[str, str] = {}  # sandboxes restored or drained off the edge their id names
        self._own_moves: dict[str, tuple[str, float]] = {}
        # the poller judges every edge's health each round; a replica reads the verdicts
        self.health = FleetHealth(registry, Detector(Settings.from_env()))

    def __getitem__(self, name: str) -> EdgeAPI:
        return self._edges[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._edges))

    def __len__(self) -> int:
        return len(self._edges)

    def holder(self, sandbox_id: str) -> str | None:
        """Where a moved sandbox runs now (dsec.control.apiserver.core.Routes)."""
        return self.moved.get(sandbox_id)

    def moved_here(self, sandbox_id: str, edge: str) -> None:
        self._own_moves[sandbox_id] = (edge, time.monotonic())
        if parse_sandbox_id(sandbox_id) == edge:  # back on the edge its id names
            self.moved.pop(sandbox_id, None)
        else:
            self.moved[sandbox_id] = edge

    def _forward(self, sandbox_id: str) -> EdgeAPI | None:
        """For a lost edge's stand-in: the edge a sandbox moved to since this replica last
        read the moves (a blocking read: the stand-in calls it in a thread)."""
        name = self.registry.holder(sandbox_id)
        return self._edges.get(name) if name else None

    def active(self) -> dict[str, EdgeAPI]:
        return {n: e for n, e in self._edges.items() if self.rows[n].state == "active"}

    async def _sync(self, rows: list[EdgeRow]) -> None:
        """Clients for what the registry now says (an edge that moved gets a new one)."""
        self.rows = {r.name: r for r in rows if r.state != "removed"}
        for name in [n for n in self._edges if n not in self.rows]:
            await self._drop(name)
        for r in self.rows.values():
            key = r.url if r.state == "active" else f"lost:{r.reason}"
            if self._urls.get(r.name) == key:
                continue
            await self._drop(r.name)
            self._edges[r.name] = (remote_edge(r.name, r.url, self.secret, self.tls) if r.state == "active"
                                   else lost_edge(r.name, r.reason, self.registry, self._forward))
            self._urls[r.name] = key

    async def _drop(self, name: str) -> None:
        old = self._edges.pop(name, None)
        self._urls.pop(name, None)
        if isinstance(old, RemoteEdge):
            await old.close()

    async def refresh(self) -> dict[str, NodeStats]:
        try:
            rows = await asyncio.to_thread(self.registry.edges)
        except SQLAlchemyError as e:  # the database is away: keep routing by what we knew
            log.warning("registry not read: %s", e)
            return self.view
        await self._sync(rows)
        try:
            moved = await asyncio.to_thread(self.registry.holders)
            # this process's own moves of the last seconds win over a read that may predate them
            now = time.monotonic()
            for sid, (edge, at) in list(self._own_moves.items()):
                if now - at > OWN_MOVES_S:
                    del self._own_moves[sid]
                elif parse_sandbox_id(sid) == edge:
                    moved.pop(sid, None)
                else:
                    moved[sid] = edge
            self.moved = moved
        except SQLAlchemyError as e:
            log.warning("moved sandboxes not read: %s", e)
        now = time.time()
        view: dict[str, NodeStats] = {}
        stale: list[str] = []
        for name, r in self.rows.items():
            if r.state != "active":
                continue
            if not self.poll and r.stats is not None and r.stats_at is not None and now - r.stats_at < STALE_S:
                view[name] = r.stats
            else:
                stale.append(name)
        polled = await asyncio.gather(*(poll_stats(n, self._edges[n], POLL_TIMEOUT_S) for n in stale))
        for name, st in zip(stale, polled, strict=True):
            if st is not None:
                view[name] = st
            else:
                known = self.view.get(name) or self.rows[name].stats
                if known is not None:
                    view[name] = known.model_copy(update={"healthy": False})
        judged = self.rows
        if self.poll:
            try:
                await asyncio.to_thread(self.registry.put_stats, view)
                # every edge here is active: Ray has its node alive (a dead one's is lost)
                judged = {**judged, **await self.health.round(dict(zip(stale, polled, strict=True)), self._edges,
                                                         self.rows)}
            except SQLAlchemyError as e:
                log.warning("fleet view not written: %s", e)
        self.view = overlay(view, judged)
        return self.view

    async def close(self) -> None:
        await super().close()
        for name in list(self._edges):
            await self._drop(name)
