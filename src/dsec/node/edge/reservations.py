"""What the sandboxes on an edge reserve (CPU, memory, a count, sandboxes per job), kept
as running sums that each change moves, so that an admission and the stats cost the same
with 10 sandboxes held as with 4,000 (a sum over every sandbox per create was a third of
the hollow fleet's CPU at 90K held, bench/scale.py). The edge calls :meth:`update` where a
sandbox's share can change (it arrives, pauses, resumes, its memory is sampled, it starts
stopping) and :meth:`drop` when it leaves; :meth:`recount` is the sum from scratch, which
the edge's sweep compares every ten minutes (a missed update is logged and corrected)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import NamedTuple

from dsec.node.edge.sandbox import Sandbox
from dsec.shared.wire.models import SandboxState

log = logging.getLogger("dsec.edge")
MICRO = 1_000_000  # CPU in millionths of a core: sums that move both ways never drift


class Share(NamedTuple):
    cpu_u: int
    memory_mb: int
    job: str | None


class Totals(NamedTuple):
    cpu: float
    memory_mb: int
    sandboxes: int


def share_of(sb: Sandbox) -> Share | None:
    """A sandbox's reservation: its request (a share of its limit for best-effort work, the
    limit for latency-sensitive work and VMs), or the memory it holds now if that is more.
    A paused one reserves no CPU and only what it still holds (its memory is in swap, or a
    VM's in a file): that is what lets idle sandboxes be packed far beyond the running
    ones. A stopping one reserves nothing."""
    if sb.stopping:
        return None
    info = sb.rec.info
    if info.state == SandboxState.paused and info.pause is not None:
        return Share(0, max(1, info.pause.memory_after_bytes >> 20), info.job)
    args = sb.rec.args
    return Share(round(args.cpu_admitted * MICRO), max(args.memory_admitted_mb, sb.memory_held_mb), info.job)


class Reservations:
    """The running sums; one per edge, touched only from its event loop."""

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self._shares: dict[str, Share] = {}
        self._cpu_u = 0
        self._memory_mb = 0
        self._jobs: dict[str, int] = {}

    def update(self, sb: Sandbox) -> None:
        self._set(sb.id, share_of(sb))

    def drop(self, sandbox_id: str) -> None:
        self._set(sandbox_id, None)

    def _set(self, sid: str, new: Share | None) -> None:
        old = self._shares.pop(sid, None)
        if old == new:
            if new is not None:
                self._shares[sid] = new
            return
        if old is not None:
            self._cpu_u -= old.cpu_u
            self._memory_mb -= old.memory_mb
            if old.job:
                left = self._jobs[old.job] - 1
                if left:
                    self._jobs[old.job] = left
                else:
                    del self._jobs[old.job]
        if new is not None:
            self._shares[sid] = new
            self._cpu_u += new.cpu_u
            self._memory_mb += new.memory_mb
            if new.job:
                self._jobs[new.job] = self._jobs.get(new.job, 0) + 1

    def totals(self) -> Totals:
        return Totals(self._cpu_u / MICRO, self._memory_mb, len(self._shares))

    def per_job(self) -> dict[str, int]:
        return dict(self._jobs)

    def recount(self, sandboxes: Iterable[Sandbox]) -> int:
        """Sum again from scratch; adopt the result. Returns how many sandboxes' shares had
        drifted (0 unless an update was missed somewhere)."""
        fresh = {sb.id: s for sb in sandboxes if (s := share_of(sb)) is not None}
        drifted = sum(1 for sid in fresh.keys() | self._shares.keys() if fresh.get(sid) != self._shares.get(sid))
        if drifted:
            log.warning("edge reservations: %d sandbox share(s) had drifted from their sandboxes; recounted",
                        drifted)
            self._clear()
            for sid, s in fresh.items():
                self._set(sid, s)
        return drifted
