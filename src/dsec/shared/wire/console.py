"""Wire models of what the web console and ``dsec top`` read (docs/console.md): a query
over the fleet's sandboxes that each edge answers for itself (filtered, sorted, paged,
with counts), a node's host load, the fleet's recent history, FnCall pool occupancy and
the layer catalog's lineage."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from dsec.shared.wire.fleet import FleetEvent
from dsec.shared.wire.models import SandboxInfo, Strict
from dsec.shared.wire.nodes import NodeInfo

SortKey = Literal["created", "-created", "last_active", "-last_active", "cpu", "-cpu", "memory", "-memory"]
MAX_PAGE = 500
# an edge answers at most this many items of one query: a page deeper than this is refused
# (a 10,000-sandbox fleet pages through its newest first; older ones are found by filter)
MAX_WINDOW = 10_000


class SandboxQuery(Strict):
    """Which sandboxes, in what order, which page. Every filter is optional; they combine
    with AND. Each edge answers it for its own sandboxes and the apiserver merges."""

    q: str = Field(default="", max_length=200, description="a substring of the id, image, "
                   "job, edge or a label key=value")
    state: list[str] = Field(default_factory=list, max_length=10, description="any of these states")
    backend: list[str] = Field(default_factory=list, max_length=5, description="any of these backends")
    job: str | None = Field(default=None, max_length=200)
    labels: dict[str, str] = Field(default_factory=dict, max_length=20)
    project: str | None = Field(default=None, max_length=200, description="exactly this project")
    edge: str | None = Field(default=None, max_length=200)
    sort: SortKey = Field(default="-created", description="a leading '-' sorts descending")
    offset: int = Field(default=0, ge=0, le=MAX_WINDOW)
    limit: int = Field(default=50, ge=0, le=MAX_PAGE)
    usage: bool = Field(default=False, description="fill each item's usage (always, when sorting by cpu or memory)")
    # set by the apiserver from the caller's token, never by the caller
    scope: str | None = Field(default=None, description="only this project (None: every project)")
    scope_subtree: bool = Field(default=False, description="scope's sub-projects too (a subtree's admin)")


class SandboxPage(BaseModel):
    total: int = Field(description="sandboxes matching the filters (all pages)")
    offset: int
    limit: int
    items: list[SandboxInfo]
    states: dict[str, int] = Field(default_factory=dict, description="matching sandboxes by state")
    backends: dict[str, int] = Field(default_factory=dict, description="matching sandboxes by backend")
    jobs: dict[str, dict[str, int]] = Field(default_factory=dict, description="matching sandboxes by job, then "
                                            "by state (the 50 largest jobs)")
    unreachable: list[str] = Field(default_factory=list, description="edges that did not answer (their "
                                   "sandboxes are missing)")


class FleetSample(BaseModel):
    """One point of the fleet's history (the apiserver samples what the watcher last saw)."""

    at: float
    sandboxes: int = 0
    creates_per_s: float = 0.0
    create_failures_per_s: float = 0.0
    refusals_per_s: float = 0.0
    create_ms: float | None = Field(default=None, description="mean create latency over "
                                    "the interval (None: no creates)")
    execs_per_s: float = 0.0
    cpu_pct: float = Field(default=0.0, description="mean host CPU busy over the edges")
    memory_pct: float = Field(default=0.0, description="memory in use over all edges")
    edges_up: int = 0


class FleetHistory(BaseModel):
    interval_s: float
    samples: list[FleetSample]
    shown: bool = Field(default=True, description="False: the fleet's history is the cluster's admin's to see")


class FleetOverview(BaseModel):
    """``GET /v1/console/fleet``: the fleet at a glance."""

    nodes: list[NodeInfo]
    sandboxes: SandboxPage = Field(description="the caller's sandboxes: counts only (no items)")
    history: FleetHistory
    events: list[FleetEvent] = Field(default_factory=list, description="the newest fleet events (the cluster's "
                                     "admin only)")


class FnCallPoolStats(BaseModel):
    image: str
    layers: list[str] = Field(default_factory=list)
    containers: int = 0
    workers: int = 0
    busy: int = 0
    waiting: int = Field(default=0, description="calls waiting for a worker")
    starting: int = Field(default=0, description="containers being started")
    error: str | None = None


class FnCallStats(BaseModel):
    edge: str
    max_containers: int = 0
    pools: list[FnCallPoolStats] = Field(default_factory=list)
    calls: int = 0
    statuses: dict[str, int] = Field(default_factory=dict, description="calls by the status of their result")
    verdicts: dict[str, int] = Field(default_factory=dict, description="test cases by verdict")
    errors: int = Field(default=0, description="calls that failed for the platform")
    shown: bool = Field(default=True, description="False: the counters are the cluster's admin's to see")


class LayerCacheStats(BaseModel):
    """A layer's on-demand reads summed over the edges."""

    hits: int = 0
    misses: int = 0
    prefetched: int = 0
    remote_bytes: int = 0
    errors: int = 0

    @property
    def hit_rate(self) -> float | None:
        reads = self.hits + self.misses
        return self.hits / reads if reads else None


class LayerNode(BaseModel):
    """A layer with where it came from: the image and layers under it when it was taken
    from a sandbox (its parent is the topmost of those)."""

    ref: str
    kind: str
    size: int
    created_at: float
    parent: str | None = Field(default=None, description="the layer it was taken on top of (its lineage)")
    owner: str | None = None
    visibility: str = "public"
    source: str = ""
    children: int = 0
    cache: LayerCacheStats = Field(default_factory=LayerCacheStats)
    hit_rate: float | None = None


class LayerCatalog(BaseModel):
    total: int
    items: list[LayerNode]
