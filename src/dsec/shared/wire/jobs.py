"""Jobs as the API takes and shows them: a named group of sandboxes of one project (a
training run, an eval sweep) with labels, a quota, and a state the whole group follows."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from dsec.shared.wire.models import Strict

# a job's name is in URLs (/v1/jobs/NAME) and in every sandbox's ``job``: no slashes, no spaces
JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
JobState = Literal["active", "paused", "stopped"]


def check_job_name(v: str) -> str:
    if not JOB_NAME_RE.match(v):
        raise ValueError(f"job name {v!r}: letters, digits, '.', '_' and '-', starting with a letter or digit, "
                         "at most 128")
    return v


def check_labels(v: dict[str, str]) -> dict[str, str]:
    if len(v) > 64:
        raise ValueError("at most 64 labels")
    return v


class JobQuota(Strict):
    """Caps on the job's live sandboxes (starting, running or paused), all together; None: no cap."""

    sandboxes: Annotated[int, Field(ge=0, le=10_000_000)] | None = None
    cpu_cores: Annotated[float, Field(ge=0)] | None = Field(default=None, description="sum of cpu_cores_limit")
    memory_mb: Annotated[int, Field(ge=0)] | None = Field(default=None, description="sum of memory_limit_mb")
    creates_per_s: Annotated[float, Field(ge=0.01, le=1_000_000)] | None = Field(
        default=None, description="creations per second (0.01: one per 100 s, at least), for every worker and "
        "replica of the job together (a second's worth may come at once); past it a create is a 429 "
        "rate_limited with Retry-After")


class JobSpec(Strict):
    name: str
    labels: dict[str, str] = Field(default_factory=dict, description="the job's own labels (to find it by)")
    quota: JobQuota = Field(default_factory=JobQuota)
    checkpoint_every_s: Annotated[int, Field(ge=5, le=7 * 24 * 3600)] | None = Field(
        default=None, description="checkpoint the job's container sandboxes this often unless they say otherwise "
        "(ContainerArgs.checkpoint_every_s; docs/fault-tolerance.md)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_job_name(v)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        return check_labels(v)


class JobInfo(BaseModel):
    name: str
    project: str
    labels: dict[str, str] = Field(default_factory=dict)
    quota: JobQuota = Field(default_factory=JobQuota)
    checkpoint_every_s: int | None = None
    state: JobState = "active"
    created_at: float
    paused_at: float | None = None
    stopped_at: float | None = None


class JobUsage(BaseModel):
    """What the job's live sandboxes hold: the sums the quota caps, and (on request) what they use now."""

    sandboxes: int = 0
    cpu_cores: float = Field(default=0.0, description="sum of cpu_cores_limit")
    memory_mb: int = Field(default=0, description="sum of memory_limit_mb")
    cpu_s: float | None = Field(default=None, description="CPU time used, summed (status?usage=true)")
    memory_bytes: int | None = Field(default=None, description="memory charged now, summed (status?usage=true)")
    swap_bytes: int | None = Field(default=None, description="swap held now, summed (status?usage=true)")


class JobStatus(BaseModel):
    job: JobInfo
    by_state: dict[str, int] = Field(default_factory=dict, description="sandboxes the edges hold, by state")
    by_backend: dict[str, int] = Field(default_factory=dict, description="live sandboxes by backend")
    by_edge: dict[str, int] = Field(default_factory=dict, description="live sandboxes by edge")
    usage: JobUsage = Field(default_factory=JobUsage)
    quota_free: JobQuota = Field(default_factory=JobQuota, description="what the quota still allows (None: no cap)")
    created_last_minute: int = Field(default=0, description="sandboxes created in the last 60 s (of those still held)")
    unreachable_edges: list[str] = Field(default_factory=list, description="edges that did not answer: their "
                                         "sandboxes are missing from these counts")


class JobAction(BaseModel):
    """What pausing, resuming or stopping a job did."""

    job: JobInfo
    changed: list[str] = Field(default_factory=list, description="sandboxes paused, resumed or stopped")
    skipped: list[str] = Field(default_factory=list, description="sandboxes left as they were (busy with requests "
                               "in flight: a pause leaves them running; pause again to catch them)")
