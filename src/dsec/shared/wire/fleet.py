"""Wire models of fleet fault tolerance: what an edge reports about its own health, the
detector's verdict on each edge with its evidence, fleet events, and sandbox checkpoints
(what was saved, where, and how long the sandbox was frozen for it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Health = Literal["ok", "suspect", "cordoned"]


class EdgeSignals(BaseModel):
    """Counters an edge keeps since it started (the detector differences two polls) and
    gauges read when polled."""

    started_at: float = Field(description="when this edge process started: counters restart from zero then")
    creates: int = 0
    create_failures: int = Field(0, description="creates that failed on this edge (not admission refusals)")
    create_seconds: float = Field(0.0, description="total seconds the successful creates took")
    admission_refusals: int = 0
    execs: int = 0
    exec_failures: int = Field(0, description="execs that failed for the platform (not a nonzero exit)")
    agent_deadline_misses: int = Field(0, description="calls to a sandbox's agent past their deadline")
    store_errors: int = Field(0, description="reads from the shared layer store that failed")
    disk_used_bytes: int = 0
    disk_total_bytes: int = Field(0, description="the sandbox volume (or the data dir's filesystem)")
    psi_cpu: float = Field(0.0, description="/proc/pressure/cpu some avg10 (%)")
    psi_memory: float = 0.0
    psi_io: float = 0.0


class HostLoad(BaseModel):
    """The node's own load, read from /proc when polled."""

    cpu_pct: float = Field(default=0.0, description="busy share of all CPUs since the previous poll (%)")
    load1: float = 0.0
    memory_total_mb: int = 0
    memory_available_mb: int = 0
    swap_total_mb: int = 0
    swap_free_mb: int = 0


class Evidence(BaseModel):
    """One signal that moved the detector, with its value and what it was compared to."""

    signal: str
    value: float
    baseline: float | None = Field(None, description="the peers' median or this edge's own history")
    threshold: float | None = None
    detail: str = ""


class FleetEvent(BaseModel):
    id: int
    at: float
    edge: str
    sandbox_id: str | None = None
    kind: str = Field(description="suspect, cordoned, recovered, uncordoned, drain, moved, restored, "
                      "restore_failed, lost, ...")
    actor: str = Field(description="detector, controller, or the token id of the operator")
    reason: str
    detail: dict[str, Any] = Field(default_factory=dict)


class CheckpointInfo(BaseModel):
    """One checkpoint of a sandbox: its writable layer's changes since the previous one
    (``delta``) or all of them (``full``), in the shared store."""

    sandbox_id: str
    seq: int
    kind: Literal["full", "delta"]
    edge: str
    digest: str | None = Field(description="this checkpoint's own blob; None when nothing had changed")
    stack: list[str] = Field(description="the blobs a restore stacks over the sandbox's layers, bottom to top")
    bytes: int = Field(description="bytes this checkpoint wrote to the store")
    files: int = Field(description="files, directories and deletions it holds")
    freeze_ms: float = Field(description="how long the sandbox was frozen for it")
    build_ms: float = Field(description="building and uploading it, the sandbox running")
    taken_at: float


class RestoreSpec(BaseModel):
    """What an edge needs to bring a checkpointed sandbox back under its own id."""

    sandbox_id: str
    seq: int
    reason: str = Field(description="why it moves: node lost, drain, operator")


class CheckpointRequest(BaseModel):
    full: bool = Field(False, description="all of the writable layer, not only what changed since the last one")


class DrainReport(BaseModel):
    """What a drain (or a lost node's recovery) did with each sandbox."""

    moved: dict[str, str] = Field(default_factory=dict, description="sandbox -> the edge it runs on now")
    failed: dict[str, str] = Field(default_factory=dict, description="sandbox -> why it did not move")
    left: dict[str, str] = Field(default_factory=dict, description="sandbox -> why it was not moved")
