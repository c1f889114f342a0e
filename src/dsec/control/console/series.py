"""The fleet's recent history: every few seconds, what the watcher last saw of each edge
(its counters and load) becomes one sample (rates from counter differences). Reading
the watcher's view costs the edges nothing; each apiserver replica keeps its own hour."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dsec.shared.wire.console import FleetHistory, FleetSample
from dsec.shared.wire.models import NodeStats

log = logging.getLogger("dsec.console")
INTERVAL_S = 5.0
KEEP = 720  # an hour at 5 s


@dataclass
class _Counters:
    started_at: float
    at: float
    creates: int
    failures: int
    create_s: float
    refusals: int
    execs: int


class FleetSeries:
    def __init__(self, view: Callable[[], Mapping[str, NodeStats]], interval_s: float = INTERVAL_S,
                 keep: int = KEEP) -> None:
        self.view = view
        self.interval_s = interval_s
        self.samples: deque[FleetSample] = deque(maxlen=keep)
        self._last: dict[str, _Counters] = {}

    def sample(self, now: float | None = None) -> FleetSample:
        now = time.time() if now is None else now
        creates = failures = refusals = execs = 0
        create_s = 0.0
        dt = 0.0
        sandboxes = up = 0
        cpu: list[float] = []
        mem_total = mem_avail = 0
        seen: dict[str, _Counters] = {}
        for name, st in self.view().items():
            if not st.healthy:
                continue
            up += 1
            sandboxes += st.sandboxes
            if st.host is not None:
                cpu.append(st.host.cpu_pct)
                mem_total += st.host.memory_total_mb
                mem_avail += st.host.memory_available_mb
            sig = st.signals
            if sig is None:
                continue
            cur = _Counters(sig.started_at, now, sig.creates, sig.create_failures, sig.create_seconds,
                            sig.admission_refusals, sig.execs)
            seen[name] = cur
            prev = self._last.get(name)
            if prev is None or prev.started_at != cur.started_at:  # new, or restarted: counters from zero
                continue
            creates += cur.creates - prev.creates
            failures += cur.failures - prev.failures
            create_s += cur.create_s - prev.create_s
            refusals += cur.refusals - prev.refusals
            execs += cur.execs - prev.execs
            dt = max(dt, now - prev.at)
        self._last = seen
        def per(n: int) -> float:
            return round(n / dt, 3) if dt > 0 else 0.0

        s = FleetSample(at=now, sandboxes=sandboxes, creates_per_s=per(creates), create_failures_per_s=per(failures),
                        refusals_per_s=per(refusals),
                        create_ms=round(create_s / creates * 1000, 1) if creates else None,
                        execs_per_s=per(execs), cpu_pct=round(sum(cpu) / len(cpu), 1) if cpu else 0.0,
                        memory_pct=round(100 * (1 - mem_avail / mem_total), 1) if mem_total else 0.0, edges_up=up)
        self.samples.append(s)
        return s

    def history(self, since: float = 0.0) -> FleetHistory:
        return FleetHistory(interval_s=self.interval_s, samples=[s for s in self.samples if s.at > since])

    async def run_forever(self) -> None:
        while True:
            try:
                self.sample()
            except Exception as e:  # a view being replaced under us: the next round
                log.warning("fleet sample: %s", e)
            await asyncio.sleep(self.interval_s)
