"""Admission arithmetic, in one place: whether a node with this much room admits a
sandbox asking this much. The edge decides with its exact reservations (and has the final
word); placement asks the same question of the watcher's snapshot plus its own in-flight
placements, so most refusals never reach an edge."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from dsec.shared.wire.models import NodeStats


class Demand(Protocol):
    """What admission needs to know of a sandbox request (any backend's args)."""

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


@dataclass(frozen=True)
class Room:
    """A node's capacity and what is reserved on it."""

    cpus: float
    cpu_overcommit: float
    memory_mb: int
    memory_overcommit: float
    max_sandboxes: int
    cpu_reserved: float = 0.0
    memory_reserved_mb: int = 0
    sandboxes: int = 0

    @classmethod
    def of(cls, st: NodeStats, cpu: float = 0.0, memory_mb: int = 0, count: int = 0) -> Room:
        """A watcher snapshot's room, with ``cpu``/``memory_mb``/``count`` more reserved."""
        return cls(st.cpus, st.cpu_overcommit, st.memory_mb, st.memory_overcommit, st.max_sandboxes,
                   st.cpu_reserved + cpu, st.memory_reserved_mb + memory_mb, st.sandboxes + count)

    @property
    def cpu_cap(self) -> float:
        return self.cpus * self.cpu_overcommit

    @property
    def memory_cap_mb(self) -> int:
        return int(self.memory_mb * self.memory_overcommit)

    def fits(self, demand: Demand) -> int:
        """How many more sandboxes asking ``demand`` it admits."""
        k = self.max_sandboxes - self.sandboxes
        if demand.cpu_admitted > 0:
            k = min(k, math.floor((self.cpu_cap - self.cpu_reserved) / demand.cpu_admitted + 1e-9))
        if demand.memory_admitted_mb > 0:
            k = min(k, (self.memory_cap_mb - self.memory_reserved_mb) // demand.memory_admitted_mb)
        return max(0, k)

    def load(self) -> float:
        """How full it is: the larger of its CPU and memory shares."""
        return max(self.cpu_reserved / self.cpu_cap, self.memory_reserved_mb / self.memory_cap_mb)


@dataclass(frozen=True)
class Refusal:
    message: str  # completes "edge NAME ..."
    field: str | None = None


def refusal(room: Room, demand: Demand) -> Refusal | None:
    """Why ``room`` cannot take ``demand``, or None when it can."""
    if room.sandboxes + 1 > room.max_sandboxes:
        return Refusal(f"is at its sandbox limit ({room.max_sandboxes})")
    if room.cpu_reserved + demand.cpu_admitted > room.cpu_cap:
        return Refusal(f"has {room.cpu_cap - room.cpu_reserved:.2f} of {room.cpu_cap:.0f} schedulable cores left, "
                       f"asked {demand.cpu_admitted:g}", "cpu_request")
    if room.memory_reserved_mb + demand.memory_admitted_mb > room.memory_cap_mb:
        return Refusal(f"has {room.memory_cap_mb - room.memory_reserved_mb} of {room.memory_cap_mb} MiB admissible "
                       f"memory left, asked {demand.memory_admitted_mb}", "memory_request_mb")
    return None
