"""IAM as the API takes and shows it: tokens, projects (a tree, by path) with quotas, usage,
and the IAM events."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from dsec.shared.wire.models import SandboxInfo, Strict

PROJECT_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")  # one segment of a project's path (fullmatch)
MAX_PROJECT_DEPTH = 8
TokenRole = Literal["admin", "builder", "runner", "reader"]
# the quota's resources, as fields of ProjectQuota and Usage
RESOURCES = ("sandboxes", "cpu_cores", "memory_mb", "disk_mb", "starting")
# the label that puts a sandbox in a project
PROJECT_LABEL = "dsec.project"


def check_project(v: str) -> str:
    """A project's path: segments of PROJECT_RE joined by "/", at most MAX_PROJECT_DEPTH deep
    ("rl-team/agentic-swe"). A path names its parents, so the tree can have no cycle."""
    parts = v.split("/")
    if len(parts) > MAX_PROJECT_DEPTH:
        raise ValueError(f"project {v!r}: at most {MAX_PROJECT_DEPTH} levels")
    for part in parts:
        if not PROJECT_RE.fullmatch(part) or part in (".", ".."):
            raise ValueError(f"project {v!r}: each '/'-separated part is lowercase letters, digits, '.', '_' and '-', "
                             "starting with a letter or digit, at most 63")
    return v


def parent_of(project: str) -> str | None:
    return project.rsplit("/", 1)[0] if "/" in project else None


def lineage(project: str) -> list[str]:
    """The project's ancestors, root first, and the project itself."""
    parts = project.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def within(project: str, root: str) -> bool:
    """``project`` is ``root`` or in its subtree."""
    return project == root or project.startswith(root + "/")


class TokenSpec(BaseModel):
    project: str = Field(description="the project the token acts in (a path: team/sub-team)")
    role: TokenRole = Field(description="admin administers the project's subtree (sub-projects, their quotas, "
                            "tokens); builder publishes environments; runner only runs them; reader only reads")
    name: str = Field(default="", max_length=128)
    ttl_s: float | None = Field(default=None, gt=0, le=10 * 365 * 86400,
                                description="it stops working this many seconds after it is made (None: never)")

    @field_validator("project")
    @classmethod
    def _project(cls, v: str) -> str:
        return check_project(v)


class TokenInfo(BaseModel):
    id: str
    project: str
    role: str
    name: str
    created_at: float
    expires_at: float | None = None
    created_by: str | None = Field(default=None, description="the token id that made it ('admin': the node's own)")
    token: str | None = Field(default=None, description="the secret, shown once, when the token is created")


class IamEvent(BaseModel):
    """One IAM change: who (a token id; "admin" is the node's own token), what, when."""

    id: int
    at: float
    actor: str
    action: str
    target: str
    project: str | None = Field(default=None, description="the project it changed (None: cluster-wide)")
    detail: dict[str, Any] = Field(default_factory=dict)


class ProjectQuota(Strict):
    """Caps on what a project's whole subtree holds at once; None: no cap of its own (it
    draws on its parent's). A paused sandbox holds its memory and disk, not its CPU."""

    sandboxes: Annotated[int, Field(ge=0, le=100_000_000)] | None = Field(
        default=None, description="sandboxes starting, running or paused")
    cpu_cores: Annotated[float, Field(ge=0, le=100_000_000)] | None = Field(
        default=None, description="sum of cpu_cores_limit of running ones")
    memory_mb: Annotated[int, Field(ge=0, le=1 << 50)] | None = Field(default=None,
                                                                       description="sum of memory_limit_mb")
    disk_mb: Annotated[int, Field(ge=0, le=1 << 50)] | None = Field(
        default=None, description="sum of disk_limit_mb (containers) and disk_mb (VMs)")
    starting: Annotated[int, Field(ge=0, le=1_000_000)] | None = Field(
        default=None, description="creates in flight at once")
    fncall_per_s: Annotated[float, Field(ge=0, le=10_000_000)] | None = Field(
        default=None, description="FnCall calls per second (a token bucket per apiserver replica, holding a "
        "second's worth)")


class Usage(BaseModel):
    """What a project's subtree (or a job) holds now, by admission's count."""

    sandboxes: int = 0
    cpu_cores: float = 0.0
    memory_mb: int = 0
    disk_mb: int = 0
    starting: int = 0


class ProjectSpec(Strict):
    name: str = Field(description="a path: 'rl-team', 'rl-team/agentic-swe'; its parent must exist")
    quota: ProjectQuota = Field(default_factory=ProjectQuota)
    description: str = Field(default="", max_length=1024)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_project(v)


class ProjectPatch(Strict):
    """A change of quota: the resources named are set (null: no cap of its own); the others kept."""

    quota: ProjectQuota
    description: str | None = Field(default=None, max_length=1024)


class ProjectInfo(BaseModel):
    name: str
    parent: str | None = None
    description: str = ""
    quota: ProjectQuota = Field(default_factory=ProjectQuota)
    usage: Usage = Field(default_factory=Usage, description="the whole subtree's")
    delegated: Usage = Field(default_factory=Usage, description="what its sub-projects' quotas carve from it")
    created_at: float
    created_by: str | None = None
    children: list[ProjectInfo] | None = Field(default=None, description="with ?tree=true: the sub-projects")
    jobs: dict[str, Usage] | None = Field(default=None, description="with ?tree=true: its own jobs' usage")


def project_of_sandbox(info: SandboxInfo) -> str | None:
    """A sandbox's project: its ``dsec.project`` label; without one (made by the cluster's
    admin) "default"; None for the platform's own FnCall pool containers, which run every
    project's code and belong to none."""
    project = info.labels.get(PROJECT_LABEL)
    if project is not None:
        return project
    return None if info.labels.get("dsec-role") == "fncall" else "default"
