"""Placement: filter the watcher's view to eligible edges (healthy, not cordoned, ok before
suspect: dsec.control.health), then power-of-k choices
(sample k, take the least loaded). Each engine overlays its own in-flight placements
on the last snapshot, so a burst does not pile onto the node that looked emptiest a
second ago, and the room gangs hold for their items (:class:`Plan`). No durable state."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dsec.shared import tracing
from dsec.shared.admission import Demand, Room, refusal
from dsec.shared.errors import AdmissionRejected
from dsec.shared.wire.models import NodeStats

# a placement no snapshot has shown this long is forgotten (its edge's count may have
# grown and shrunk meanwhile, so the counts alone cannot always tell)
RECENT_TTL_S = 5.0


@dataclass
class _InFlight:
    cpu: float = 0.0
    memory_mb: int = 0
    count: int = 0


@dataclass
class Plan:
    """Edge room a gang (a batch made all or nothing) holds on this engine: how many of its
    items each edge still keeps room for, until they take it or the gang ends."""

    left: dict[str, int]
    cpu: float
    memory_mb: int

    @property
    def held(self) -> int:
        return sum(self.left.values())


class Placement:
    def __init__(self, view: Callable[[], dict[str, NodeStats]], k: int = 2, rng: random.Random | None = None) -> None:
        self._view = view
        self.k = k
        self.rng = rng or random.Random()
        self.in_flight: dict[str, _InFlight] = {}
        # placements that finished since the snapshot was taken: they count against an
        # edge's room until the next snapshot (as before), and in ranking edges until a
        # snapshot's counts show them or RECENT_TTL_S pass (``_unseen``): a snapshot taken
        # while a create was finishing does not show that sandbox, and forgetting it then
        # let a quick run of creates pile onto one edge. Only the ranking waits that long:
        # a create after a stop must not be refused for a sandbox that is gone
        self._recent: dict[str, _InFlight] = {}
        self._unseen: dict[str, _InFlight] = {}
        self._unseen_at: dict[str, float] = {}
        self._seen: dict[str, NodeStats] = {}
        self._snapshot_id = 0
        # room gangs hold for items not yet placed: counted by every placement until taken
        self.planned: dict[str, _InFlight] = {}
        self._grouped_for: dict[str, NodeStats] | None = None
        self._grouped_n = 0
        self._grouped: dict[str, tuple[list[NodeStats], list[NodeStats]]] = {}

    def _snapshot(self) -> dict[str, NodeStats]:
        view = self._view()
        if id(view) != self._snapshot_id:
            self._snapshot_id = id(view)
            self._recent.clear()
            self._settle(view)
        return view

    def _settle(self, view: dict[str, NodeStats]) -> None:
        """A new snapshot: forget the unseen placements it shows."""
        now = time.monotonic()
        for edge, rec in list(self._unseen.items()):
            old, new = self._seen.get(edge), view.get(edge)
            shown = new.sandboxes - old.sandboxes if old is not None and new is not None else rec.count
            if new is None or shown >= rec.count or now - self._unseen_at[edge] > RECENT_TTL_S:
                del self._unseen[edge], self._unseen_at[edge]
            elif shown > 0:
                keep = (rec.count - shown) / rec.count
                self._unseen[edge] = _InFlight(rec.cpu * keep, int(rec.memory_mb * keep), rec.count - shown)
        self._seen = dict(view)

    def _room(self, st: NodeStats, unseen: bool = False) -> Room:
        """``st``'s room with this engine's in-flight and recent placements reserved on it;
        ``unseen``: with those no snapshot has shown yet (for ranking, not refusing)."""
        parts = [self.in_flight, self.planned, self._unseen if unseen else self._recent]  # (the unseen hold the recent)
        cpu = sum(d[st.edge].cpu for d in parts if st.edge in d)
        mem = sum(d[st.edge].memory_mb for d in parts if st.edge in d)
        count = sum(d[st.edge].count for d in parts if st.edge in d)
        return Room.of(st, cpu, mem, count)

    def _groups(self, backend: str) -> tuple[list[NodeStats], list[NodeStats]]:
        """The snapshot's healthy, uncordoned edges with ``backend``: the ``ok`` ones and the
        others (suspect). Kept per snapshot and backend: filtering every edge per create was
        0.66 ms of a replica's CPU at 160 edges (bench/scale.py)."""
        view = self._snapshot()
        if view is not self._grouped_for or len(view) != self._grouped_n:  # (held: its id is no other's)
            self._grouped_for, self._grouped_n, self._grouped = view, len(view), {}
        got = self._grouped.get(backend)
        if got is None:
            live = [st for st in view.values() if st.healthy and not st.cordoned and st.health != "cordoned"
                    and backend in [b.value for b in st.backends]]
            got = self._grouped[backend] = ([st for st in live if st.health == "ok"],
                                            [st for st in live if st.health != "ok"])
        return got

    def _pick(self, group: list[NodeStats], args: Demand, exclude: set[str]) -> list[NodeStats]:
        """Up to k edges of ``group`` with room, drawn uniformly among those that have it,
        checking room only on the edges drawn (a few, not every edge, while most have room)."""
        n, picked, tried = len(group), list[NodeStats](), set[int]()
        order: list[int] | None = None
        while len(picked) < self.k and len(tried) < n:
            if order is None and len(tried) * 2 < n:
                i = self.rng.randrange(n)
                if i in tried:
                    continue
            else:  # most tried (most full): the rest in a random order
                if order is None:
                    order = [j for j in range(n) if j not in tried]
                    self.rng.shuffle(order)
                if not order:
                    break
                i = order.pop()
            tried.add(i)
            st = group[i]
            if self._view().get(st.edge) is not st:  # the view was changed in place: grouped again
                raise _Stale
            if st.edge not in exclude and refusal(self._room(st), args) is None:
                picked.append(st)
        return picked

    def choose(self, args: Demand, exclude: set[str] | None = None) -> str:
        """Power-of-k: k edges drawn among the ``ok`` ones with room (a ``suspect`` edge gets
        work only when no ok edge has room), the least loaded of them."""
        try:
            ok, suspect = self._groups(args.backend)
            sample = self._pick(ok, args, exclude or set()) or self._pick(suspect, args, exclude or set())
        except _Stale:
            self._grouped_for = None
            ok, suspect = self._groups(args.backend)
            sample = self._pick(ok, args, exclude or set()) or self._pick(suspect, args, exclude or set())
        if not sample:
            tracing.annotate(candidates=0)
            raise AdmissionRejected("no healthy edge has room for this sandbox "
                                    f"(asks {args.cpu_admitted:g} cores, {args.memory_admitted_mb} MiB)")
        # on the caller's placement.choose span (control/apiserver/core.py) when tracing is on
        tracing.annotate(candidates=len(ok) + len(suspect), sampled=len(sample))
        return min(sample, key=lambda st: (self._room(st, unseen=True).load(),
                                           self._room(st, unseen=True).sandboxes)).edge

    def plan(self, args: Demand, n: int) -> Plan:
        """Room for all ``n`` sandboxes of ``args`` on the edges this engine sees, spread in
        proportion to each edge's room and held (against every other placement here) until
        the items take it (:meth:`take`) or the gang lets it go (:meth:`release`); or
        AdmissionRejected saying how many of the ``n`` there is room for, holding nothing.
        Suspect edges count (a gang would rather wait on one than not start); cordoned,
        unhealthy ones do not. The edges still have the final word on each item."""
        cands = [st for st in self._snapshot().values()
                 if st.healthy and not st.cordoned and st.health != "cordoned"
                 and args.backend in [b.value for b in st.backends]]
        fits = {st.edge: self._room(st).fits(args) for st in cands}
        total = sum(fits.values())
        tracing.annotate(candidates=len(cands), room=total)
        if total < n:
            raise AdmissionRejected(
                f"the fleet has room for {total} of these {n} sandboxes now ({sum(1 for f in fits.values() if f)} of "
                f"{len(cands)} edges have room; each asks {args.cpu_admitted:g} cores and {args.memory_admitted_mb} "
                "MiB): nothing was created", field="n")
        share = {e: n * f / total for e, f in fits.items() if f}
        left = {e: math.floor(v) for e, v in share.items()}
        # the largest remainders take the rest; no edge gets more than it fits (n <= total)
        for e in sorted(share, key=lambda e: share[e] - left[e], reverse=True)[:n - sum(left.values())]:
            left[e] += 1
        plan = Plan({e: k for e, k in left.items() if k}, args.cpu_admitted, args.memory_admitted_mb)
        for e, k in plan.left.items():
            p = self.planned.setdefault(e, _InFlight())
            p.cpu += k * plan.cpu
            p.memory_mb += k * plan.memory_mb
            p.count += k
        return plan

    def take(self, plan: Plan) -> str | None:
        """The edge for a gang's next item (where its plan holds the most room; that room
        becomes the item's own reservation), None once the plan is spent."""
        if not plan.left:
            return None
        edge = max(plan.left, key=plan.left.__getitem__)
        self._unplan(plan, edge, 1)
        return edge

    def release(self, plan: Plan) -> None:
        """The gang needs no more of its room (it ended, failed or was cancelled)."""
        for edge, k in list(plan.left.items()):
            self._unplan(plan, edge, k)

    def _unplan(self, plan: Plan, edge: str, k: int) -> None:
        plan.left[edge] -= k
        if plan.left[edge] <= 0:
            del plan.left[edge]
        p = self.planned[edge]
        p.cpu -= k * plan.cpu
        p.memory_mb -= k * plan.memory_mb
        p.count -= k
        if p.count <= 0:
            del self.planned[edge]

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
                self._unseen_at[edge] = time.monotonic()
                for d in (self._recent, self._unseen):
                    rec = d.setdefault(edge, _InFlight())
                    rec.cpu += args.cpu_admitted
                    rec.memory_mb += args.memory_admitted_mb
                    rec.count += 1


class _Stale(Exception):
    """The view changed in place since its edges were grouped."""
