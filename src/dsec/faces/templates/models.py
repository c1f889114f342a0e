"""The wire and record models of template builds: a build's steps as E2B's SDKs send them
(``TemplateBuildStartV2``), what a sandbox made from a template runs with, and what a
finished build (or a cached prefix of one) produced."""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

StepType = Literal["COPY", "ENV", "RUN", "WORKDIR", "USER"]
BuildStatus = Literal["waiting", "building", "ready", "error"]
FILES_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_STEPS = 512
MAX_ARG_BYTES = 256 * 1024
CACHE_VERSION = "dsec-template-cache-1"  # bump when what a step does changes: old cache entries stop matching


class Step(BaseModel):
    """One build step (E2B's ``TemplateStep``)."""

    type: StepType
    args: list[str] = Field(default_factory=list)
    filesHash: str | None = None
    force: bool | None = False
    forceUpload: bool | None = None
    model_config = {"extra": "ignore"}

    @model_validator(mode="after")
    def _shape(self) -> Step:
        if sum(len(a) for a in self.args) > MAX_ARG_BYTES:
            raise ValueError(f"a {self.type} step's arguments exceed {MAX_ARG_BYTES} bytes")
        need = {"COPY": 2, "ENV": 2, "RUN": 1, "WORKDIR": 1, "USER": 1}[self.type]
        if len(self.args) < need:
            raise ValueError(f"a {self.type} step needs at least {need} argument(s), got {len(self.args)}")
        if self.type == "ENV" and len(self.args) % 2:
            raise ValueError("an ENV step's arguments are name, value pairs")
        if self.type == "COPY":
            if self.filesHash is None or not FILES_HASH_RE.match(self.filesHash):
                raise ValueError("a COPY step needs filesHash (the lowercase hex SHA-256 of its files)")
            if len(self.args) > 3 and self.args[3] and not re.fullmatch(r"0?[0-7]{3,4}", self.args[3]):
                raise ValueError(f"a COPY step's mode must be octal, got {self.args[3]!r}")
        return self

    def cache_text(self) -> str:
        """What makes two steps the same step for the cache (Docker's rule: the instruction,
        and for a copy the files' hash)."""
        return json.dumps([self.type, self.args, self.filesHash], separators=(",", ":"))


class TemplateSpec(BaseModel):
    """A build's definition (E2B's ``TemplateBuildStartV2``)."""

    fromImage: str | None = None
    fromTemplate: str | None = None
    fromImageRegistry: dict[str, object] | None = None
    force: bool | None = False
    steps: list[Step] = Field(default_factory=list, max_length=MAX_STEPS)
    startCmd: str | None = None
    readyCmd: str | None = None
    model_config = {"extra": "ignore"}

    @model_validator(mode="after")
    def _base(self) -> TemplateSpec:
        if bool(self.fromImage) == bool(self.fromTemplate):
            raise ValueError("give exactly one of fromImage and fromTemplate")
        return self


class RunConfig(BaseModel):
    """What a sandbox made from a template runs with: the build's final ENV, USER and
    WORKDIR, and its start and ready commands."""

    envs: dict[str, str] = Field(default_factory=dict)
    user: str = "root"
    workdir: str = "/"
    start_cmd: str | None = None
    ready_cmd: str | None = None

    def after(self, step: Step) -> RunConfig:
        """The config once ``step`` has run (ENV, USER and WORKDIR change it)."""
        if step.type == "ENV":
            pairs = dict(zip(step.args[::2], step.args[1::2], strict=True))
            return self.model_copy(update={"envs": {**self.envs, **pairs}})
        if step.type == "USER":
            return self.model_copy(update={"user": self.expand(step.args[0])})
        if step.type == "WORKDIR":
            return self.model_copy(update={"workdir": self.resolve(step.args[0])})
        return self

    def expand(self, text: str) -> str:
        """``$NAME`` and ``${NAME}`` replaced by the build's ENV, as Docker does in WORKDIR,
        COPY and USER (the SDKs send those arguments unexpanded)."""
        return _VAR.sub(lambda m: self.envs.get(m.group(1) or m.group(2), ""), text)

    def resolve(self, path: str) -> str:
        """``path`` as the build sees it: expanded, relative to the current WORKDIR."""
        return posixpath.normpath(posixpath.join(self.workdir, self.expand(path)))


_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


class BuiltTemplate(BaseModel):
    """A build's product: the layer stack a sandbox mounts and the config it runs with."""

    image: str
    layers: list[str] = Field(default_factory=list)
    config: RunConfig = Field(default_factory=RunConfig)


class BuildRequest(BaseModel):
    """E2B's ``TemplateBuildRequestV3``: a template by name (optionally ``name:tag``) and the
    resources its sandboxes get."""

    name: str | None = Field(default=None, min_length=1, max_length=128)
    alias: str | None = Field(default=None, min_length=1, max_length=128)
    tags: list[str] | None = None
    cpuCount: int | None = Field(default=None, ge=1, le=64)
    memoryMB: int | None = Field(default=None, ge=128, le=262144)
    minFreeDiskMB: int | None = Field(default=None, ge=0)
    model_config = {"extra": "ignore"}

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: list[str] | None) -> list[str] | None:
        for t in v or []:
            check_tag(t)
        return v

    def split(self) -> tuple[str, list[str]]:
        """(template name, tags): a tag in the name counts as one more tag."""
        full = self.name or self.alias
        if not full:
            raise ValueError("name is required")
        name, _, tag = full.partition(":")
        check_name(name)
        tags = list(self.tags or [])
        if tag:
            check_tag(tag)
            tags.append(tag)
        return name, sorted(set(tags)) or ["default"]


NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,127}$")
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ValueError(f"template name {name!r}: lowercase letters, digits, '.', '_', '-' and '/', "
                         "at most 128 characters")
    return name


def check_tag(tag: str) -> str:
    if not TAG_RE.match(tag):
        raise ValueError(f"tag {tag!r}: letters, digits, '.', '_' and '-', at most 128 characters")
    return tag


def chain(key: str, text: str) -> str:
    return hashlib.sha256(f"{key}\0{text}".encode()).hexdigest()


def base_key(image: str, layers: list[str], config: RunConfig, project: str) -> str:
    """The first key of a build's cache chain: per project, so that one project's cached
    step (a COPY of its own files under a hash another can predict) is never another's."""
    return chain(CACHE_VERSION, json.dumps([image, layers, config.model_dump(), project], sort_keys=True))
