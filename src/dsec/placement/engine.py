"""Placement: filter the watcher's view to eligible edges, then power-of-k choices
(sample k, take the least loaded). Each engine overlays its own in-flight placements
on the last snapshot, so a burst does not pile onto the node that looked emptiest a
second ago. No durable state."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from dsec.errors import AdmissionRejected
from dsec.models import NodeStats


class Demand(Protocol):
    """What placement needs to know of a sandbox request (any backend's args)."""

    @property
    def backend(self) -> str: ...
    @property
    def cpu_cores_limit(self) -> float: ...
    @property
    def memory_limit_mb(self) -> int: ...
    @property
    def cpu_admitted(self) -> float:
        """What a node reserves for it (its request), at most its limit."""
    @property
    def memory_admitted_mb(self) -> int: ...


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
        # placements that finished since the snapshot was taken still count until the
        # next snapshot shows them
        self._recent: dict[str, _InFlight] = {}
        self._snapshot_id = 0

    def _snapshot(self) -> dict[str, NodeStats]:
        view = self._view()
        if id(view) != self._snapshot_id:
            self._snapshot_id = id(view)
            self._recent.clear()
        return view

    def _overlay(self, edge: str) -> _InFlight:
        a = self.in_flight.get(edge, _InFlight())
        b = self._recent.get(edge, _InFlight())
        return _InFlight(a.cpu + b.cpu, a.memory_mb + b.memory_mb, a.count + b.count)

    def _load(self, st: NodeStats) -> tuple[float, float, int]:
        """(cpu fraction, memory fraction, count) after overlaying in-flight work."""
        inf = self._overlay(st.edge)
        cpu_cap = st.cpus * st.cpu_overcommit
        mem_cap = st.memory_mb * st.memory_overcommit
        return ((st.cpu_reserved + inf.cpu) / cpu_cap, (st.memory_reserved_mb + inf.memory_mb) / mem_cap,
                st.sandboxes + inf.count)

    def eligible(self, args: Demand, exclude: set[str]) -> list[NodeStats]:
        out = []
        for st in self._snapshot().values():
            if not st.healthy or st.edge in exclude or args.backend not in [b.value for b in st.backends]:
                continue
            inf = self._overlay(st.edge)
            if st.sandboxes + inf.count + 1 > st.max_sandboxes:
                continue
            if st.cpu_reserved + inf.cpu + args.cpu_admitted > st.cpus * st.cpu_overcommit:
                continue
            if st.memory_reserved_mb + inf.memory_mb + args.memory_admitted_mb > st.memory_mb * st.memory_overcommit:
                continue
            out.append(st)
        return out

    def choose(self, args: Demand, exclude: set[str] | None = None) -> str:
        cands = self.eligible(args, exclude or set())
        if not cands:
            raise AdmissionRejected("no healthy edge has room for this sandbox "
                                    f"(asks {args.cpu_admitted:g} cores, {args.memory_admitted_mb} MiB)")
        sample = self.rng.sample(cands, min(self.k, len(cands)))
        return min(sample, key=lambda st: max(self._load(st)[:2])).edge

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
                rec = self._recent.setdefault(edge, _InFlight())
                rec.cpu += args.cpu_admitted
                rec.memory_mb += args.memory_admitted_mb
                rec.count += 1
