"""Placement: filter the watcher's view to eligible edges (healthy, not cordoned, ok before
suspect: dsec.health), then power-of-k choices
(sample k, take the least loaded). Each engine overlays its own in-flight placements
on the last snapshot, so a burst does not pile onto the node that looked emptiest a
second ago. No durable state."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dsec import tracing
from dsec.errors import AdmissionRejected
from dsec.placement.admission import Demand, Room, refusal
from dsec.wire.models import NodeStats

# a placement no snapshot has shown this long is forgotten (its edge's count may have
# grown and shrunk meanwhile, so the counts alone cannot always tell)
RECENT_TTL_S = 5.0


@dataclass
class _InFlight:
    cpu: float = 0.0
    memory_mb: int = 0
    count: int = 0


class Placement:
    def __init__(self, view: Callable[[], dict[str, NodeStats]], k: int = 2, rng: random.Random | None = None) -> None:
        self._view = view
        self.k = k
        self.rng = rng or random.Random()
        self.in_flight: dict[str, _InFlight] = {}
        # placements that finished since the snapshot was taken still count until a
        # snapshot shows them (its edge's sandbox count grew by as many), or RECENT_TTL_S
        self._recent: dict[str, _InFlight] = {}
        self._recent_at: dict[str, float] = {}
        self._seen: dict[str, NodeStats] = {}
        self._snapshot_id = 0

    def _snapshot(self) -> dict[str, NodeStats]:
        view = self._view()
        if id(view) != self._snapshot_id:
            self._snapshot_id = id(view)
            self._settle(view)
        return view

    def _settle(self, view: dict[str, NodeStats]) -> None:
        """A new snapshot: forget the recent placements it shows. Not all of them, blindly:
        a snapshot taken while a create was finishing does not show that sandbox yet, and
        clearing it anyway let a quick run of creates pile onto one edge."""
        now = time.monotonic()
        for edge, rec in list(self._recent.items()):
            old, new = self._seen.get(edge), view.get(edge)
            shown = new.sandboxes - old.sandboxes if old is not None and new is not None else rec.count
            if new is None or shown >= rec.count or now - self._recent_at[edge] > RECENT_TTL_S:
                del self._recent[edge], self._recent_at[edge]
            elif shown > 0:
                keep = (rec.count - shown) / rec.count
                self._recent[edge] = _InFlight(rec.cpu * keep, int(rec.memory_mb * keep), rec.count - shown)
        self._seen = dict(view)

    def _overlay(self, edge: str) -> _InFlight:
        a = self.in_flight.get(edge, _InFlight())
        b = self._recent.get(edge, _InFlight())
        return _InFlight(a.cpu + b.cpu, a.memory_mb + b.memory_mb, a.count + b.count)

    def _room(self, st: NodeStats) -> Room:
        inf = self._overlay(st.edge)
        return Room.of(st, inf.cpu, inf.memory_mb, inf.count)

    def eligible(self, args: Demand, exclude: set[str]) -> list[NodeStats]:
        """Healthy, uncordoned edges with the backend and room; only ``ok`` ones while any
        has room (a ``suspect`` edge gets work only when no ok edge can take it)."""
        cands = [st for st in self._snapshot().values()
                 if st.healthy and not st.cordoned and st.health != "cordoned" and st.edge not in exclude
                 and args.backend in [b.value for b in st.backends] and refusal(self._room(st), args) is None]
        ok = [st for st in cands if st.health == "ok"]
        return ok or cands

    def choose(self, args: Demand, exclude: set[str] | None = None) -> str:
        cands = self.eligible(args, exclude or set())
        if not cands:
            tracing.annotate(candidates=0)
            raise AdmissionRejected("no healthy edge has room for this sandbox "
                                    f"(asks {args.cpu_admitted:g} cores, {args.memory_admitted_mb} MiB)")
        sample = self.rng.sample(cands, min(self.k, len(cands)))
        # on the caller's placement.choose span (apiserver/core.py) when tracing is on
        tracing.annotate(candidates=len(cands), sampled=len(sample))
        return min(sample, key=lambda st: self._room(st).load()).edge

    @contextlib.contextmanager
    def reserve(self, edge: str, args: Demand) -> Iterator[None]:
        inf = self.in_flight.setdefault(edge, _InFlight())
        inf.cpu += args.cpu_admitted
        inf.memory_mb += args.memory_admitted_mb
        inf.count += 1
        ok = False
        try:
            yield
            ok = True
        finally:
            inf.cpu -= args.cpu_admitted
            inf.memory_mb -= args.memory_admitted_mb
            inf.count -= 1
            if ok:
                self._recent_at[edge] = time.monotonic()
                rec = self._recent.setdefault(edge, _InFlight())
                rec.cpu += args.cpu_admitted
                rec.memory_mb += args.memory_admitted_mb
                rec.count += 1
