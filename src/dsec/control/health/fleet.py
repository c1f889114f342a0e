"""The fleet's health as records and actions (TRANSOM's TOL, without drain): runs the
detector over each round's polls, writes its verdicts to the registry's ``edges`` rows,
leaves a fleet event for every change with its evidence, keeps each edge's cordon as the
registry has it, and serves the operator's cordon and uncordon.

Who runs a round: whoever polls the edges (the Watcher of ``dsec serve`` and ``dsec
apiserver --edges``; the cluster controller's ClusterEdges). Everyone else (an apiserver
replica) only reads the rows, and acts on them through :meth:`cordon` / :meth:`uncordon`.

The registry is the truth for cordons: a cordon set by an operator on any replica is seen
by the detector's next round and never undone by it; a detector's cordon an operator
lifted starts that edge's history afresh. An edge keeps its cordon in memory only, so
every round asserts it again where an edge answered without it (an edge restarted)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from dsec.control.health.detector import Detector, Verdict
from dsec.control.health.events import FleetEvents
from dsec.node.edge.api import EdgeAPI
from dsec.shared.errors import NotFound
from dsec.shared.meta.registry import EdgeRow, Registry
from dsec.shared.wire.models import NodeStats

log = logging.getLogger("dsec.health")
DETECTOR = "detector"
SET_CORDON_TIMEOUT_S = 5.0


class FleetHealth:
    def __init__(self, registry: Registry, detector: Detector | None = None, min_round_s: float = 0.9) -> None:
        self.registry = registry
        self.events = FleetEvents(registry.db)
        self.detector = detector or Detector()
        # a read of the fleet (GET /v1/nodes polls afresh) is no extra round: the detector
        # counts rounds, and two at once would both record one change
        self.min_round_s = min_round_s
        self._lock = asyncio.Lock()
        self._last = 0.0
        self._rows: dict[str, EdgeRow] = {}
        self._seeded: set[str] = set()

    # ---- a round (the poller) ------------------------------------------------------
    async def round(self, polled: Mapping[str, NodeStats | None], edges: Mapping[str, EdgeAPI],
                    rows: Mapping[str, EdgeRow] | None = None, alive: Mapping[str, bool] | None = None
                    ) -> dict[str, EdgeRow]:
        """Judge this round's polls (None: no answer) and act; returns the rows as they now
        are. ``rows``: the registry's, when the caller just read them."""
        async with self._lock:
            if time.monotonic() - self._last < self.min_round_s:
                return self._rows
            self._rows = await self._round(polled, edges, rows, alive)
            self._last = time.monotonic()
            return self._rows

    async def _round(self, polled: Mapping[str, NodeStats | None], edges: Mapping[str, EdgeAPI],
                     rows: Mapping[str, EdgeRow] | None, alive: Mapping[str, bool] | None) -> dict[str, EdgeRow]:
        if rows is None:
            rows = {r.name: r for r in await asyncio.to_thread(self.registry.edges)}
        rows = {n: rows[n] for n in polled if n in rows}
        self._follow(rows)
        verdicts = self.detector.observe(time.time(), polled, alive)
        now_rows = dict(rows)
        for name, v in verdicts.items():
            row = rows.get(name)
            if row is None or row.cordoned_by not in ("", DETECTOR):
                continue  # an operator's cordon: theirs to lift
            if v.health != row.health:
                now_rows[name] = await asyncio.to_thread(self._record, row, v)
        await self._assert_cordons(polled, edges, now_rows)
        return now_rows

    def _follow(self, rows: Mapping[str, EdgeRow]) -> None:
        """Bring the detector to what the registry says (another process, an operator)."""
        for name, row in rows.items():
            mine = self.detector.health(name)
            if name not in self._seeded:  # the first round here: take up the recorded verdict
                self._seeded.add(name)
                if row.cordoned_by in ("", DETECTOR) and row.health != "ok":
                    self.detector.seed(name, row.health, row.health_at or time.time())
            elif mine == "cordoned" and row.cordoned_by != DETECTOR:
                self.detector.reset(name)  # an operator lifted (or took over) the detector's cordon

    def _record(self, row: EdgeRow, v: Verdict) -> EdgeRow:
        by = DETECTOR if v.health == "cordoned" else ""
        reason = v.reason if v.health != "ok" else f"clear again (was: {row.health_reason})"
        if not self.registry.set_health(row.name, v.health, reason if v.health != "ok" else "", v.evidence, by,
                                        only_if_by=("", DETECTOR)):
            return row  # an operator cordoned it meanwhile
        kind = {"ok": "recovered", "suspect": "suspect", "cordoned": "cordoned"}[v.health]
        self.events.record(row.name, kind, DETECTOR, reason,
                           detail={"evidence": [e.model_dump() for e in v.evidence], "was": row.health})
        log.warning("edge %s %s: %s", row.name, v.health, reason)
        return row.model_copy(update={"health": v.health, "health_reason": reason if v.health != "ok" else "",
                                      "evidence": v.evidence, "cordoned_by": by, "health_at": time.time()})

    async def _assert_cordons(self, polled: Mapping[str, NodeStats | None], edges: Mapping[str, EdgeAPI],
                              rows: Mapping[str, EdgeRow]) -> None:
        calls = []
        for name, st in polled.items():
            row = rows.get(name)
            if st is None or row is None or name not in edges:
                continue
            want = row.health == "cordoned"
            if st.cordoned != want:
                calls.append(self._set_cordon(edges[name], want, row.health_reason))
        await asyncio.gather(*calls)

    @staticmethod
    async def _set_cordon(edge: EdgeAPI, cordoned: bool, reason: str) -> bool:
        try:
            await asyncio.wait_for(edge.set_cordon(cordoned, reason), SET_CORDON_TIMEOUT_S)
            return True
        except Exception as e:  # the edge is away: the next round asserts it again
            log.warning("edge %s: cordon %s not set: %s", edge.name, cordoned, e)
            return False

    # ---- what an operator does (any apiserver) --------------------------------------
    async def row(self, name: str) -> EdgeRow:
        rows = {r.name: r for r in await asyncio.to_thread(self.registry.edges) if r.state != "removed"}
        if name not in rows:
            raise NotFound(f"no edge {name!r} in this fleet", field="name")
        return rows[name]

    async def cordon(self, name: str, reason: str, actor: str, edge: EdgeAPI | None) -> EdgeRow:
        """Cordon ``name`` for ``actor`` (a token id): held until an operator lifts it,
        whatever the detector finds. The edge hears it now where it answers, else at the
        poller's next round."""
        row = await self.row(name)
        await asyncio.to_thread(self.registry.set_health, name, "cordoned", reason, row.evidence, actor)
        await asyncio.to_thread(self.events.record, name, "cordoned", actor, reason,
                                detail={"was": row.health, "by_hand": True})
        if edge is not None:
            await self._set_cordon(edge, True, reason)
        return await self.row(name)

    async def uncordon(self, name: str, actor: str, edge: EdgeAPI | None, reason: str = "") -> EdgeRow:
        """Lift a cordon (anyone's) and the detector's verdict: the edge is ok until the
        detector finds it anomalous again."""
        row = await self.row(name)
        why = reason or "uncordoned by hand"
        await asyncio.to_thread(self.registry.set_health, name, "ok", "", [], "")
        await asyncio.to_thread(self.events.record, name, "uncordoned", actor, why,
                                detail={"was": row.health, "cordoned_by": row.cordoned_by,
                                        "reason_was": row.health_reason})
        if edge is not None:
            await self._set_cordon(edge, False, "")
        return await self.row(name)


def overlay(view: Mapping[str, NodeStats], rows: Mapping[str, EdgeRow]) -> dict[str, NodeStats]:
    """The fleet view with each edge's health and cordon as the registry has them (what
    placement decides on), not as the edge last said: an edge hears of a change a round
    later at worst, and its own admission refuses meanwhile."""
    out = {}
    for name, st in view.items():
        row = rows.get(name)
        if row is not None:
            st = st.model_copy(update={"health": row.health, "cordoned": row.health == "cordoned"})
        out[name] = st
    return out
