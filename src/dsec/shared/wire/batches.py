"""Batch creates as the API takes and shows them: up to 10,000 sandboxes of one args in
one call, accepted at once and tracked by a batch id, each item's outcome reported on
its own (a sandbox id, or the reason it was not made)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from dsec.shared.wire.models import AnySandboxArgs, Strict

MAX_BATCH = 32_768  # one job's 32K sandboxes at once (DSec's biggest ask) in one call
ItemState = Literal["queued", "starting", "running", "failed", "cancelled"]
# failed: an all-or-nothing batch one of whose items could not be made (the rest were not)
BatchState = Literal["running", "done", "cancelled", "failed"]
ITEM_STATES: tuple[ItemState, ...] = ("queued", "starting", "running", "failed", "cancelled")
BATCH_LABEL = "dsec.batch"  # on every sandbox a batch made: <batch id>/<item index>


class BatchRequest(Strict):
    args: AnySandboxArgs
    n: Annotated[int, Field(ge=1, le=MAX_BATCH, description="how many sandboxes, 1-32768")]
    job: str | None = Field(default=None, max_length=128, description="the job they belong to (sets args.job)")
    all_or_nothing: bool = Field(default=False, description=(
        "a gang: quota and edge room for all n are held before it is accepted, or it is refused at once "
        "(429 naming the shortfall) and nothing is made; should an item still fail, the batch fails and "
        "what it made is stopped"))


class BatchCounts(BaseModel):
    queued: int = 0
    starting: int = 0
    running: int = Field(default=0, description="made (the sandbox may have ended since)")
    failed: int = 0
    cancelled: int = 0


class BatchItem(BaseModel):
    index: int
    state: ItemState
    sandbox_id: str | None = None
    error: str | None = Field(default=None, description="the error code of a failed item (quota_exceeded, ...)")
    reason: str | None = Field(default=None, description="why a failed item was not made")


class BatchInfo(BaseModel):
    id: str
    project: str
    job: str | None = None
    n: int
    state: BatchState
    counts: BatchCounts
    created_at: float
    finished_at: float | None = None
    all_or_nothing: bool = False
    reason: str | None = Field(default=None, description="why an all-or-nothing batch failed")
    items: list[BatchItem] = Field(default_factory=list, description="items offset..offset+limit (paged)")
    next_offset: int | None = Field(default=None, description="where the next page starts; None: no more")
    failure_reasons: dict[str, int] = Field(default_factory=dict, description="in lists: why failed items "
                                            "failed, the most common first")


class BatchAdmission(BaseModel):
    """How the batch queue stands: creates starting per edge now and at most so far, and the bound."""

    per_edge_starting: int
    starting: dict[str, int] = Field(default_factory=dict)
    peak_starting: dict[str, int] = Field(default_factory=dict)
    queued: int = 0
