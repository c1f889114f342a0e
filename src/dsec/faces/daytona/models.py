"""Daytona's wire shapes, as dsec serves them: the request bodies its SDK sends (camelCase on
the wire, as Daytona's OpenAPI documents name them) and the bodies dsec answers with. Only
the fields dsec acts on are typed; the rest of a request is accepted and ignored (or
refused by name in face.py when ignoring it would change what the caller gets)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class Wire(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class BuildInfo(Wire):
    dockerfile_content: str | None = None
    context_hashes: list[str] | None = None


class VolumeMount(Wire):
    volume_id: str
    mount_path: str


class CreateSandbox(Wire):
    name: str | None = Field(default=None, max_length=128)
    snapshot: str | None = Field(default=None, max_length=512)
    user: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    public: bool | None = None
    cpu: int | None = Field(default=None, ge=1, le=64)
    gpu: int | None = Field(default=None, ge=0)
    memory: int | None = Field(default=None, ge=1, le=512, description="GiB")
    disk: int | None = Field(default=None, ge=1, le=1024, description="GiB")
    auto_stop_interval: int | None = Field(default=None, ge=0, description="idle minutes before it stops")
    auto_pause_interval: int | None = Field(default=None, ge=0)
    auto_archive_interval: int | None = Field(default=None, ge=0)
    auto_delete_interval: int | None = Field(default=None, ge=-1, description="minutes stopped before deletion")
    ttl_minutes: int | None = Field(default=None, ge=0)
    volumes: list[VolumeMount] | None = None
    build_info: BuildInfo | None = None
    network_block_all: bool | None = None
    network_allow_list: str | None = None


class Labels(Wire):
    labels: dict[str, str]


class Sandbox(Wire):
    """Daytona's Sandbox DTO (also its list item): what the SDK requires, and the state."""

    id: str
    organization_id: str
    name: str
    snapshot: str | None = None
    user: str
    env: dict[str, str]
    labels: dict[str, str]
    public: bool = False
    network_block_all: bool = False
    kvm: bool = False
    target: str
    cpu: int
    gpu: int = 0
    memory: int
    disk: int
    state: str
    desired_state: str
    error_reason: str | None = None
    auto_stop_interval: int | None = None
    auto_archive_interval: int | None = None
    auto_delete_interval: int | None = None
    created_at: str
    updated_at: str
    toolbox_proxy_url: str


class SandboxPage(Wire):
    items: list[Sandbox]
    next_cursor: str | None = None


class Url(Wire):
    url: str


class PreviewUrl(Wire):
    sandbox_id: str
    url: str
    token: str


class ErrorBody(Wire):
    """Daytona's error envelope: what its SDK reads the message, code and source from."""

    status_code: int
    message: str
    error: str
    code: str | None = None
    source: str | None = None
    field: str | None = None  # dsec's: the request field at fault
    path: str | None = None
    timestamp: str | None = None


# ---- toolbox ----

class ExecuteRequest(Wire):
    command: str
    cwd: str | None = None
    envs: dict[str, str] | None = None
    timeout: int | None = Field(default=None, ge=0, le=24 * 3600, description="seconds; 0 or none: no limit")


class ExecuteResponse(Wire):
    exit_code: int
    result: str


class CodeRunRequest(Wire):
    code: str
    language: str = "python"
    argv: list[str] | None = None
    envs: dict[str, str] | None = None
    timeout: int | None = Field(default=None, ge=0, le=24 * 3600)


class CreateSession(Wire):
    session_id: str


class SessionExecute(Wire):
    command: str
    run_async: bool | None = None
    async_: bool | None = Field(default=None, alias="async")  # the older name of runAsync


class SessionExecuteResponse(Wire):
    cmd_id: str
    output: str | None = None
    stdout: str | None = None
    stderr: str | None = None
    exit_code: int | None = None


class Command(Wire):
    id: str
    command: str
    exit_code: int | None = None


class Session(Wire):
    session_id: str
    commands: list[Command]


class CommandLogs(Wire):
    output: str
    stdout: str
    stderr: str


class FileInfo(Wire):
    name: str
    path: str
    is_dir: bool
    size: int
    mode: str
    permissions: str
    owner: str
    group: str
    mod_time: str


class Match(Wire):
    file: str
    line: int
    content: str


class SearchResult(Wire):
    files: list[str]


class ReplaceRequest(Wire):
    files: list[str]
    pattern: str
    new_value: str


class ReplaceResult(Wire):
    file: str
    success: bool
    error: str | None = None


class DownloadRequest(Wire):
    paths: list[str] = Field(max_length=1000)


class Dir(Wire):
    dir: str


class GitClone(BaseModel):
    url: str
    path: str
    branch: str | None = None
    commit_id: str | None = None
    depth: int | None = Field(default=None, ge=1)
    username: str | None = None
    password: str | None = None
    model_config = ConfigDict(extra="ignore")


class GitAdd(BaseModel):
    path: str
    files: list[str]
    model_config = ConfigDict(extra="ignore")


class GitCommit(BaseModel):
    path: str
    message: str
    author: str
    email: str
    allow_empty: bool = False
    model_config = ConfigDict(extra="ignore")


class GitFileStatus(Wire):
    name: str
    staging: str
    worktree: str
    extra: str = ""


class GitStatus(Wire):
    current_branch: str
    file_status: list[GitFileStatus]
    ahead: int = 0
    behind: int = 0
    branch_published: bool = False
